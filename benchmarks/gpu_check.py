"""Every GPU path of eogp-index, run once on the shipped model and compared with its CPU result.

One command for a machine with a CUDA GPU::

    python benchmarks/gpu_check.py                 # --device cuda
    python benchmarks/gpu_check.py --device cpu    # the same checks with CPU stand-ins (the test suite)

On the shipped model (``examples/default/model``) and the first ``--documents`` training
documents it runs, each on ``--device`` and on the CPU, and compares the two:

====================  =====================================================================
fit                   EK-FAC curvature and PCA fitted on the device; the unquantized projected
                      scores ``<y_q, x_d>`` of the queries against the documents, each index
                      projecting its own (PCA bases may differ by signs, scores may not)
ingest                the documents ingested with the model on the device: stored signs and
                      scales, then the ranking those rows give
query (torch scan)    the torch scan kernel on the device against the CPU (numba) kernel, every
                      row; then ``eogp query``'s route on the device (query gradients there too)
explain               per-module and per-token explanations of the top hits
serve                 ``eogp serve``'s app (uvicorn on a local port) answering ``POST /v1/query``
faiss                 ``query --candidates`` through the flat first pass (FAISS RaBitQ, on
                      the CPU), every row a candidate, against the exact scan
ingest x2 (NCCL)      ``torchrun --nproc_per_node 2 eogp ingest`` (NCCL on 2 GPUs; Gloo with
                      ``--device cpu``) against the one-process CPU ingest
====================  =====================================================================

A stage passes when its rankings are identical and its scores agree within ``--rtol`` of the
largest score of each query (float32 sums in another order, on another device). Two hits whose
CPU scores lie within that tolerance of each other are a tie, and may come in either order;
the report counts such swaps. Stored sign bits may differ only for coordinates that sit at zero
within the same tolerance (at most ``--rtol`` of the bits). A stage that cannot run here (no
GPU FAISS build, fewer than 2 GPUs for NCCL) is reported as SKIPPED with the reason, never as
passed. Exit status: 0 when no stage failed.

Usage: python benchmarks/gpu_check.py [--device cuda] [--documents 64] [-k 32] [--max-tokens 128]
                                     [--work DIR] [--json PATH]

``--json PATH`` also writes the report as one JSON object (``--json -`` prints it instead).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
from common import add_json_argument, prints_json, write_json

from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "examples" / "default"
BATCH = 8
FAISS_NAME = "gpu-check"


@dataclass
class Stage:
    """One line of the report: a stage's verdict and what was compared."""

    name: str
    status: str = "FAILED"  # ok | FAILED | SKIPPED
    detail: str = ""
    numbers: Dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


class Mismatch(Exception):
    """A device result that differs from its CPU result beyond the stated tolerance."""


class Skip(Exception):
    """A stage that cannot run on this machine (said why, never counted as passed)."""


@dataclass
class Comparison:
    """The worst disagreements seen over a stage's comparisons."""

    rtol: float
    max_rel: float = 0.0
    ties_swapped: int = 0
    compared: int = 0

    def scores(self, what: str, ref: np.ndarray, got: np.ndarray) -> None:
        """Scores ``(nq, n)``: ``|got - ref| <= rtol * max|ref|`` per query row."""
        ref, got = np.atleast_2d(np.asarray(ref, np.float64)), np.atleast_2d(np.asarray(got, np.float64))
        if ref.shape != got.shape:
            raise Mismatch(f"{what}: shapes differ, CPU {ref.shape} vs device {got.shape}")
        scale = np.maximum(np.abs(ref).max(axis=1, keepdims=True), np.finfo(np.float32).tiny)
        rel = float((np.abs(got - ref) / scale).max()) if ref.size else 0.0
        self.max_rel = max(self.max_rel, rel)
        self.compared += ref.size
        if rel > self.rtol:
            raise Mismatch(f"{what}: scores differ by {rel:.2e} of the largest score (tolerance {self.rtol:.0e})")

    def ranking(self, what: str, ref_ids: List[str], ref_scores, got_ids: List[str], got_scores) -> None:
        """Identical rankings, except that hits tied within the tolerance may swap places."""
        ref_scores, got_scores = np.asarray(ref_scores, np.float64), np.asarray(got_scores, np.float64)
        if len(ref_ids) != len(got_ids):
            raise Mismatch(f"{what}: {len(got_ids)} hits on the device, {len(ref_ids)} on the CPU")
        scale = max(float(np.abs(ref_scores).max(initial=0.0)), np.finfo(np.float32).tiny)
        ref_by_id = dict(zip(ref_ids, ref_scores))
        for rank, (a, b) in enumerate(zip(ref_ids, got_ids)):
            if a == b:
                continue
            if b not in ref_by_id or abs(ref_by_id[b] - ref_scores[rank]) > self.rtol * scale:
                raise Mismatch(
                    f"{what}: rank {rank + 1} is {b!r} on the device, {a!r} on the CPU "
                    f"(not a tie within {self.rtol:.0e})"
                )
            self.ties_swapped += 1
        self.scores(what, ref_scores, got_scores)

    def summary(self) -> str:
        ties = f", {self.ties_swapped} tied hits swapped" if self.ties_swapped else ""
        return f"max score difference {self.max_rel:.1e} of the largest (tolerance {self.rtol:.0e}){ties}"


def _flat(table, column: str) -> np.ndarray:
    """A fixed-size list column's values, flattened, as numpy."""
    return table.column(column).combine_chunks().flatten().to_numpy(zero_copy_only=False)


def _ranked(table) -> tuple[List[str], np.ndarray]:
    """Ids and scores of an answer table, positive hits then negative ones."""
    rows = table.to_pylist()
    return [f"{r.get('direction', '')}:{r['id']}" for r in rows], np.array([r["score"] for r in rows])


class Check:
    """The shared inputs of the stages: shards, queries, the CPU reference index and its answers."""

    def __init__(self, work: Path, device: str, documents: int, k: int, rtol: float, top: int, max_tokens: int):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.work, self.device, self.k, self.rtol, self.top = work, device, k, rtol, top
        self.max_tokens = max_tokens
        self.model_dir = str(SHIPPED / "model")
        self.shards = self._write_shards(documents)
        self.queries = [json.loads(line)["text"] for line in (SHIPPED / "queries.jsonl").read_text().splitlines()[:3]]
        self.cpu: Optional[object] = None  # the CPU index, ingested on the CPU

    def _write_shards(self, documents: int) -> List[Path]:
        """Two JSONL shards of whole gradient batches (every run then projects the same batches)."""
        with gzip.open(SHIPPED / "corpus" / "train.jsonl.gz", "rt") as f:
            records = [json.loads(line) for _, line in zip(range(documents), f)]
        half = (len(records) // 2 // BATCH) * BATCH
        shards = []
        for i, part in enumerate((records[:half], records[half:])):
            path = self.work / "data" / f"part-{i}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in part))
            shards.append(path)
        return shards

    def gradients(self, device: str) -> GradientConfig:
        return GradientConfig(batch_size=BATCH, max_tokens=self.max_tokens, device=device)

    def fit(self, out: Path, device: str):
        from eogp_index.client import AttributionIndex
        from eogp_index.gradients.model import load_model
        from ingest.records import Example, RecordSpec, iter_examples

        model, tokenizer = load_model(self.model_dir, device=device)
        examples = [
            e
            for e in iter_examples(self.shards, RecordSpec(max_tokens=self.max_tokens), tokenizer)
            if isinstance(e, Example)
        ]
        return AttributionIndex.create(
            out,
            model,
            tokenizer,
            examples,
            model_name=self.model_dir,
            projection=ProjectionConfig(k=self.k, num_fit_examples=len(examples)),
            curvature=CurvatureConfig(num_examples=len(examples), batch_size=BATCH),
            gradients=self.gradients(device),
            progress=False,
        )

    def open(self, path: Path, device: str):
        from eogp_index.client import AttributionIndex

        return AttributionIndex.open(path, gradients=self.gradients(device))

    def ingest(self, index) -> None:
        from ingest.pipeline import run_ingest
        from ingest.records import RecordSpec

        run_ingest(index, self.shards, spec=RecordSpec(id_field="id"), batch_size=BATCH, progress=False)

    def projected_scores(self, index) -> np.ndarray:
        """``(nq, n)`` unquantized ``<y_q, x_d>`` of the queries against every document."""
        from ingest.records import Example, RecordSpec, iter_examples

        examples = [
            e
            for e in iter_examples(self.shards, RecordSpec(max_tokens=self.max_tokens), index.tokenizer)
            if isinstance(e, Example)
        ]
        return index.query_coordinates(self.queries) @ index.project(examples).T

    def answers(self, index, *, coordinates=None, candidates: Optional[int] = None):
        search = index.search(self.queries, many=True).limit(self.top).direction("both")
        if candidates is not None:
            search = search.candidates(candidates, faiss_name=FAISS_NAME)
        return search.to_list(coordinates=coordinates)

    def compare_answers(self, comparison: Comparison, what: str, ref_tables, got_tables) -> None:
        for q, (ref, got) in enumerate(zip(ref_tables, got_tables)):
            comparison.ranking(f"{what}, query {q}", *_ranked(ref), *_ranked(got))

    def stored_rows(self, path: Path):
        from eogp_index.store.stored_index import StoredIndex

        return StoredIndex.open(path).store.read(["id", "signs", "scales"]).sort_by("id")

    def compare_rows(self, comparison: Comparison, what: str, ref_path: Path, got_path: Path) -> Dict[str, float]:
        """Same ids; sign bits equal but for at most ``rtol`` of them; scales within float16 rounding."""
        ref, got = self.stored_rows(ref_path), self.stored_rows(got_path)
        if ref.column("id").to_pylist() != got.column("id").to_pylist():
            raise Mismatch(f"{what}: stored ids differ ({got.num_rows} rows on the device, {ref.num_rows} on the CPU)")
        flipped = float(np.mean(np.unpackbits(_flat(ref, "signs")) != np.unpackbits(_flat(got, "signs"))))
        scales = lambda t: _flat(t, "scales").astype(np.float64)  # noqa: E731
        scale_rel = float(np.max(np.abs(scales(got) - scales(ref)) / np.maximum(np.abs(scales(ref)), 1e-30)))
        if flipped > comparison.rtol:
            raise Mismatch(f"{what}: {flipped:.2e} of the stored sign bits differ (tolerance {comparison.rtol:.0e})")
        if scale_rel > 2 * 2.0**-10:  # two float16 ulps: both sides round an almost equal float32
            raise Mismatch(f"{what}: stored scales differ by {scale_rel:.2e} relative")
        return {"rows": ref.num_rows, "sign_bits_flipped": flipped, "scale_max_rel": scale_rel}


# -- the stages ------------------------------------------------------------------------------------
def stage_fit(check: Check, comparison: Comparison) -> str:
    dev = check.fit(check.work / "fit-device", check.device)
    cpu = check.fit(check.work / "cpu", "cpu")
    shutil.copytree(cpu.path, check.work / "fitted")  # empty: what each ingest starts from
    ref, got = check.projected_scores(cpu), check.projected_scores(check.open(dev.path, "cpu"))
    comparison.scores("projected scores", ref, got)
    for q in range(ref.shape[0]):
        order_ref, order_got = np.argsort(-ref[q])[: check.top], np.argsort(-got[q])[: check.top]
        comparison.ranking(
            f"projected top {check.top}, query {q}",
            [str(i) for i in order_ref],
            ref[q, order_ref],
            [str(i) for i in order_got],
            got[q, order_got],
        )
    return f"{ref.shape[1]} documents x {ref.shape[0]} queries; " + comparison.summary()


def stage_ingest(check: Check, comparison: Comparison) -> str:
    shutil.copytree(check.work / "fitted", check.work / "ingest-device")
    check.cpu = check.open(check.work / "cpu", "cpu")
    check.ingest(check.cpu)
    check.ingest(check.open(check.work / "ingest-device", check.device))
    rows = check.compare_rows(comparison, "stored rows", check.work / "cpu", check.work / "ingest-device")
    check.compare_answers(
        comparison,
        "ranking of the stored rows",
        check.answers(check.cpu),
        check.answers(check.open(check.work / "ingest-device", "cpu")),
    )
    return (
        f"{rows['rows']} rows, {rows['sign_bits_flipped']:.1e} of the sign bits flipped, scales within "
        f"{rows['scale_max_rel']:.1e}; " + comparison.summary()
    )


def stage_torch_scan(check: Check, comparison: Comparison) -> str:
    from eogp_index.search.scan import scan_scores, scan_scores_torch

    stored = check.cpu.stored
    hot = stored.hot_codes()
    y = check.cpu.query_coordinates(check.queries)
    reference = scan_scores(hot.encoded.signs, hot.encoded.scales, y, stored.layout)
    on_device = scan_scores_torch(hot.encoded.signs, hot.encoded.scales, y, stored.layout, check.device)
    comparison.scores("torch scan, every row", reference, on_device.cpu().numpy())
    # The query route on the device: query gradients there, then (on CUDA) the torch searcher.
    device_index = check.open(check.cpu.path, check.device)
    comparison.scores("query coordinates", y, device_index.query_coordinates(check.queries))
    check.compare_answers(comparison, "eogp query", check.answers(check.cpu), check.answers(device_index))
    return (
        f"{hot.num_rows} rows; searcher {type(device_index.search(check.queries[0]).searcher()).__name__}; "
        + comparison.summary()
    )


def stage_explain(check: Check, comparison: Comparison) -> str:
    device_index = check.open(check.cpu.path, check.device)
    ids = check.answers(check.cpu)[0].column("id").to_pylist()[:3]
    ref, got = check.cpu.explain_many(check.queries[0], ids), device_index.explain_many(check.queries[0], ids)
    for a, b in zip(ref, got):
        comparison.scores(f"{a.id}: score", [a.score, a.score_projected], [b.score, b.score_projected])
        comparison.scores(f"{a.id}: modules", [list(a.modules.values())], [list(b.modules.values())])
        for part in ("train_tokens", "query_tokens"):
            ta, tb = getattr(a, part), getattr(b, part)
            if [t.token for t in ta] != [t.token for t in tb]:
                raise Mismatch(f"{a.id}: {part} differ")
            comparison.scores(f"{a.id}: {part}", [t.contribution for t in ta], [t.contribution for t in tb])
    return f"{len(ids)} documents explained; " + comparison.summary()


def stage_serve(check: Check, comparison: Comparison) -> str:
    import uvicorn

    from eogp_index.serve.app import create_app, open_index
    from eogp_index.serve.config import ServeConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServeConfig(port=port)
    app = create_app(open_index(check.cpu.path, device=check.device, batch_size=BATCH), config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        got = []
        for query in check.queries:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/query",
                method="POST",
                data=json.dumps({"text": query, "k": check.top}).encode(),
                headers={"Content-Type": "application/json"},
            )
            for attempt in range(600):  # the server loads the model and the hot copy first
                try:
                    with urllib.request.urlopen(request, timeout=120) as response:
                        got.append(json.load(response)["results"])
                    break
                except urllib.error.URLError:
                    if attempt == 599 or not thread.is_alive():
                        raise
                    time.sleep(0.1)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    for q, (ref, rows) in enumerate(zip(check.answers(check.cpu), got)):
        comparison.ranking(
            f"POST /v1/query, query {q}",
            *_ranked(ref),
            [f"{r.get('direction', '')}:{r['id']}" for r in rows],
            [r["score"] for r in rows],
        )
    return f"{len(got)} queries over HTTP; " + comparison.summary()


def stage_faiss(check: Check, comparison: Comparison) -> str:
    from eogp_index.search.first_pass import FlatConfig, build, clear_cache

    # The flat first pass runs on the CPU (FAISS RaBitQ fast scan); what a GPU machine checks is
    # that the candidates route answers as the exact scan when every row is a candidate.
    build(check.cpu.stored, FAISS_NAME, FlatConfig(), progress=False)
    clear_cache()
    stored = check.cpu.stored
    candidates = stored.count()  # every row a candidate: the rescored answer must be the exact one
    check.compare_answers(
        comparison, "query --candidates", check.answers(check.cpu), check.answers(check.cpu, candidates=candidates)
    )
    return "CPU IndexRaBitQFastScan: candidates rescored: " + comparison.summary()


def stage_distributed_ingest(check: Check, comparison: Comparison) -> str:
    import torch

    cuda = check.device.startswith("cuda")
    if cuda and torch.cuda.device_count() < 2:
        raise Skip(f"NCCL needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    target = check.work / "ingest-x2"
    shutil.copytree(check.work / "fitted", target)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "eogp_index.cli",
        "ingest",
        str(target),
        *map(str, check.shards),
        "--id-field",
        "id",
        "--batch-size",
        str(BATCH),
        "--device",
        "auto" if cuda else "cpu",
        "--json",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:
        raise Mismatch(f"torchrun ingest failed:\n{result.stderr[-3000:]}")
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    if summary.get("workers") != 2:
        raise Mismatch(f"torchrun ingest ran {summary.get('workers')} workers, not 2")
    rows = check.compare_rows(comparison, "stored rows", check.cpu.path, target)
    check.compare_answers(
        comparison, "ranking of the stored rows", check.answers(check.cpu), check.answers(check.open(target, "cpu"))
    )
    backend = "NCCL" if cuda else "Gloo"
    return (
        f"2 workers ({backend}), {rows['rows']} rows, {rows['sign_bits_flipped']:.1e} of the sign bits "
        f"flipped; " + comparison.summary()
    )


STAGES: List[tuple[str, Callable[[Check, Comparison], str]]] = [
    ("fit", stage_fit),
    ("ingest", stage_ingest),
    ("query (torch scan)", stage_torch_scan),
    ("explain", stage_explain),
    ("serve", stage_serve),
    ("faiss", stage_faiss),
    ("ingest x2 (torchrun)", stage_distributed_ingest),
]


def run(device: str, documents: int, k: int, rtol: float, top: int, work: Path, max_tokens: int = 128) -> List[Stage]:
    check = Check(work, device, documents, k, rtol, top, max_tokens)
    report = []
    for name, fn in STAGES:
        stage = Stage(name)
        started = time.perf_counter()
        comparison = Comparison(rtol)
        try:
            stage.detail = fn(check, comparison)
            stage.status = "ok"
        except Skip as exc:
            stage.status, stage.detail = "SKIPPED", str(exc)
        except Mismatch as exc:
            stage.detail = str(exc)
        except Exception as exc:  # a crash is a failed stage; the later ones still run where they can
            stage.detail = f"{type(exc).__name__}: {exc}"
        stage.numbers = {"max_rel": comparison.max_rel, "ties_swapped": comparison.ties_swapped}
        stage.seconds = time.perf_counter() - started
        report.append(stage)
        if name in ("fit", "ingest") and stage.status != "ok" and check.cpu is None:
            break  # the later stages need the fitted, ingested CPU index
    return report


def describe_machine(device: str) -> str:
    import faiss
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return (
        f"device {device} ({gpu}, {torch.cuda.device_count()} visible); torch {torch.__version__}, "
        f"FAISS {faiss.__version__} ({faiss.get_num_gpus() if hasattr(faiss, 'get_num_gpus') else 0} GPUs)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--documents", type=int, default=64, help="training documents to fit and ingest")
    parser.add_argument("-k", type=int, default=32, help="coordinates per module")
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="tokens per document (the shipped model was fine-tuned on 128)"
    )
    parser.add_argument("--top", type=int, default=10, help="hits per direction compared")
    parser.add_argument(
        "--rtol", type=float, default=1e-3, help="score tolerance, relative to the largest score of a query"
    )
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here: run on a GPU machine, or pass --device cpu")
    if args.documents < 4 * BATCH:
        parser.error(f"--documents must be at least {4 * BATCH}")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report = run(args.device, args.documents, args.k, args.rtol, args.top, work, args.max_tokens)
    machine = describe_machine(args.device)
    write_json(args.json, {"machine": machine, "rtol": args.rtol, "stages": [vars(s) for s in report]})
    if not prints_json(args):
        print(f"eogp-index GPU check: {machine}")
        print(
            f"shipped model, {args.documents} documents of at most {args.max_tokens} tokens, k = {args.k}, top {args.top} per direction, "
            f"score tolerance {args.rtol:.0e} of the largest score"
        )
        for s in report:
            print(f"  {s.name:<22} {s.status:<8} {s.seconds:6.1f} s  {s.detail}")
        missing = [name for name, _ in STAGES[len(report) :]]
        if missing:
            print(f"  not run (the CPU reference failed): {', '.join(missing)}")
    return 0 if all(s.status != "FAILED" for s in report) and len(report) == len(STAGES) else 1


if __name__ == "__main__":
    sys.exit(main())
