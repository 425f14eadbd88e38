"""Tests of ingest.pipeline and ingest.distributed against a real index of a tiny GPT-2.

The index is fitted once per module (a tiny GPT-2 built from a config, saved to disk so that
worker processes can load it from the manifest, and the tiny BPE tokenizer of conftest.py);
each test ingests real JSON Lines / Parquet shards into its own copy of it. The resume test
SIGKILLs a real ingest process in the middle of a shard; the distributed test runs
``torchrun`` with two CPU workers and compares the table with a one-process ingest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.errors import ConfigError, IncompatibleIndexError, InputError
from ingest.pipeline import IngestSummary, run_ingest
from ingest.records import Example, RecordSpec, iter_examples

REPO = Path(__file__).resolve().parents[2]
GRADIENT_BATCH = 4

WORDS = (
    "the quick brown fox jumps over the lazy dog hello world how are you today tell me a joke about cats and dogs"
).split()


def make_model(tokenizer, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    # vocab_size = len(tokenizer): every id the tokenizer produces has an embedding row.
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_inner=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return GPT2LMHeadModel(config).eval()


def doc(i: int, tag: str = "doc") -> str:
    words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + i % 5)]
    return f"{tag} {i}: " + " ".join(words)


def write_lines(path: Path, lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tokenizer):
    """A fitted, empty index whose manifest names a model directory on disk."""
    root = tmp_path_factory.mktemp("fitted")
    model_dir = root / "model"
    model = make_model(tokenizer)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    fit_shard = write_lines(root / "fit.jsonl", [{"text": doc(i, "fit")} for i in range(24)])
    examples = [e for e in iter_examples([fit_shard], RecordSpec(), tokenizer) if isinstance(e, Example)]
    AttributionIndex.create(
        root / "index",
        model,
        tokenizer,
        examples,
        model_name=str(model_dir),
        projection=ProjectionConfig(k=16),
        curvature=CurvatureConfig(num_examples=16, batch_size=4),
        gradients=GradientConfig(batch_size=GRADIENT_BATCH),
        progress=False,
    )
    return SimpleNamespace(index=root / "index", model_dir=model_dir)


@pytest.fixture
def index_dir(fitted, tmp_path) -> Path:
    """A fresh copy of the fitted index (no table yet)."""
    return Path(shutil.copytree(fitted.index, tmp_path / "index"))


def open_index(path: Path) -> AttributionIndex:
    # The model is reloaded from the directory the manifest names, as `eogp ingest` does.
    return AttributionIndex.open(path, gradients=GradientConfig(batch_size=GRADIENT_BATCH))


def stored_ids(path: Path) -> list[str]:
    return open_index_store(path).read(["id"]).column("id").to_pylist()


def open_index_store(path: Path):
    from eogp_index.store.table import Store

    return Store(path, "examples")


def expected_ids(paths, spec: RecordSpec, tokenizer) -> list[str]:
    return [e.id for e in iter_examples(paths, spec, tokenizer, on_error="skip") if isinstance(e, Example)]


def corpus(tmp_path: Path, n_jsonl: int = 10, n_parquet: int = 10) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_lines(tmp_path / "web.jsonl", [{"text": doc(i), "source": "web", "n": i} for i in range(n_jsonl)])
    parquet = tmp_path / "books.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"text": doc(i, "book"), "source": "books", "n": 100 + i} for i in range(n_parquet)]),
        parquet,
    )
    return [jsonl, parquet]


# -- idempotence ----------------------------------------------------------------------------------
def test_ingest_twice_stores_each_example_once(index_dir, tmp_path, tokenizer):
    shards = corpus(tmp_path)
    spec = RecordSpec(metadata_fields=("source", "n"))
    index = open_index(index_dir)
    first = run_ingest(index, [str(p) for p in shards], spec=spec, batch_size=4, progress=False)
    assert isinstance(first, IngestSummary)
    assert (first.stored, first.skipped_existing, first.rejected, first.duplicates, first.documents) == (
        20,
        0,
        0,
        0,
        20,
    )
    assert first.tokens > 0 and first.tokens_per_s > 0 and first.table_version >= 1
    assert first.rejects_path is None

    second = run_ingest(
        open_index(index_dir), [str(tmp_path / "*.jsonl"), str(shards[1])], spec=spec, batch_size=4, progress=False
    )
    assert (second.stored, second.skipped_existing, second.documents, second.tokens) == (0, 20, 20, 0)
    assert second.table_version == first.table_version  # nothing was committed
    json.dumps(second.to_json())

    ids = stored_ids(index_dir)
    assert len(ids) == 20 and sorted(ids) == sorted(expected_ids(shards, spec, tokenizer))
    schema = open_index_store(index_dir).schema
    assert str(schema.field("source").type) == "string" and str(schema.field("n").type) == "int64"
    table = open_index_store(index_dir).read(["shard", "position", "n"], where="source = 'books'")
    assert table.num_rows == 10 and set(table.column("shard").to_pylist()) == {"books.parquet"}


def test_new_metadata_field_joins_an_existing_table_and_old_rows_hold_null(index_dir, tmp_path):
    shards = corpus(tmp_path, n_jsonl=4, n_parquet=0)[:1]
    run_ingest(open_index(index_dir), shards, spec=RecordSpec(metadata_fields=("source",)), progress=False)
    index = open_index(index_dir)
    index.stored.hot_codes()  # a hot copy made before the column exists must not hide it afterwards
    late = write_lines(tmp_path / "late.jsonl", [{"text": doc(i, "late"), "source": "web", "n": i} for i in range(3)])
    summary = run_ingest(
        index, [late], spec=RecordSpec(metadata_fields=("source", "n")), batch_size=2, progress=False
    )  # the batch after the one that adds the column finds it there
    assert summary.stored == 3
    store = open_index_store(index_dir)
    assert str(store.schema.field("n").type) == "int64"
    assert store.count("n IS NULL") == 4 and store.count("n >= 0") == 3
    reopened = open_index(index_dir)
    for route in ("hot", "stream"):
        hits = reopened.search(doc(1)).limit(10).direction("positive").where("n IS NULL").route(route).to_arrow()
        assert hits.num_rows > 0 and hits.column("n").null_count == hits.num_rows, route


@pytest.mark.parametrize("name", ["shard", "score"])
def test_metadata_field_named_like_a_table_or_answer_column_is_refused_before_reading(index_dir, tmp_path, name):
    shard = write_lines(tmp_path / "a.jsonl", [{"text": doc(0), name: 1}])
    with pytest.raises(ConfigError, match=rf"metadata fields \['{name}'\] clash with the"):
        run_ingest(open_index(index_dir), [shard], spec=RecordSpec(metadata_fields=(name,)), progress=False)
    assert stored_ids(index_dir) == []


def test_corpus_with_nulls_lists_a_surrogate_and_a_late_field_stores_every_valid_record(index_dir, tmp_path):
    spec = RecordSpec(id_field="id", metadata_fields=("lang", "stars", "quality", "ok", "tags", "sizes", "late"))
    lines = [
        {
            "id": "a",
            "text": doc(0),
            "lang": "en",
            "stars": 3,
            "quality": 0.5,
            "ok": True,
            "tags": ["x", "y"],
            "sizes": [1],
        },
        {"id": "b", "text": doc(1), "lang": None, "stars": None, "quality": None, "ok": None, "tags": None},
        {"id": "c", "text": doc(2) + " \ud800 broken"},  # 3 lone surrogate: rejected
        {"id": "d", "text": doc(3), "tags": [], "sizes": [2, None, 4], "quality": 2},
        {
            "id": "e",
            "messages": [{"role": "user", "content": "hi \udfff"}, {"role": "assistant", "content": "ok"}],
        },  # 5 surrogate in a chat
        {"id": "f", "text": doc(5), "tags": ["z", 1]},  # 6 mixed list items
        {"id": "g", "text": doc(6), "stars": 1.5},  # 7 float in an int field
        {"id": "h", "text": doc(7), "lang": "fr", "tags": ["\u0000nul", "\uffff"]},  # NUL, non-character: kept
    ]
    early = tmp_path / "early.jsonl"
    early.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    late = write_lines(
        tmp_path / "late.jsonl",
        [{"id": "i", "text": doc(8), "late": ["new"]}, {"id": "j", "text": doc(9), "late": [{"no": 1}]}],
    )  # 2 a dict item
    rejects = tmp_path / "rejects.jsonl"
    summary = run_ingest(
        open_index(index_dir),
        [early, late],
        spec=spec,
        on_error="skip",
        rejects_path=rejects,
        batch_size=4,
        progress=False,
    )
    entries = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [e["location"] for e in entries] == [
        "early.jsonl:3",
        "early.jsonl:5",
        "early.jsonl:6",
        "early.jsonl:7",
        "late.jsonl:2",
    ]
    assert "field 'text': character" in entries[0]["reason"] and "surrogate" in entries[0]["reason"]
    assert "field 'messages[0].content'" in entries[1]["reason"]
    assert "field 'tags'" in entries[2]["reason"] and "field 'stars'" in entries[3]["reason"]
    assert "field 'late'" in entries[4]["reason"]
    assert (summary.stored, summary.rejected) == (5, 5)
    store = open_index_store(index_dir)
    rows = {r["id"]: r for r in store.read(["id", *spec.metadata_fields]).to_pylist()}
    assert sorted(rows) == ["a", "b", "d", "h", "i"]
    assert rows["a"] == {
        "id": "a",
        "lang": "en",
        "stars": 3,
        "quality": 0.5,
        "ok": True,
        "tags": ["x", "y"],
        "sizes": [1],
        "late": None,
    }
    assert rows["b"]["lang"] is None and rows["b"]["tags"] is None and rows["d"]["quality"] == 2.0
    assert rows["d"]["tags"] == [] and rows["d"]["sizes"] == [2, None, 4]
    assert rows["h"]["tags"] == ["\x00nul", "\uffff"] and rows["i"]["late"] == ["new"]
    assert str(store.schema.field("tags").type) == "list<item: string>"
    assert sorted(store.read(["id"], "array_has(tags, 'x')").column("id").to_pylist()) == ["a"]
    assert sorted(store.read(["id"], "lang IS NULL").column("id").to_pylist()) == ["b", "d", "i"]
    from eogp_index.store.filters import HotFilter

    index = open_index(index_dir)
    hot = index.stored.hot_codes()
    on_hot_copy = HotFilter(hot.filterable)  # DataFusion itself, without the fallback to Lance
    for where, ids in (
        ("array_has(tags, 'x')", ["a"]),
        ("lang IS NULL", ["b", "d", "i"]),
        ("array_length(sizes) = 3", ["d"]),
        ("late IS NOT NULL", ["i"]),
    ):
        assert sorted(hot.take(on_hot_copy.positions(where), ["id"]).column("id").to_pylist()) == ids, where
        for route in ("hot", "stream"):  # the hot copy and Lance alike
            hits = index.search(doc(0)).limit(10).direction("both").where(where).route(route).to_arrow()
            assert sorted(set(hits.column("id").to_pylist())) == ids, (where, route)


# -- kill -9 and resume ---------------------------------------------------------------------------
KILLED_INGEST = textwrap.dedent("""
    import sys, time
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig
    from ingest.pipeline import run_ingest
    from ingest.records import RecordSpec

    index = AttributionIndex.open(sys.argv[1], gradients=GradientConfig(batch_size=2))
    commit = index.store.add

    def slow_commit(rows):
        # Widen the time between commits so that the test's SIGKILL lands mid-shard.
        time.sleep(0.25)
        return commit(rows)

    index.store.add = slow_commit
    run_ingest(index, [sys.argv[2]], spec=RecordSpec(), batch_size=2, progress=False)
""")


def kill_mid_shard(script_text: str, index_dir: Path, shard: Path, tmp_path: Path, ready, *args: str) -> int:
    """Run ``script_text`` (``python script INDEX SHARD *args``) in a real process, SIGKILL it once
    ``ready(committed rows)`` holds, and return the rows the table holds after the kill."""
    import lance

    script = tmp_path / "ingest_script.py"
    script.write_text(script_text)
    log = open(tmp_path / "child.log", "wb")
    child = subprocess.Popen(
        [sys.executable, str(script), str(index_dir), str(shard), *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )
    uri = str(index_dir / "examples.lance")
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and child.poll() is None:
            try:
                committed = lance.dataset(uri).count_rows()
            except Exception:  # no table yet
                committed = 0
            if ready(committed):
                break
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
        log.close()
    assert child.returncode == -signal.SIGKILL, (tmp_path / "child.log").read_text()[-2000:]
    return lance.dataset(uri).count_rows()


def test_killed_ingest_resumes_without_duplicates_or_gaps(index_dir, tmp_path, tokenizer):
    total = 40
    shard = write_lines(tmp_path / "big.jsonl", [{"text": doc(i)} for i in range(total)])
    after_kill = kill_mid_shard(KILLED_INGEST, index_dir, shard, tmp_path, lambda committed: committed >= 2)
    assert 2 <= after_kill < total, f"kill landed outside the shard (rows: {after_kill})"
    assert after_kill % 2 == 0  # whole batches only: a reader never sees half a batch

    summary = run_ingest(open_index(index_dir), [str(shard)], spec=RecordSpec(), batch_size=2, progress=False)
    assert summary.skipped_existing == after_kill and summary.stored == total - after_kill
    ids = stored_ids(index_dir)
    assert len(ids) == total and len(set(ids)) == total
    assert set(ids) == set(expected_ids([shard], RecordSpec(), tokenizer))


# -- one writer at a time: the library ingest beside eogp ingest -----------------------------------
HELD_INGEST = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig
    from ingest.pipeline import run_ingest
    from ingest.records import RecordSpec

    index = AttributionIndex.open(sys.argv[1], gradients=GradientConfig(batch_size=2))
    commit, release = index.store.add, Path(sys.argv[3])

    def held_commit(rows):
        # After its first commit the run waits (holding the index) until the test lets it go on,
        # so that the library's ingest surely runs while this one is writing.
        done = commit(rows)
        while not release.exists():
            time.sleep(0.02)
        return done

    index.store.add = held_commit
    run_ingest(index, [sys.argv[2]], spec=RecordSpec(), batch_size=2, progress=False)
""")


def test_library_ingest_beside_a_running_ingest_stores_every_id_once(index_dir, tmp_path, tokenizer):
    import lance

    total = 20
    shard = write_lines(tmp_path / "shared.jsonl", [{"text": doc(i)} for i in range(total)])
    examples = [e for e in iter_examples([shard], RecordSpec(), tokenizer) if isinstance(e, Example)]
    library = open_index(index_dir)
    script, release = tmp_path / "held_ingest.py", tmp_path / "release"
    script.write_text(HELD_INGEST)
    log = open(tmp_path / "held.log", "wb")
    child = subprocess.Popen(
        [sys.executable, str(script), str(index_dir), str(shard), str(release)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    refused = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and child.poll() is None:  # until its first commit is in
            try:
                if lance.dataset(str(index_dir / "examples.lance")).count_rows() >= 2:
                    break
            except Exception:  # no table yet
                pass
            time.sleep(0.02)
        assert child.poll() is None, (tmp_path / "held.log").read_text()[-2000:]
        try:
            library.ingest(examples, progress=False)  # the same records, while the other run writes
        except ConfigError as exc:
            refused = str(exc)
    finally:
        release.touch()
        child.wait(timeout=180)
        log.close()
    assert child.returncode == 0, (tmp_path / "held.log").read_text()[-2000:]
    ids = stored_ids(index_dir)
    assert sorted(ids) == sorted(e.id for e in examples)  # every id once
    assert refused is not None and "another ingest" in refused and str(child.pid) in refused
    assert library.ingest(examples, progress=False) == 0  # once the other run is done: all stored already


# -- block ingest: P read once per block ------------------------------------------------------------
NO_P_IN_MEMORY = 1e-9  # GiB: no module's P stays in memory, so every P is read when it is applied


def _codes_by_id(path: Path) -> dict:
    table = open_index_store(path).read(["id", "signs", "scales"])
    return {row["id"]: (row["signs"], row["scales"]) for row in table.to_pylist()}


def test_block_ingest_stores_the_codes_of_per_batch_ingest_and_reads_each_p_once_per_block(fitted, tmp_path, tokenizer):
    from eogp_index.store.block_cache import CACHE_DIR

    total = 22  # blocks of 8, 8 and 6 documents; the last gradient batch of the last block has 2
    shard = write_lines(tmp_path / "docs.jsonl", [{"text": doc(i)} for i in range(total)])
    resident = Path(shutil.copytree(fitted.index, tmp_path / "resident"))
    blocked = Path(shutil.copytree(fitted.index, tmp_path / "blocked"))
    run_ingest(open_index(resident), [str(shard)], batch_size=GRADIENT_BATCH, progress=False)
    index = AttributionIndex.open(
        blocked, gradients=GradientConfig(batch_size=GRADIENT_BATCH, projection_memory_gb=NO_P_IN_MEMORY)
    )
    assert index.projection.in_turn
    p_total = index.projection.pca_bytes
    summary = run_ingest(index, [str(shard)], progress=False, block_documents=8)
    assert summary.stored == total
    # Each module's P read once per block (3 blocks), not once per gradient batch (6 batches).
    assert index.projection.pca_bytes_read == 3 * p_total
    assert not (blocked / CACHE_DIR).exists()  # removed once the blocks are committed
    codes, expected = _codes_by_id(blocked), _codes_by_id(resident)
    assert sorted(codes) == sorted(expected) and len(codes) == total
    assert all(codes[i] == expected[i] for i in expected)  # every sign byte and FP16 scale

    # Batched queries: each P read once for the whole batch of queries (3 gradient batches),
    # with the coordinates P held in memory gives.
    examples = [e for e in iter_examples([shard], RecordSpec(), tokenizer) if isinstance(e, Example)][:10]
    before = index.projection.pca_bytes_read
    batched = index.project(examples)
    assert index.projection.pca_bytes_read - before == p_total
    kept = open_index(resident)
    assert not kept.projection.in_turn
    assert (batched == kept.project(examples)).all()


def test_client_block_ingest_stores_the_codes_of_per_batch_ingest(fitted, tmp_path, tokenizer):
    from eogp_index.config import IngestConfig
    from eogp_index.store.block_cache import CACHE_DIR

    shard = write_lines(tmp_path / "docs.jsonl", [{"text": doc(i)} for i in range(14)])
    examples = [e for e in iter_examples([shard], RecordSpec(), tokenizer) if isinstance(e, Example)]
    resident = open_index(Path(shutil.copytree(fitted.index, tmp_path / "resident")))
    assert resident.ingest(examples, progress=False) == 14 and resident.block_cache() is None
    blocked = AttributionIndex.open(
        Path(shutil.copytree(fitted.index, tmp_path / "blocked")),
        gradients=GradientConfig(batch_size=GRADIENT_BATCH, projection_memory_gb=NO_P_IN_MEMORY),
    )
    p_total = blocked.projection.pca_bytes
    # Blocks of 8 and 6 documents: each module's P read twice, not once per gradient batch (4 batches).
    assert blocked.ingest(examples, IngestConfig(block_documents=8, progress=False)) == 14
    assert blocked.projection.pca_bytes_read == 2 * p_total
    assert not (blocked.path / CACHE_DIR).exists()
    codes, expected = _codes_by_id(blocked.path), _codes_by_id(resident.path)
    assert len(codes) == 14 and codes == expected  # every sign byte and FP16 scale
    with pytest.raises(ConfigError, match="shard_root does not apply here"):
        blocked.ingest(examples, shard_root=tmp_path)


#: The killed block ingest's gradient batch and block: every run it is compared with uses them too
#: (a row's coordinates can depend on the rows sharing its gradient batch: its padding, the BLAS's
#: blocking), so that the codes compared are those of the same batches.
KILLED_BATCH, KILLED_BLOCK = 2, 6
BLOCK_ENTRY_POINTS = ("run_ingest", "distributed", "client")


def killed_block_gradients() -> GradientConfig:
    return GradientConfig(batch_size=KILLED_BATCH, projection_memory_gb=NO_P_IN_MEMORY, device="cpu")


def block_ingest(entry: str, index_dir: Path, shard: Path) -> SimpleNamespace:
    """Ingest ``shard`` in blocks of :data:`KILLED_BLOCK` through one of the three entry points
    (the distributed one as a single worker); ``stored`` and, where known, ``skipped_existing``."""
    from eogp_index.config import IngestConfig
    from ingest.distributed import run_distributed_ingest

    config = IngestConfig(block_documents=KILLED_BLOCK, progress=False)
    if entry == "distributed":
        summary = run_distributed_ingest(index_dir, [str(shard)], config, gradients=killed_block_gradients())
        return SimpleNamespace(stored=summary.stored, skipped_existing=summary.skipped_existing)
    index = AttributionIndex.open(index_dir, gradients=killed_block_gradients())
    if entry == "client":
        examples = [e for e in iter_examples([shard], RecordSpec(), index.tokenizer) if isinstance(e, Example)]
        return SimpleNamespace(stored=index.ingest(examples, config), skipped_existing=None)
    summary = run_ingest(index, [str(shard)], config)
    return SimpleNamespace(stored=summary.stored, skipped_existing=summary.skipped_existing)


KILLED_BLOCK_INGEST = textwrap.dedent(f"""
    import sys, time
    from pathlib import Path
    from eogp_index.store import block_cache

    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    from test_pipeline import block_ingest

    write = block_cache.BlockCache.write

    def slow_write(self, batch, coords):
        # Widen each block's first stage so that the test's SIGKILL lands inside a block.
        write(self, batch, coords)
        time.sleep(0.3)

    block_cache.BlockCache.write = slow_write
    block_ingest(sys.argv[3], Path(sys.argv[1]), Path(sys.argv[2]))
""")


@pytest.fixture(scope="module")
def killed_block_reference(fitted, tmp_path_factory):
    """The shard of the killed block ingests, and its codes from ingests never killed, with the
    same gradient batches: a block ingest, and a per-batch ingest with P in memory."""
    root = tmp_path_factory.mktemp("killed-block")
    shard = write_lines(root / "big.jsonl", [{"text": doc(i)} for i in range(30)])
    codes = {}
    for name, gradients, block in (
        ("unkilled", killed_block_gradients(), KILLED_BLOCK),
        ("resident", GradientConfig(batch_size=KILLED_BATCH), None),
    ):
        whole = Path(shutil.copytree(fitted.index, root / name))
        run_ingest(
            AttributionIndex.open(whole, gradients=gradients),
            [str(shard)],
            spec=RecordSpec(),
            progress=False,
            block_documents=block,
        )
        codes[name] = _codes_by_id(whole)
    return SimpleNamespace(shard=shard, codes=codes)


@pytest.mark.parametrize("entry", BLOCK_ENTRY_POINTS)
def test_block_ingest_killed_mid_block_resumes_the_block(
    entry, killed_block_reference, index_dir, tmp_path, tokenizer, monkeypatch
):
    from eogp_index.fit.cache import examples_sha256
    from eogp_index.store.block_cache import BLOCK_RECORD, CACHE_DIR, BlockCache

    total, batch, block = 30, KILLED_BATCH, KILLED_BLOCK
    shard = Path(shutil.copy(killed_block_reference.shard, tmp_path / "big.jsonl"))
    examples = [e for e in iter_examples([shard], RecordSpec(), tokenizer) if isinstance(e, Example)]
    cache = index_dir / CACHE_DIR

    def in_flight_cached(committed: int) -> bool:
        # A block committed, and a batch of the block after it cached: the kill lands inside a
        # block. Batch files alone do not say so: a committed block's files stay until its cache
        # is removed, just after the commit, and a kill there leaves no block in flight.
        try:
            record = json.loads((cache / BLOCK_RECORD).read_text())
        except (OSError, ValueError):  # no cache, or block.json being replaced
            return False
        in_flight = examples_sha256(examples[committed : committed + block])
        return committed >= block and record["examples_sha256"] == in_flight and any(cache.glob("batch-*.safetensors"))

    after_kill = kill_mid_shard(KILLED_BLOCK_INGEST, index_dir, shard, tmp_path, in_flight_cached, entry)
    assert block <= after_kill < total, f"kill landed outside the shard (rows: {after_kill})"
    assert after_kill % block == 0  # whole blocks only
    assert in_flight_cached(after_kill)  # the cache is the block in flight, never committed
    cached = len(list(cache.glob("batch-*.safetensors")))
    assert 1 <= cached <= block // batch

    written = []
    write = BlockCache.write
    monkeypatch.setattr(BlockCache, "write", lambda self, i, coords: written.append(i) or write(self, i, coords))
    summary = block_ingest(entry, index_dir, shard)
    assert summary.stored == total - after_kill
    if summary.skipped_existing is not None:
        assert summary.skipped_existing == after_kill
    assert len(written) == (total - after_kill) // batch - cached  # the killed block's cached batches reused
    ids = stored_ids(index_dir)
    assert len(ids) == total and len(set(ids)) == total
    assert set(ids) == set(expected_ids([shard], RecordSpec(), tokenizer))
    assert not cache.exists()
    # The codes of ingests never killed, with the same gradient batches: a block ingest, and a
    # per-batch ingest with P in memory.
    codes = _codes_by_id(index_dir)
    for name, expected in killed_block_reference.codes.items():
        assert codes == expected, name


# -- bad input ------------------------------------------------------------------------------------
def test_bad_record_raises_and_stores_nothing_of_its_batch(index_dir, tmp_path, tokenizer):
    lines = [{"text": doc(i)} for i in range(5)] + ['{"text": "unterminated'] + [{"text": doc(i)} for i in range(5, 8)]
    shard = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(InputError, match=r"^bad\.jsonl:6: malformed JSON"):
        run_ingest(open_index(index_dir), [shard], spec=RecordSpec(), batch_size=4, progress=False)
    good = expected_ids([shard], RecordSpec(), tokenizer)
    # Lines 1-4 were committed as a batch before the bad line 6; line 5 shared its batch.
    assert sorted(stored_ids(index_dir)) == sorted(good[:4])
    assert not (index_dir / "rejects").exists()


def test_skip_lists_bad_records_with_reasons_and_stores_the_rest(index_dir, tmp_path, tokenizer):
    spec = RecordSpec(id_field="doc_id", metadata_fields=("n",))
    lines = [
        {"doc_id": "a", "text": doc(0), "n": 0},
        '{"doc_id": "b", "text": ',  # 2 malformed JSON
        {"doc_id": "c", "n": 2},  # 3 no content
        {"doc_id": "d", "text": "", "n": 3},  # 4 empty document
        {"doc_id": "e", "input_ids": [5], "n": 4},  # 5 no loss tokens
        {"doc_id": "a", "text": doc(5), "n": 5},  # 6 duplicate id in the run
        {"doc_id": "g", "text": doc(6), "n": "six"},  # 7 metadata type clash
        {"doc_id": "h", "text": doc(7), "n": 7},
    ]
    shard = write_lines(tmp_path / "mixed.jsonl", lines)
    rejects = tmp_path / "rejects.jsonl"
    summary = run_ingest(
        open_index(index_dir), [shard], spec=spec, on_error="skip", rejects_path=rejects, batch_size=4, progress=False
    )
    assert (summary.stored, summary.rejected, summary.duplicates, summary.documents) == (2, 5, 1, 8)
    assert summary.rejects_path == str(rejects)
    assert sorted(stored_ids(index_dir)) == ["a", "h"]
    entries = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [e["location"] for e in entries] == [f"mixed.jsonl:{n}" for n in (2, 3, 4, 5, 6, 7)]
    assert all(set(e) == {"shard", "position", "location", "reason", "record_id"} for e in entries)
    reasons = [e["reason"] for e in entries]
    assert "malformed JSON" in reasons[0]
    assert "missing content" in reasons[1]
    assert "empty document" in reasons[2]
    assert "no loss tokens" in reasons[3]
    assert reasons[4].startswith("duplicate id 'a'") and "mixed.jsonl:1" in reasons[4]
    assert "field 'n'" in reasons[5]
    assert entries[4]["record_id"] == "a" and entries[0]["shard"] == "mixed.jsonl" and entries[0]["position"] == 1


def test_id_stored_from_another_shard_is_a_duplicate(index_dir, tmp_path):
    spec = RecordSpec(id_field="doc_id")
    first = write_lines(tmp_path / "first.jsonl", [{"doc_id": f"x{i}", "text": doc(i)} for i in range(3)])
    second = write_lines(
        tmp_path / "second.jsonl", [{"doc_id": "y0", "text": doc(10)}, {"doc_id": "x1", "text": doc(11)}]
    )
    run_ingest(open_index(index_dir), [first], spec=spec, progress=False)
    with pytest.raises(
        InputError,
        match=r"^second\.jsonl:2: duplicate id 'x1': already stored for the record at "
        r"first\.jsonl:2",
    ):
        run_ingest(open_index(index_dir), [second], spec=spec, progress=False)
    summary = run_ingest(open_index(index_dir), [second], spec=spec, on_error="skip", progress=False)
    assert (summary.stored, summary.duplicates) == (1, 1)
    assert Path(summary.rejects_path).parent == index_dir / "rejects"  # the default place
    assert sorted(stored_ids(index_dir)) == ["x0", "x1", "x2", "y0"]


def test_document_longer_than_the_model_reads_needs_max_tokens(index_dir, tmp_path):
    long_text = " ".join(WORDS * 20)  # far more than the tiny GPT-2's 128 positions
    shard = write_lines(tmp_path / "long.jsonl", [{"text": doc(0)}, {"text": long_text}])
    with pytest.raises(
        InputError, match=r"^long\.jsonl:2: \d+ tokens, but the model reads at most 128; set max_tokens"
    ):
        run_ingest(open_index(index_dir), [shard], spec=RecordSpec(), progress=False)
    summary = run_ingest(open_index(index_dir), [shard], spec=RecordSpec(max_tokens=128), progress=False)
    assert summary.stored == 2
    truncated = open_index_store(index_dir).read(["truncated", "num_tokens"]).to_pylist()
    assert sorted((r["truncated"], r["num_tokens"]) for r in truncated)[-1] == (True, 128)


def test_index_of_another_model_is_refused(fitted, tokenizer):
    with pytest.raises(IncompatibleIndexError, match="was built for model"):
        AttributionIndex.open(fitted.index, model=make_model(tokenizer, seed=1), tokenizer=tokenizer)


# -- scale-out ------------------------------------------------------------------------------------
def test_distributed_worker_alone_commits_whole_steps_and_resumes(index_dir, tmp_path, tokenizer):
    """The torchrun entry point in one process: fragments, Append commits, abort and rerun."""
    from ingest.distributed import run_distributed_ingest

    lines = [{"text": doc(i)} for i in range(6)] + [{"text": 5}] + [{"text": doc(i)} for i in range(6, 9)]
    shard = write_lines(tmp_path / "part.jsonl", lines)
    options = dict(
        spec=RecordSpec(),
        batch_size=2,
        commit_every=2,
        progress=False,
        gradients=GradientConfig(batch_size=GRADIENT_BATCH, device="cpu"),
    )
    with pytest.raises(InputError, match=r"^part\.jsonl:7: field 'text': expected a string"):
        run_distributed_ingest(index_dir, [shard], **options)
    good = expected_ids([shard], RecordSpec(), tokenizer)
    # Steps 1-2 were committed together, step 3 when the failure stopped the run; nothing of step 4.
    assert sorted(stored_ids(index_dir)) == sorted(good[:6])

    summary = run_distributed_ingest(index_dir, [shard], on_error="skip", **options)
    assert (summary.stored, summary.skipped_existing, summary.rejected, summary.workers) == (3, 6, 1, 1)
    assert json.loads(Path(summary.rejects_path).read_text())["location"] == "part.jsonl:7"
    ids = stored_ids(index_dir)
    assert len(ids) == len(set(ids)) == 9 and set(ids) == set(good)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["per_batch", "block"])
def test_two_process_ingest_equals_one_process_ingest(mode, fitted, tmp_path, tokenizer):
    """Two torchrun workers store every document once, with the codes of a one-process per-batch
    ingest; in block mode (P out of memory) each worker's step is a block of two gradient batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    data.mkdir()
    # Shards of whole gradient batches: both runs then project exactly the same batches.
    for k in range(4):
        rows = [{"text": doc(10 * k + i, f"s{k}"), "source": f"s{k}"} for i in range(2 * GRADIENT_BATCH)]
        if k % 2:  # a field with values in worker 1's shards only: worker 0's rows hold null
            rows = [row | {"license": f"l{i % 3}"} for i, row in enumerate(rows)]
            pq.write_table(pa.Table.from_pylist(rows), data / f"part-{k}.parquet")
        else:
            write_lines(data / f"part-{k}.jsonl", rows)
    distributed = Path(shutil.copytree(fitted.index, tmp_path / "distributed"))
    single = Path(shutil.copytree(fitted.index, tmp_path / "single"))
    from torchrun import run_torchrun_eogp  # here: the kill tests' child processes import this module without tests/

    args = ["ingest", str(distributed), str(data / "*"), "--metadata", "source", "--metadata", "license",
            "--batch-size", str(GRADIENT_BATCH), "--device", "cpu", "--json"]  # fmt: skip
    if mode == "block":
        args += ["--projection-memory-gb", str(NO_P_IN_MEMORY), "--block-documents", str(2 * GRADIENT_BATCH)]
    result = run_torchrun_eogp(*args)
    reported = json.loads(result.stdout[result.stdout.index("{") :])
    assert reported["stored"] == 32 and reported["workers"] == 2

    spec = RecordSpec(metadata_fields=("source", "license"))
    run_ingest(open_index(single), [str(data / "*")], spec=spec, batch_size=GRADIENT_BATCH, progress=False)
    columns = [
        "id",
        "signs",
        "scales",
        "shard",
        "position",
        "num_tokens",
        "num_loss_tokens",
        "truncated",
        "source",
        "license",
    ]
    two = open_index_store(distributed).read(columns).sort_by("id")
    one = open_index_store(single).read(columns).sort_by("id")
    assert two.num_rows == one.num_rows == 32
    assert two.column("id").to_pylist() == one.column("id").to_pylist()
    for name in columns[1:]:
        assert two.column(name).to_pylist() == one.column(name).to_pylist(), name
    # A fragment per worker and step: steps of a block (2 gradient batches) or of --batch-size rows.
    rows_per_step = 2 * GRADIENT_BATCH if mode == "block" else GRADIENT_BATCH
    assert len(open_index_store(distributed).dataset().get_fragments()) == 32 // rows_per_step
    assert not (distributed / "ingest-cache").exists()  # every worker's block cache removed
    if mode == "block":
        return  # the rerun below is the same in both modes

    # Running the job again stores nothing new.
    again = run_torchrun_eogp(*args)
    rerun = json.loads(again.stdout[again.stdout.index("{") :])
    assert (rerun["stored"], rerun["skipped_existing"]) == (0, 32)
    assert open_index_store(distributed).count() == 32


# -- generated metadata: nulls and lists of every type ------------------------------------------
METADATA_TYPES = {
    "str": lambda rng: rng.choice(["en", "fr", "", "\x00", "\ufdd0", "é"]),
    "int": lambda rng: rng.randrange(-(2**63), 2**63),
    "float": lambda rng: rng.uniform(-1e9, 1e9),
    "bool": lambda rng: rng.random() < 0.5,
}


def _wrong_metadata(rng, kind: str, is_list: bool):
    """A value no field of this kind takes: another type, a nested value or bad text."""
    other = rng.choice([k for k in METADATA_TYPES if k != kind and (kind, k) != ("float", "int")])
    value = METADATA_TYPES[other](rng)
    return rng.choice(
        [
            [value] if is_list else value,
            {"a": 1},
            [[1]],
            "bad \ud800" if kind == "str" else [value],
            2**64 if kind == "int" else value,
        ]
    )


def _generated_metadata(rng, first: bool):
    """One record's metadata (a scalar and a list field per type) and whether it is valid."""
    record, valid = {}, True
    for kind, make in METADATA_TYPES.items():
        for is_list in (False, True):
            name = f"{'l' if is_list else 'm'}_{kind}"
            roll = 0.5 if first else rng.random()
            if roll < 0.04:
                record[name], valid = _wrong_metadata(rng, kind, is_list), False
            elif roll < 0.2:
                continue  # absent
            elif roll < 0.35:
                record[name] = None
            elif is_list:
                record[name] = [
                    None if rng.random() < 0.2 and not first else make(rng)
                    for _ in range(rng.randrange(1 if first else 0, 4))
                ]
            else:
                record[name] = rng.randrange(-5, 5) if kind == "float" and rng.random() < 0.3 else make(rng)
    return record, valid


def test_generated_nulls_and_lists_of_every_metadata_type_store_every_valid_record(index_dir, tmp_path):
    import random

    rng = random.Random(7)
    records, valid = [], []
    for i in range(40):
        metadata, ok = _generated_metadata(rng, first=i == 0)
        records.append({"id": f"r{i}", "text": doc(i), **metadata})
        valid.append(ok)
    shard = tmp_path / "generated.jsonl"
    shard.write_text("".join(json.dumps(r) + "\n" for r in records))
    fields = tuple(f"{p}_{k}" for k in METADATA_TYPES for p in "ml")
    rejects = tmp_path / "rejects.jsonl"
    summary = run_ingest(
        open_index(index_dir),
        [shard],
        spec=RecordSpec(id_field="id", metadata_fields=fields),
        on_error="skip",
        rejects_path=rejects,
        batch_size=4,
        progress=False,
    )
    rejected = [json.loads(line) for line in rejects.read_text().splitlines()] if rejects.exists() else []
    assert [e["location"] for e in rejected] == [f"generated.jsonl:{i + 1}" for i, ok in enumerate(valid) if not ok]
    assert all(any(f"'{name}" in e["reason"] for name in fields) for e in rejected), rejected
    assert summary.stored == sum(valid) >= 10 and summary.rejected == len(rejected) >= 3
    store = open_index_store(index_dir)
    rows = {row.pop("id"): row for row in store.read(["id", *fields]).to_pylist()}
    for record, ok in zip(records, valid):
        if not ok:
            assert record["id"] not in rows
            continue
        expected = {name: record.get(name) for name in fields}
        for name in ("m_float", "l_float"):  # ints in a float field are stored as floats
            value = expected[name]
            expected[name] = (
                [None if v is None else float(v) for v in value]
                if isinstance(value, list)
                else (None if value is None else float(value))
            )
        assert rows[record["id"]] == expected
    for name in fields:  # null-aware filters see exactly the records without a value
        nulls = sorted(r["id"] for r, ok in zip(records, valid) if ok and r.get(name) is None)
        assert sorted(store.read(["id"], f"{name} IS NULL").column("id").to_pylist()) == nulls
    assert str(store.schema.field("l_bool").type) == "list<item: bool>"
