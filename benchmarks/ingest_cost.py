#!/usr/bin/env python
"""Ingest throughput: EOGP against the bare gradient computation and a LoGra-style FP16 store.

Three ways to turn the same batches of tokenized documents into something stored, timed side
by side in one run (each batch goes through all three, in a rotating order, so that machine
load hits them alike):

* **bare gradient** — what any gradient-based index must pay: the forward and backward pass
  of the batch's summed loss with the per-module hooks of :class:`GradientCapture`, and a
  transform that only takes a tiny reduction of each module's ``(a, g)``. Nothing is stored.
* **EOGP ingest** — project and 1-bit encode each batch (``AttributionIndex.encode_rows``)
  and store the rows in one Lance commit per ``--commit-rows`` rows (``Store.add``), as
  ``run_ingest`` does (default 256 rows per commit, ``eogp_index.config.DEFAULT_COMMIT_ROWS``);
  a commit's time counts in the batch that completes it.
* **LoGra-style store** — the same hooks with a Kronecker random projection
  (:class:`~eogp_index.evaluation.baselines.LoGraProjector`, rank ``r`` per module with
  ``2 r² ≈`` EOGP's bytes per module), FP16 coordinates stored in a separate LanceDB table,
  committed the same way.

Reading and tokenizing shards is left out: it is the same for all three. Each method's
arithmetic on the first (untimed) batch is counted with torch's ``FlopCounterMode``, so the
time ratios can be read against the FLOP ratios printed beside them.
Targets: EOGP time / bare gradient time <= 1.25; EOGP time / LoGra time <= 1.0.

Default workload: ``examples/default/model`` and its training corpus when they exist, else a
randomly initialized GPT-2 of the same shape (``tinylm.default_config``) on random token
documents. ``--gpt2-small`` times a GPT-2-small-shaped model (12 layers, width 768, random
init) instead: its fit alone is long, so ``--index DIR`` keeps the fitted index and later runs
reuse it::

    python benchmarks/ingest_cost.py                 # table
    python benchmarks/ingest_cost.py --gpt2-small --docs 120 --fit-examples 128 --index /tmp/gpt2-small-index
    python benchmarks/ingest_cost.py --json out.json # the table, and the figures as JSON
    python benchmarks/ingest_cost.py --model DIR --corpus 'data/*.jsonl' --device cuda --docs 4096
    python benchmarks/ingest_cost.py --random-model '{"n_embd": 512, "n_inner": 2048, "n_head": 8}'  # wider

``--blocks`` times something else: ``eogp ingest``'s own loop (:func:`ingest.pipeline.run_ingest`,
reading a JSON Lines shard of the same documents) with ``P`` forced out of memory
(``--projection-memory-gb``, tiny by default), per gradient batch (``P`` read in every batch)
against per block (``P`` read once per ``--block-documents``), in rotating order in one run. It
prints seconds per document and ``P`` bytes read per document of each, and checks that both
stored the same codes::

    python benchmarks/ingest_cost.py --blocks --docs 256 --block-documents 128
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence

import numpy as np
import pyarrow as pa
import torch
from common import add_json_argument, prints_json, write_json
from torch.utils.flop_counter import FlopCounterMode

from eogp_index.client import AttributionIndex
from eogp_index.config import DEFAULT_COMMIT_ROWS, CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.data.records import Example
from eogp_index.evaluation.baselines import LoGraProjector, rank_for_bytes
from eogp_index.gradients.capture import GradientCapture
from eogp_index.gradients.loss import collate
from eogp_index.gradients.model import load_model
from eogp_index.store.codecs import Encoded
from eogp_index.store.table import RowInfo, Store, build_rows

REPO = Path(__file__).resolve().parents[1]

#: GPT-2 small's shape (12 layers, width 768, 12 heads) with the shipped 2,048-token vocabulary.
GPT2_SMALL = '{"n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": 3072}'
TARGET_VS_BARE = 1.25
TARGET_VS_LOGRA = 1.0
DEFAULT_ROOT = REPO / "examples" / "default"


@dataclass(frozen=True)
class Workload:
    model: Any
    tokenizer: Any
    examples: List[Example]
    source: str


def load_workload(args) -> Workload:
    """The model, tokenizer and documents to time (see the module docstring for the default)."""
    model_dir = Path(args.model) if args.model else DEFAULT_ROOT / "model"
    corpus = args.corpus or (str(DEFAULT_ROOT / "corpus" / "train.jsonl.gz") if args.model is None else None)
    if args.random_model is None and (model_dir / "config.json").is_file():
        model, tokenizer = load_model(str(model_dir))
        context = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", 512)
        max_tokens = min(args.max_tokens, context)
        if corpus is None:
            raise SystemExit(f"no corpus: pass --corpus with shards to read documents from for {model_dir}")
        from ingest.records import RecordSpec, iter_examples

        examples = []
        for item in iter_examples([corpus], RecordSpec(max_tokens=max_tokens), tokenizer, on_error="skip"):
            if isinstance(item, Example):
                examples.append(item)
            if len(examples) >= args.docs + args.fit_examples:
                break
        return Workload(model, tokenizer, examples, f"{model_dir} on {corpus}")
    if args.model and args.random_model is None:
        raise SystemExit(f"{model_dir}: no config.json (expected a HuggingFace model directory)")
    from transformers import GPT2LMHeadModel

    from eogp_index.evaluation.tinylm import default_config

    torch.manual_seed(0)
    overrides = json.loads(args.random_model) if args.random_model else {}
    config = default_config(**overrides)
    model = GPT2LMHeadModel(config).eval()
    rng = random.Random(0)
    examples = []
    for i in range(args.docs + args.fit_examples):
        n = rng.randint(args.max_tokens // 4, args.max_tokens)
        ids = [rng.randrange(1, config.vocab_size) for _ in range(n)]
        examples.append(Example.from_ids(id=f"doc-{i}", input_ids=ids, labels=ids, shard="random", position=i))
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0, name_or_path="random")
    shape = f"n_embd={config.n_embd}, n_layer={config.n_layer}, n_inner={config.n_inner}, vocab={config.vocab_size}"
    return Workload(model, tokenizer, examples, f"random-init GPT-2 ({shape}) on random tokens")


def _row_info(batch: Sequence[Example]) -> RowInfo:
    return RowInfo(
        ids=[ex.id for ex in batch],
        shards=[ex.shard for ex in batch],
        positions=[ex.position for ex in batch],
        num_tokens=[len(ex.input_ids) for ex in batch],
        num_loss_tokens=[sum(1 for x in list(ex.labels)[1:] if x != -100) for ex in batch],
        truncated=[False] * len(batch),
        metadata=[{} for _ in batch],
    )


class Methods:
    """The three ways of processing a batch, sharing one model and one set of hooks' modules."""

    def __init__(self, index: AttributionIndex, workdir: Path, device: str, commit_rows: int):
        self.index = index
        self.device = device
        self.commit_rows = commit_rows
        self.pending: Dict[str, List[Any]] = {"eogp": [], "logra": []}
        self.pad_id = int(getattr(index.tokenizer, "pad_token_id", None) or 0)
        names = index.manifest.module_names

        def tiny_reduction(name, a, g):
            del name
            return (a[..., :1] * g[..., :1]).sum(dim=(1, 2))  # (B,): touches a and g, costs nothing

        self.bare = GradientCapture(index.model, names, tiny_reduction)
        self.projectors: Dict[str, LoGraProjector] = {}
        self.logra_bytes = 0
        for entry in index.manifest.modules:
            module_bytes = math.ceil(entry.k / 8) + 2  # EOGP's bytes for this module: signs + fp16 scale
            rank = max(1, min(rank_for_bytes(module_bytes, "fp16"), entry.d_in, entry.d_out))
            projector = LoGraProjector(entry.d_in, entry.d_out, rank, seed=len(self.projectors))
            projector.P_a, projector.P_g = projector.P_a.to(device), projector.P_g.to(device)
            self.projectors[entry.name] = projector
            self.logra_bytes += 2 * rank * rank
        self.logra = GradientCapture(index.model, names, lambda name, a, g: self.projectors[name].project(a, g))
        self.logra_store = Store(workdir / "logra", "logra")

    def _batch(self, batch):
        tensors = collate([(ex.input_ids, ex.labels) for ex in batch], self.pad_id)
        return {k: v.to(self.device) for k, v in tensors.items()}

    def bare_gradient(self, batch, flush: bool = False) -> None:
        del flush  # nothing is stored
        outputs, _ = self.bare.run(self._batch(batch))
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _commit(self, name: str, store: Store, rows, *, flush: bool = False) -> None:
        """Queue a batch's rows; one Lance commit once ``commit_rows`` rows are queued."""
        pending = self.pending[name]
        pending.append(rows)
        if flush or sum(t.num_rows for t in pending) >= self.commit_rows:
            store.add(pa.concat_tables(pending))
            pending.clear()

    def eogp(self, batch, flush: bool = False) -> None:
        self._commit("eogp", self.index.store, self.index.encode_rows(batch), flush=flush)

    def logra_store_batch(self, batch, flush: bool = False) -> None:
        outputs, _ = self.logra.run(self._batch(batch))
        coords = torch.cat([outputs[n] for n in self.index.manifest.module_names], dim=1)
        encoded = Encoded(coords=coords.to(torch.float16).cpu().numpy())
        self._commit(
            "logra",
            self.logra_store,
            build_rows(_row_info(batch), encoded, schema=self.logra_store.schema),
            flush=flush,
        )


def first_stage_shapes(index: AttributionIndex) -> List[Dict[str, Any]]:
    """Per module: d_out, d_in', m, k and how many eigenvector columns the kept coordinates touch
    (r of Q_S, c of Q_A): the per-token rotation costs ``d_out·r + d_in'·c`` multiply-adds."""
    out = []
    for name, module in index.projection.modules.items():
        d_out, d_in = module.shape
        out.append(
            {
                "name": name,
                "d_out": d_out,
                "d_in": d_in,
                "m": module.m,
                "k": module.k,
                "r": int(module.gradient_eigenvectors.shape[1]),
                "c": int(module.activation_eigenvectors.shape[1]),
            }
        )
    return out


def arithmetic(shapes, batch, flops, entries, projectors) -> Dict[str, Any]:
    """FLOPs of one batch, by part: what explains the time ratios (see render)."""
    live = sum(len(ex.input_ids) - 1 for ex in batch)  # the last token predicts nothing counted
    rotation = 2 * live * sum(s["d_out"] * s["r"] + s["d_in"] * s["c"] for s in shapes)
    pca = 2 * len(batch) * sum(s["m"] * s["k"] for s in shapes)
    logra = (
        2 * sum(len(ex.input_ids) for ex in batch) * sum((e.d_in + e.d_out) * projectors[e.name].rank for e in entries)
    )
    return {
        "live_tokens": live,
        "bare_gflops": flops["bare_gradient"] / 1e9,
        "rotation_gflops": rotation / 1e9,
        "pca_gflops": pca / 1e9,
        "eogp_other_gflops": (flops["eogp"] - flops["bare_gradient"] - rotation - pca) / 1e9,
        "logra_projection_gflops": logra / 1e9,
    }


def prepare(args):
    """The device, the workload, and its documents split into fitting and timed ones."""
    device = GradientConfig(device=args.device).resolved_device()
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = load_workload(args)
    examples = workload.examples
    if len(examples) < args.fit_examples + 2 * args.batch_size:
        raise SystemExit(f"only {len(examples)} documents; need at least {args.fit_examples + 2 * args.batch_size}")
    return device, workload, examples[: args.fit_examples], examples[args.fit_examples :]


def run(args) -> Dict[str, Any]:
    started = time.perf_counter()
    device, workload, fit, timed = prepare(args)
    with tempfile.TemporaryDirectory(prefix="eogp-bench-") as tmp:
        workdir = Path(tmp)
        fit_started = time.perf_counter()
        gradients = GradientConfig(batch_size=args.batch_size, device=device)
        kept = Path(args.index) if args.index else None
        reused = kept is not None and (kept / "manifest.json").exists()
        if not reused:
            index = AttributionIndex.create(
                kept or workdir / "index",
                workload.model,
                workload.tokenizer,
                fit,
                model_name=workload.source,
                projection=ProjectionConfig(k=args.k, m=args.m, num_fit_examples=len(fit)),
                curvature=CurvatureConfig(
                    num_examples=min(args.curvature_examples, len(fit)), batch_size=args.batch_size
                ),
                gradients=gradients,
                progress=False,
            )
        fit_seconds = time.perf_counter() - fit_started
        if kept is not None:
            # Ingest into a copy, so that the kept index stays empty for the next run; the
            # projection file, which ingest only reads, is hard-linked rather than copied.
            def link_or_copy(src: str, dst: str) -> None:
                if src.endswith(".safetensors"):
                    os.link(src, dst)
                else:
                    shutil.copy2(src, dst)

            shutil.copytree(kept, workdir / "index", copy_function=link_or_copy)
            if not reused:  # the fit swapped GPT-2's Conv1D layers in place: open a fresh model
                workload = load_workload(args)
            index = AttributionIndex.open(
                workdir / "index", model=workload.model, tokenizer=workload.tokenizer, gradients=gradients
            )
        shapes = first_stage_shapes(index)
        methods = Methods(index, workdir, device, args.commit_rows)
        batches = [timed[i : i + args.batch_size] for i in range(0, len(timed), args.batch_size)]
        batches = [b for b in batches if len(b) == args.batch_size]
        warmup, batches = batches[0], batches[1:]
        order = [
            ("bare_gradient", methods.bare_gradient),
            ("eogp", methods.eogp),
            ("logra_fp16", methods.logra_store_batch),
        ]
        flops = {}
        for name, fn in order:  # first calls pay for allocations and table creation: not timed
            with FlopCounterMode(display=False) as counter:  # but their arithmetic is counted
                fn(warmup, flush=True)
            flops[name] = int(counter.get_total_flops())
        seconds = {name: 0.0 for name, _ in order}
        per_batch: Dict[str, List[float]] = {name: [] for name, _ in order}
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1  # the last batch commits what is still queued
            for name, fn in order[i % 3 :] + order[: i % 3]:
                t0 = time.perf_counter()
                fn(batch, flush=last)
                elapsed = time.perf_counter() - t0
                seconds[name] += elapsed
                per_batch[name].append(elapsed)
        docs = sum(len(b) for b in batches)
        tokens = sum(len(ex.input_ids) for b in batches for ex in b)
        bytes_per_example = {
            "bare_gradient": 0,
            "eogp": index.manifest.bytes_per_example,
            "logra_fp16": methods.logra_bytes,
        }
        assert index.store.count() == docs + len(warmup) == methods.logra_store.count()
    result: Dict[str, Any] = {
        "workload": workload.source,
        "device": device,
        "threads": torch.get_num_threads(),
        "documents": docs,
        "tokens": tokens,
        "batch_size": args.batch_size,
        "batches": len(batches),
        "rows_per_commit": args.commit_rows,
        "k_per_module": args.k,
        "modules": len(index.manifest.modules),
        "fit_seconds": round(fit_seconds, 2),
        "fit_reused": reused,
        "first_stage": shapes,
        # The arithmetic EOGP adds to the bare gradient in the warm-up batch (multiply-adds x 2):
        # rotating each live token's a and g into the kept eigenvector columns, and P.
        "arithmetic": arithmetic(shapes, warmup, flops, index.manifest.modules, methods.projectors),
        "methods": {
            name: {
                "seconds": round(seconds[name], 4),
                "docs_per_s": round(docs / seconds[name], 2),
                "tokens_per_s": round(tokens / seconds[name], 1),
                "bytes_per_example": bytes_per_example[name],
                "gflops_per_batch": round(flops[name] / 1e9, 3),
            }
            for name, _ in order
        },
        "ratios": {
            "eogp_over_bare_gradient": round(seconds["eogp"] / seconds["bare_gradient"], 3),
            "eogp_over_logra": round(seconds["eogp"] / seconds["logra_fp16"], 3),
            # The same ratios in arithmetic (one batch): what a perfectly efficient kernel would give.
            "flops_eogp_over_bare_gradient": round(flops["eogp"] / flops["bare_gradient"], 3),
            "flops_eogp_over_logra": round(flops["eogp"] / flops["logra_fp16"], 3),
            # Medians of per-batch ratios: less sensitive to a load spike on a shared machine.
            "median_batch_eogp_over_bare_gradient": round(
                float(np.median(np.array(per_batch["eogp"]) / np.array(per_batch["bare_gradient"]))), 3
            ),
            "median_batch_eogp_over_logra": round(
                float(np.median(np.array(per_batch["eogp"]) / np.array(per_batch["logra_fp16"]))), 3
            ),
        },
        "targets": {"eogp_over_bare_gradient": TARGET_VS_BARE, "eogp_over_logra": TARGET_VS_LOGRA},
    }
    result["meets_targets"] = {key: result["ratios"][key] <= target for key, target in result["targets"].items()}
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    return result


def render(result: Dict[str, Any]) -> str:
    labels = {
        "bare_gradient": "bare gradient (fwd+bwd)",
        "eogp": "EOGP ingest (1-bit)",
        "logra_fp16": "LoGra-style store (fp16)",
    }
    lines = [
        f"workload: {result['workload']}",
        f"device: {result['device']} ({result['threads']} threads); {result['documents']} documents, "
        f"{result['tokens']} tokens in {result['batches']} batches of {result['batch_size']}, "
        f"one commit per {result['rows_per_commit']} rows; "
        f"k={result['k_per_module']} x {result['modules']} modules",
        "",
        f"{'method':<27}{'docs/s':>10}{'tokens/s':>12}{'seconds':>10}{'bytes/example':>15}{'GFLOP/batch':>13}",
    ]
    for name, row in result["methods"].items():
        lines.append(
            f"{labels[name]:<27}{row['docs_per_s']:>10.1f}{row['tokens_per_s']:>12.0f}"
            f"{row['seconds']:>10.2f}{row['bytes_per_example']:>15}{row['gflops_per_batch']:>13.3f}"
        )
    ratios, targets, ok = result["ratios"], result["targets"], result["meets_targets"]
    fitting = "reused from --index" if result["fit_reused"] else f"{result['fit_seconds']}s"
    lines += [
        "",
        f"EOGP / bare gradient: {ratios['eogp_over_bare_gradient']:.3f} (per-batch median "
        f"{ratios['median_batch_eogp_over_bare_gradient']:.3f}; target <= {targets['eogp_over_bare_gradient']}) "
        f"{'ok' if ok['eogp_over_bare_gradient'] else 'MISSED'}",
        f"EOGP / LoGra store:   {ratios['eogp_over_logra']:.3f} (per-batch median "
        f"{ratios['median_batch_eogp_over_logra']:.3f}; target <= {targets['eogp_over_logra']}) "
        f"{'ok' if ok['eogp_over_logra'] else 'MISSED'}",
        f"in arithmetic (FLOPs of one batch): EOGP / bare gradient {ratios['flops_eogp_over_bare_gradient']:.3f}, "
        f"EOGP / LoGra {ratios['flops_eogp_over_logra']:.3f}",
        f"(index fitting {fitting}, total {result['total_seconds']}s)",
    ]
    a = result["arithmetic"]
    bare = a["bare_gflops"]
    lines += [
        "",
        f"arithmetic of one batch ({a['live_tokens']} live tokens), GFLOP: bare gradient {bare:.3f}; EOGP adds the "
        f"eigenbasis rotation 2·T·Σ(d_out·r + d_in'·c) = {a['rotation_gflops']:.3f} ({a['rotation_gflops'] / bare:.1%} "
        f"of bare), P 2·B·Σ m·k = {a['pca_gflops']:.3f} ({a['pca_gflops'] / bare:.1%}) and "
        f"{a['eogp_other_gflops']:.3f} of block products and gathers; LoGra adds 2·T·Σ(d_in+d_out)·r = "
        f"{a['logra_projection_gflops']:.3f} ({a['logra_projection_gflops'] / bare:.1%})",
        f"so EOGP / LoGra in arithmetic = (bare + EOGP's extra) / (bare + LoGra's extra) = "
        f"{result['methods']['eogp']['gflops_per_batch']:.3f} / {result['methods']['logra_fp16']['gflops_per_batch']:.3f}"
        f" = {result['ratios']['flops_eogp_over_logra']:.3f}",
        "",
        f"{'module':<34}{'d_out':>6}{'d_in':>6}{'m':>8}{'k':>5}{'r/d_out':>9}{'c/d_in':>8}",
    ]
    for s in result["first_stage"]:
        lines.append(
            f"{s['name'][:34]:<34}{s['d_out']:>6}{s['d_in']:>6}{s['m']:>8}{s['k']:>5}"
            f"{s['r'] / s['d_out']:>9.2f}{s['c'] / s['d_in']:>8.2f}"
        )
    return "\n".join(lines)


def _write_shard(path: Path, examples: Sequence[Example]) -> Path:
    """The documents as a JSON Lines shard of token ids, as ``eogp ingest`` reads them."""
    with open(path, "w") as handle:
        for ex in examples:
            handle.write(json.dumps({"id": ex.id, "input_ids": list(ex.input_ids), "labels": list(ex.labels)}) + "\n")
    return path


def run_blocks(args) -> Dict[str, Any]:
    """Per-batch against block ingest, ``P`` out of memory: seconds and ``P`` bytes read per document."""
    from ingest.pipeline import run_ingest
    from ingest.records import RecordSpec

    started = time.perf_counter()
    device, workload, fit, timed = prepare(args)
    block = args.block_documents or len(timed)
    modes = {"per_batch": args.batch_size, "block": block}
    seconds = {mode: 0.0 for mode in modes}
    p_read = {mode: 0 for mode in modes}
    codes = {}
    with tempfile.TemporaryDirectory(prefix="eogp-bench-") as tmp:
        workdir = Path(tmp)
        AttributionIndex.create(
            workdir / "fitted",
            workload.model,
            workload.tokenizer,
            fit,
            model_name=workload.source,
            projection=ProjectionConfig(k=args.k, m=args.m, num_fit_examples=len(fit)),
            curvature=CurvatureConfig(num_examples=min(args.curvature_examples, len(fit)), batch_size=args.batch_size),
            gradients=GradientConfig(batch_size=args.batch_size, device=device),
            progress=False,
        )
        shard = _write_shard(workdir / "docs.jsonl", timed)
        order = list(modes)
        for round_ in range(args.rounds):
            for mode in order[round_ % 2 :] + order[: round_ % 2]:
                path = Path(shutil.copytree(workdir / "fitted", workdir / f"{mode}-{round_}"))
                gradients = GradientConfig(
                    batch_size=args.batch_size, device=device, projection_memory_gb=args.projection_memory_gb
                )
                # The fit and every open swap GPT-2's Conv1D layers in place: a fresh model each time.
                workload = load_workload(args)
                index = AttributionIndex.open(
                    path, model=workload.model, tokenizer=workload.tokenizer, gradients=gradients
                )
                p_total = index.projection.pca_bytes
                t0 = time.perf_counter()
                summary = run_ingest(
                    index,
                    [str(shard)],
                    spec=RecordSpec(id_field="id"),
                    progress=False,
                    optimize_threshold=None,
                    block_documents=modes[mode],
                )
                seconds[mode] += time.perf_counter() - t0
                p_read[mode] += index.projection.pca_bytes_read
                assert summary.stored == len(timed), summary
                table = index.store.read(["id", *index.codec.columns]).sort_by("id")
                codes.setdefault(mode, table)
                shutil.rmtree(path)
    docs = len(timed) * args.rounds
    result = {
        "workload": workload.source,
        "device": device,
        "threads": torch.get_num_threads(),
        "documents": len(timed),
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "block_documents": block,
        "projection_memory_gb": args.projection_memory_gb,
        "p_total_bytes": p_total,
        "modes": {
            mode: {"seconds_per_document": seconds[mode] / docs, "p_bytes_read_per_document": p_read[mode] / docs}
            for mode in modes
        },
        "same_codes": codes["per_batch"].equals(codes["block"]),
    }
    result["block_speedup"] = seconds["per_batch"] / seconds["block"]
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    return result


def render_blocks(result: Dict[str, Any]) -> str:
    lines = [
        f"workload: {result['workload']}",
        f"device: {result['device']} ({result['threads']} threads); {result['documents']} documents x "
        f"{result['rounds']} rounds; P {result['p_total_bytes'] / 1e6:.1f} MB, out of memory "
        f"(--projection-memory-gb {result['projection_memory_gb']:g}); gradient batch {result['batch_size']}, "
        f"block {result['block_documents']}",
        "",
        f"{'ingest':<12}{'s/document':>14}{'P read/document':>18}",
    ]
    for mode, row in result["modes"].items():
        lines.append(
            f"{mode:<12}{row['seconds_per_document']:>14.4f}{row['p_bytes_read_per_document'] / 1e6:>15.2f} MB"
        )
    lines += [
        "",
        f"block ingest / per-batch ingest, time: {1 / result['block_speedup']:.3f} "
        f"({result['block_speedup']:.2f}x faster); same stored codes: {result['same_codes']} "
        f"(total {result['total_seconds']}s)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HuggingFace model directory (default: examples/default/model)")
    parser.add_argument("--corpus", default=None, help="shard path or glob to read documents from")
    parser.add_argument(
        "--random-model",
        default=None,
        metavar="JSON",
        help="time a random-init GPT-2 on random tokens instead: tinylm.default_config overrides, "
        'e.g. \'{"n_embd": 512, "n_inner": 2048, "n_head": 8}\' (\'{}\' = the default shape)',
    )
    parser.add_argument(
        "--gpt2-small",
        action="store_true",
        help=f"time a random-init GPT-2-small-shaped model: --random-model '{GPT2_SMALL}'",
    )
    parser.add_argument("--docs", type=int, default=200, help="documents timed (default 200)")
    parser.add_argument(
        "--fit-examples", type=int, default=160, help="documents the PCA is fitted on (default 160; at least --k)"
    )
    parser.add_argument(
        "--curvature-examples",
        type=int,
        default=32,
        help="documents (of the fitting ones) the EK-FAC factors are fitted on (default 32)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="documents per batch (default 8)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per document at most (default 128)")
    parser.add_argument(
        "--k", type=int, default=128, help="EOGP coordinates per module (default 128: 18 bytes, = LoGra rank 3 in fp16)"
    )
    parser.add_argument(
        "--m",
        type=int,
        default=None,
        help="EOGP first-stage width per module (default: eogp fit's default, see ProjectionConfig)",
    )
    parser.add_argument(
        "--commit-rows",
        type=int,
        default=DEFAULT_COMMIT_ROWS,
        help=f"rows per Lance commit, as eogp ingest --batch-size (default {DEFAULT_COMMIT_ROWS})",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--index",
        default=None,
        metavar="DIR",
        help="keep the fitted index in DIR and reuse it when DIR holds one (the same model and "
        "options; fitting GPT-2 small takes longer than timing it); each run ingests into a copy",
    )
    parser.add_argument(
        "--blocks",
        action="store_true",
        help="time eogp ingest per gradient batch against per block, P out of memory (see above)",
    )
    parser.add_argument(
        "--block-documents",
        type=int,
        default=None,
        help="with --blocks: documents per block (default: all of --docs in one block)",
    )
    parser.add_argument(
        "--projection-memory-gb",
        type=float,
        default=1e-9,
        help="with --blocks: the memory P may hold (default 1e-9: none, P is read when applied)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="with --blocks: ingests of each kind (default 2)")
    add_json_argument(parser)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    if args.gpt2_small:
        args.random_model = GPT2_SMALL
    if args.blocks:
        result = run_blocks(args)
        if not prints_json(args):
            print(render_blocks(result))
        write_json(args.json, result)
        return 0 if result["same_codes"] else 1
    result = run(args)
    if not prints_json(args):
        print(render(result))
    write_json(args.json, result)
    return 1 if args.check and not all(result["meets_targets"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
