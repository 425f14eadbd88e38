"""Takedowns (eogp delete; eogp_index.store.deletions, eogp_index.search.takedown): deleted rows
leave every answer, are recorded without their text, are not ingested again, and with a purge
no file under the index holds their text or codes; a takedown killed at any step is completed
by the next one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from tinymodels import make_tiny_gpt2, make_word_tokenizer

from eogp_index.errors import ConfigError, InputError
from eogp_index.store import deletions
from eogp_index.store.stored_index import StoredIndex

__import__("transformers").logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]
#: Words the tokenizer does not know (read as its unknown token): each deleted document's text
#: holds one, found nowhere else.
MARKER = "ZQXTAKEDOWN"
DELETED = ("doc-3", "doc-8", "doc-17")
KINDS = ("function", "class", "module")


def _text(i: int) -> str:
    words = [f"t{(i * 7 + j * 3) % 63 + 1}" for j in range(6 + i % 11)]
    if f"doc-{i}" in DELETED:
        words.insert(2, f"{MARKER}{i}")
    return " ".join(words)


def _records():
    return [{"id": f"doc-{i}", "text": _text(i), "kind": KINDS[i % 3]} for i in range(24)]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A tiny GPT-2 with a word tokenizer, 24 documents fitted by `eogp fit` and ingested with
    their text stored, in two shards (several fragments)."""
    from eogp_index.cli import cli

    root = tmp_path_factory.mktemp("takedown")
    make_tiny_gpt2().save_pretrained(root / "model")
    make_word_tokenizer().save_pretrained(root / "model")
    records = _records()
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:12]))
    (root / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[12:]))
    fit = CliRunner().invoke(
        cli,
        [
            "fit",
            str(root / "model"),
            "--data",
            str(root / "a.jsonl"),
            "--data",
            str(root / "b.jsonl"),
            "--out",
            str(root / "idx"),
            "-k",
            "16",
            "--curvature-examples",
            "24",
            "--pca-examples",
            "24",
            "--max-tokens",
            "24",
            "--id-field",
            "id",
        ],
    )
    assert fit.exit_code == 0, fit.output
    index = _open(root / "idx")
    for shard in ("a.jsonl", "b.jsonl"):
        summary = _ingest(index, root / shard)
        assert summary.stored == 12, summary
    return root


def _open(path):
    from eogp_index.serve.app import open_index

    return open_index(path, device="cpu")


def _ingest(index, shard, **options):
    from eogp_index.data.records import RecordSpec
    from ingest.pipeline import run_ingest

    spec = RecordSpec(id_field="id", metadata_fields=("kind",))
    return run_ingest(index, [shard], spec=spec, store_text=4096, progress=False, batch_size=4, **options)


@pytest.fixture
def root(template, tmp_path):
    """A private copy of the template (model, shards and index)."""
    shutil.copytree(template, tmp_path / "t")
    return tmp_path / "t"


def _signs(path, ids):
    """The stored one-bit codes' bytes of ``ids``."""
    store = StoredIndex.open(path).store
    table = store.read(["id", "signs"], deletions.id_predicate(list(ids)))
    return [bytes(v) for v in table.column("signs").to_pylist()]


def _holding(path: Path, needles) -> dict:
    """``{needle: [files under path holding its bytes]}`` for every needle found anywhere."""
    found = {}
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        data = file.read_bytes()
        for needle in needles:
            if needle in data:
                found.setdefault(needle, []).append(str(file.relative_to(path)))
    return found


def _answered_ids(index):
    """Every id any answer names: the hot, stream, sharded (one worker) and candidate routes, the
    torch kernels (on the CPU), a filter, scores."""
    from eogp_index.search.question import Question
    from eogp_index.search.searchers import TorchSearcher

    query = "t5 t9 t12 t3"
    rowaddr, _ = TorchSearcher(index.stored, "cpu").scores(index.query_coordinates([query]))
    seen = set(index.stored.rows(rowaddr, ["id"]).column("id").to_pylist())
    for route in ("hot", "stream", "sharded", "candidates"):
        extra = {"candidates": 30} if route == "candidates" else {}
        question = Question(queries=(query,), k=30, direction="both", route=route, **extra)
        seen |= set(index.search(question).to_arrow().column("id").to_pylist())
    seen |= set(index.search(query).where("kind = 'class'").limit(30).direction("both").to_arrow()["id"].to_pylist())
    ids, _ = index.scores([query])
    seen |= set(ids)
    return seen


def test_deleted_rows_leave_every_answer_and_are_recorded_without_text(root):
    from eogp_index.search.first_pass import build
    from eogp_index.search.question import Question

    index = _open(root / "idx")
    build(index, progress=False)
    assert set(DELETED) <= _answered_ids(index)
    before_rows = index.store.count()

    report = index.delete(where="text LIKE '%ZQXTAKEDOWN%'", reason="licence withdrawn")
    assert (report.rows_deleted, report.ids, report.purged) == (3, 3, False)
    assert index.store.count() == before_rows - 3
    assert not set(DELETED) & _answered_ids(index)
    groups = index.search(Question(queries=("t5 t9",), group_by="kind")).roll_ups()[0]
    assert sum(groups.column("rows").to_pylist()) == before_rows - 3
    with pytest.raises(InputError, match="no stored example has id 'doc-3'"):
        index.explain("t5 t9", "doc-3")

    log = deletions.read_log(root / "idx")
    assert [e["id"] for e in log] == sorted(DELETED, key=lambda i: int(i.split("-")[1]))
    schema = json.loads((REPO / "schemas" / "deletions.schema.json").read_text())
    import jsonschema

    for entry in log:
        jsonschema.validate(entry, schema)
        assert entry["reason"] == "licence withdrawn" and len(entry["content_sha256"]) == 64
    assert MARKER not in (root / "idx" / deletions.DELETIONS_FILE).read_text()
    assert not (root / "idx" / deletions.PENDING_FILE).exists()

    info = StoredIndex.open(root / "idx").info()["deletions"]
    assert info["ids"] == 3 and info["awaiting_purge"] == 3 and info["pending"] is None
    # The fit sampled every document: each deleted one is in the fitting set.
    assert set(info["in_fitting_set"]["curvature"]) == set(DELETED)


def test_purge_leaves_no_file_with_a_deleted_documents_text_or_codes(root):
    from eogp_index.search.first_pass import build

    index = _open(root / "idx")
    build(index, progress=False)
    codes = _signs(root / "idx", DELETED)
    needles = [MARKER.encode(), *codes]
    rejects = root / "idx" / "rejects" / "run.jsonl"  # as an ingest with on_error="skip" writes them
    rejects.parent.mkdir()
    rejects.write_text("".join(json.dumps({"record_id": i, "reason": "r"}) + "\n" for i in ("doc-3", "doc-5")))
    # Deleted, not purged: the text and codes are still on disk (so the check below can fail).
    index.delete(ids=list(DELETED), reason="privacy")
    found = _holding(root / "idx", needles)
    assert MARKER.encode() in found and all(code in found for code in codes), found

    report = index.delete(purge=True)
    assert report.purged and report.first_passes == {"default": "rebuilt"}
    assert _holding(root / "idx", needles) == {}
    assert not set(DELETED) & _answered_ids(index)
    assert index.store.count() == 21 and len(index.store.dataset().versions()) == 1
    assert StoredIndex.open(root / "idx").info()["deletions"]["awaiting_purge"] == 0
    assert [json.loads(line)["record_id"] for line in rejects.read_text().splitlines()] == ["doc-5"]


def test_a_later_ingest_skips_deleted_records_unless_allowed(root):
    index = _open(root / "idx")
    index.delete(ids=["doc-3", "doc-404"], reason="takedown")
    report = index.delete(ids=["doc-3", "doc-8"])
    assert (report.rows_deleted, report.already_deleted, report.ids) == (1, 1, 1)
    # The same records again, and doc-17's content under a new id: skipped as deleted.
    records = [r for r in _records() if r["id"] in ("doc-3", "doc-8", "doc-17")]
    records[2] = {**records[2], "id": "doc-17-copy"}
    index.delete(ids=["doc-17"])
    shard = root / "again.jsonl"
    shard.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = _ingest(index, shard)
    assert (summary.stored, summary.skipped_deleted, summary.documents) == (0, 3, 3)
    assert "3 (deleted)" in summary.describe()
    assert _ingest(index, shard, allow_deleted=True).stored == 3


def test_where_is_checked_as_every_filter_and_targets_are_one_kind(root):
    index = _open(root / "idx")
    with pytest.raises(InputError, match="invalid where filter") as caught:
        index.delete(where="kind = 'class'; DROP TABLE examples")
    assert caught.value.field == "where"
    with pytest.raises(ConfigError, match="where or ids, not both"):
        index.delete(where="kind = 'class'", ids=["doc-1"])
    with pytest.raises(InputError, match="nothing to delete"):
        index.delete()
    with pytest.raises(InputError, match="a list of example ids"):
        index.delete(ids="doc-1")
    assert index.store.count() == 24 and not (root / "idx" / deletions.DELETIONS_FILE).exists()


def test_cli_delete_and_info(root):
    from eogp_index.cli import cli

    ids = root / "ids.jsonl"
    ids.write_text('{"id": "doc-3"}\n\ndoc-8\n')
    runner = CliRunner()
    result = runner.invoke(cli, ["delete", str(root / "idx"), "--ids", str(ids), "--reason", "dmca", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["rows_deleted"] == 2
    info = runner.invoke(cli, ["info", str(root / "idx")])
    assert info.exit_code == 0, info.output
    assert "deleted     2 ids in 1 takedown (deletions.jsonl)" in info.output and "fitted this index" in info.output
    both = runner.invoke(cli, ["delete", str(root / "idx"), "--ids", str(ids), "--where", "kind = 'class'"])
    assert both.exit_code != 0 and "not both" in both.output
    bad = root / "bad.jsonl"
    bad.write_text('{"name": "doc-1"}\n')
    refused = runner.invoke(cli, ["delete", str(root / "idx"), "--ids", str(bad)])
    assert refused.exit_code != 0 and "bad.jsonl:1" in refused.output


_KILLED_TAKEDOWN = """
import sys, time
from eogp_index.search.takedown import delete
from eogp_index.store.stored_index import StoredIndex

def on_step(step):
    print("step", step, flush=True)
    if step == sys.argv[2]:
        time.sleep(600)  # the test kills the process here, with the step recorded

delete(StoredIndex.open(sys.argv[1]), ids=sys.argv[3].split(","), reason="killed", purge=True, on_step=on_step)
"""


@pytest.mark.parametrize("step", deletions.STEPS)
def test_a_takedown_killed_at_any_step_is_completed_by_the_next(root, step):
    from eogp_index.search.first_pass import build
    from eogp_index.search.takedown import delete

    stored = StoredIndex.open(root / "idx")
    build(stored, progress=False)
    stored.hot_codes()  # a hot copy on disk, as queries leave one
    needles = [MARKER.encode(), *_signs(root / "idx", DELETED)]
    script = root / "killed_takedown.py"
    script.write_text(_KILLED_TAKEDOWN)
    child = subprocess.Popen(
        [sys.executable, str(script), str(root / "idx"), step, ",".join(DELETED)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    output = []
    try:
        for line in child.stdout:
            output.append(line)
            if line.strip() == f"step {step}":
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        child.wait(timeout=120)
    assert child.returncode == -signal.SIGKILL, "".join(output)[-3000:]
    pending = deletions.read_pending(root / "idx")
    assert pending is not None and pending["steps"][-1] == step

    # The same command again: it completes the interrupted takedown, then finds nothing left.
    report = delete(StoredIndex.open(root / "idx"), ids=list(DELETED), reason="killed", purge=True)
    assert report.resumed == pending["request"] and report.already_deleted == 3
    assert deletions.read_pending(root / "idx") is None
    assert sorted(e["id"] for e in deletions.read_log(root / "idx")) == sorted(DELETED)
    assert _holding(root / "idx", needles) == {}
    stored = StoredIndex.open(root / "idx")
    hot_ids = set(stored.hot_codes().columns.column("id").to_pylist())
    assert stored.store.count() == len(hot_ids) == 21 and not set(DELETED) & hot_ids


def test_the_server_deletes_with_its_write_token_only_and_follows_other_takedowns(root):
    from fastapi.testclient import TestClient

    from eogp_index.search.takedown import delete
    from eogp_index.serve.app import create_app
    from eogp_index.serve.config import ServeConfig

    index = _open(root / "idx")
    body = {"text": "t5 t9 t12 t3", "k": 30, "direction": "both"}

    def answered(client, headers):
        reply = client.post("/v1/query", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        return {hit["id"] for hit in reply.json()["results"]}

    with TestClient(create_app(index, ServeConfig())) as plain:
        refused = plain.request("DELETE", "/v1/examples", json={"ids": ["doc-3"]})
        assert refused.status_code == 403 and "--write-token" in refused.json()["error"]["message"]
    reader, writer = {"Authorization": "Bearer r"}, {"Authorization": "Bearer w"}
    with TestClient(create_app(index, ServeConfig(token="r", write_token="w"))) as client:
        assert set(DELETED) <= answered(client, reader)
        for headers in ({}, reader):
            reply = client.request("DELETE", "/v1/examples", json={"ids": ["doc-3"]}, headers=headers)
            assert reply.status_code == 401, reply.text
        bad = client.request("DELETE", "/v1/examples", json={"where": "kind = 'class' OR"}, headers=writer)
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "where"
        reply = client.request("DELETE", "/v1/examples", json={"ids": ["doc-3"], "reason": "dmca"}, headers=writer)
        assert reply.status_code == 200 and reply.json()["rows_deleted"] == 1, reply.text
        assert "doc-3" not in answered(client, writer)  # the write token reads too
        # Another process takes doc-8 down: the running server's next query leaves it out.
        delete(StoredIndex.open(root / "idx"), ids=["doc-8"])
        assert not {"doc-3", "doc-8"} & answered(client, reader)
        assert "doc-17" in answered(client, reader)
