"""An index at a URL: the tiny model's index fitted, ingested and queried on S3 (moto's server on
loopback) answers what the same steps on a local directory answer; a bad URL is refused; the
projection is read by ranges; the ingest lock and a killed ingest's rerun work on S3."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner
from s3server import s3_server
from tinymodels import make_tiny_gpt2, save_workspace

from eogp_index.cli import cli
from eogp_index.data import location
from eogp_index.errors import ConfigError

pytestmark = pytest.mark.objectstore
__import__("transformers").logging.set_verbosity_error()
__import__("transformers").utils.logging.disable_progress_bar()

BUCKET = "eogp-test"
DOCUMENTS = 24


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on loopback with the bucket; yields the endpoint."""
    with s3_server(BUCKET, tmp_path_factory.mktemp("cache")) as endpoint:
        yield endpoint


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _ok(*args):
    result = _run(*args)
    assert result.exit_code == 0, result.output
    return result


def _interrupted_ingest(url: str, shard: Path) -> int:
    """An ingest of ``shard`` into ``url`` stopped after two commits, leaving behind what a SIGKILL
    leaves: whole commits, and the lock of a process that is gone. Returns the rows committed."""
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig
    from eogp_index.encode.commits import LOCK_FILE
    from ingest.pipeline import run_ingest
    from ingest.records import RecordSpec

    index = AttributionIndex.open(url, gradients=GradientConfig(batch_size=2))
    commit, committed = index.store.add, []

    def add(rows):
        if len(committed) == 2:
            raise KeyboardInterrupt  # stopped between two commits
        committed.append(rows.num_rows)
        return commit(rows)

    index.store.add = add
    spec = RecordSpec(id_field="id", metadata_fields=("n",))
    with pytest.raises(KeyboardInterrupt):
        run_ingest(index, [str(shard)], spec=spec, batch_size=2, progress=False)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    holder = {"host": socket.gethostname(), "pid": gone.pid, "token": "killed", "renewed": time.time()}
    (location.index_path(url) / LOCK_FILE).write_text(json.dumps(holder))
    return sum(committed)


@pytest.fixture(scope="module")
def both(s3, tmp_path_factory):
    """One fit, to ``s3://eogp-test/idx``; its files copied to a local directory, which is
    ingested in one run; the S3 index ingested by a run stopped midway (its lock left behind, as
    a killed run leaves it) and a rerun."""
    root = tmp_path_factory.mktemp("objectstore")
    save_workspace(root, make_tiny_gpt2(), DOCUMENTS, stride=5, numbered=True)
    url = f"s3://{BUCKET}/idx"
    fit = ["-k", "16", "--curvature-examples", str(DOCUMENTS), "--pca-examples", str(DOCUMENTS), "--max-tokens", "24"]
    _ok("fit", root / "model", "--data", root / "shard.jsonl", "--out", url, *fit)
    remote = location.index_path(url)
    pafs.copy_files(remote.fs_path, str(root / "idx"), remote.filesystem, pafs.LocalFileSystem())
    ingest = ["--id-field", "id", "--metadata", "n", "--json"]
    _ok("ingest", root / "idx", root / "shard.jsonl", *ingest)
    after_kill = _interrupted_ingest(url, root / "shard.jsonl")
    rerun = json.loads(_ok("ingest", url, root / "shard.jsonl", *ingest).stdout)
    return root, {"local": root / "idx", "s3": url}, after_kill, rerun


@pytest.fixture(scope="module")
def opened(both):
    from eogp_index.client import AttributionIndex

    # AttributionIndex(URL) is AttributionIndex.open(URL): the model the manifest names
    return {"local": AttributionIndex.open(both[1]["local"]), "s3": AttributionIndex(both[1]["s3"])}


def _hits(result):
    return [[(r["id"], r["score"]) for r in side["results"]] for side in json.loads(result.stdout)]


def test_the_index_lives_in_the_bucket_and_nothing_named_s3_is_made(both, s3):
    root, indexes, _, _ = both
    import boto3

    keys = {o["Key"] for o in boto3.client("s3", endpoint_url=s3).list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert {"idx/manifest.json", "idx/projection.safetensors", "idx/sources.json"} <= keys
    assert any(key.startswith("idx/examples.lance/_versions/") for key in keys)
    assert "idx/fit/fitting_set.json" in keys and not any(k.startswith("idx/fit/coords/") for k in keys)
    assert not any("/hot/" in key or "ingest-cache" in key for key in keys)  # on a local disk
    assert not (Path.cwd() / "s3:").exists() and not (root / "s3:").exists()
    info = json.loads(_ok("info", indexes["s3"], "--json").stdout)
    assert info["rows"] == DOCUMENTS and info["path"] == indexes["s3"]


def test_a_killed_ingest_is_rerun_on_s3_without_duplicates(both):
    root, indexes, after_kill, rerun = both
    from eogp_index.encode.commits import LOCK_FILE
    from eogp_index.store.stored_index import StoredIndex

    assert after_kill == 4  # stopped midway: its lock was left behind, and taken over
    assert rerun["skipped_existing"] == after_kill and rerun["stored"] == DOCUMENTS - after_kill
    ids = StoredIndex.open(indexes["s3"]).store.read(["id"]).column("id").to_pylist()
    assert sorted(ids) == sorted(f"d{i}" for i in range(DOCUMENTS))
    assert not (location.index_path(indexes["s3"]) / LOCK_FILE).exists()  # released at the end


def test_a_rival_lock_put_landing_after_ours_wins_and_we_back_off(both):
    """A rival that read "no lock" before our PUT landed writes its own lease just after: the
    read back after the settle time finds the rival's token, and this ingest refuses."""
    import threading

    from eogp_index.encode.commits import LOCK_FILE, index_lock

    url = both[1]["s3"] + "-race"
    lock = location.index_path(url) / LOCK_FILE
    location.index_path(url).mkdir()
    outcome = []

    def take() -> None:
        try:
            with index_lock(url):
                outcome.append("in")
        except ConfigError as err:
            outcome.append(str(err))

    taker = threading.Thread(target=take)
    taker.start()
    deadline = time.time() + 30
    while not lock.exists() and time.time() < deadline:
        time.sleep(0.01)
    rival = {"host": "elsewhere", "pid": 1, "token": "rival", "renewed": time.time()}
    lock.write_text(json.dumps(rival))
    taker.join()
    assert len(outcome) == 1 and "another ingest took" in outcome[0], outcome
    assert json.loads(lock.read_text())["token"] == "rival"  # the rival's lease is left alone


def test_a_held_ingest_lock_refuses_a_second_ingest(both):
    from eogp_index.encode.commits import LOCK_FILE, index_lock

    root, indexes, _, _ = both
    lock = location.index_path(indexes["s3"]) / LOCK_FILE
    with index_lock(indexes["s3"]):
        assert lock.exists()
        refused = _run("ingest", indexes["s3"], root / "shard.jsonl", "--id-field", "id")
        assert refused.exit_code != 0 and "another ingest" in refused.output
    assert not lock.exists()


def test_queries_explanations_selections_and_scores_equal_the_local_index(both, opened, tmp_path):
    from eogp_index.search.select import write_scores

    root, indexes, _, _ = both
    question = ["--text", "t1 t2 t3 t4", "-k", "5", "--direction", "both", "--where", "n > 3", "--json"]
    local = _hits(_ok("query", indexes["local"], *question))
    assert _hits(_ok("query", indexes["s3"], *question)) == local and local[0]
    answers = {
        name: index.search("t5 t6 t7").where("n < 20").limit(6).direction("both").to_arrow().to_pylist()
        for name, index in opened.items()
    }
    assert answers["s3"] == answers["local"] and answers["local"]
    top = answers["local"][0]["id"]
    explained = {name: index.explain("t5 t6 t7", top).to_json() for name, index in opened.items()}
    assert explained["s3"] == explained["local"]
    outs = {"local": tmp_path / "sel.jsonl", "s3": f"s3://{BUCKET}/out/sel.jsonl"}
    for name, index in opened.items():
        index.select(["t1 t2 t3"], out=outs[name])
    assert location.index_path(outs["s3"]).read_text() == outs["local"].read_text()
    _ok("scores", indexes["s3"], "--text", "t1 t2 t3", "--out", f"s3://{BUCKET}/out/scores.parquet")
    write_scores(opened["local"].encoder, ["t1 t2 t3"], tmp_path / "scores.parquet")
    import pyarrow.parquet as pq

    remote = location.index_path(f"s3://{BUCKET}/out/scores.parquet")
    assert pq.read_table(remote.fs_path, filesystem=remote.filesystem).equals(
        pq.read_table(tmp_path / "scores.parquet")
    )


def test_verify_optimize_and_candidates_work_at_a_url(both, opened):
    root, indexes, _, _ = both
    assert json.loads(_ok("verify", indexes["s3"], "--json").stdout)["ok"]
    for where in indexes.values():
        _ok("optimize", where, "--json")
        assert json.loads(_ok("build-candidates", where, "--json").stdout)["rows"] == DOCUMENTS
    assert (location.index_path(indexes["s3"]) / "faiss" / "default.json").exists()
    answers = {
        name: index.search("t5 t6 t7").limit(4).candidates(40).to_arrow().to_pylist() for name, index in opened.items()
    }
    assert answers["s3"] == answers["local"] and answers["local"]
    cache = location.local_cache_dir(location.index_path(indexes["s3"]))
    assert (cache / "hot").is_dir() and not (location.index_path(indexes["s3"]) / "hot").exists()


@pytest.mark.parametrize("url", ["s3:/x", "s3:", "s3://", "foo://x/idx", "gs:bucket/x", "file://host/x"])
def test_a_url_no_layer_reads_is_refused_and_nothing_is_made(both, url, tmp_path, monkeypatch):
    root = both[0]
    monkeypatch.chdir(tmp_path)
    fitted = _run("fit", root / "model", "--data", root / "shard.jsonl", "--out", url, "-k", "16")
    assert fitted.exit_code != 0 and "s3://bucket/prefix" in fitted.output and url in fitted.output
    assert _run("ingest", url, root / "shard.jsonl").exit_code != 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="gs://bucket/prefix"):
        location.index_path(url)


def test_file_urls_are_local_directories(both):
    indexes = both[1]
    url = "file://" + str(indexes["local"].absolute())
    assert location.index_path(url) == indexes["local"].absolute()
    question = ["--text", "t1 t2 t3 t4", "-k", "3", "--json"]
    assert _hits(_ok("query", url, *question)) == _hits(_ok("query", indexes["local"], *question))


class _Counting(pafs.FileSystemHandler):
    """A pyarrow file system that records every read of the real one: (path, offset, bytes)."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def open_input_file(self, path):
        real, reads = self.real.open_input_file(path), self.reads

        class Reader:
            closed = False

            def read(self, n=-1):
                offset = real.tell()
                data = real.read() if n is None or n < 0 else real.read(n)
                reads.append((path, offset, len(data)))
                return data

            def seek(self, offset, whence=0):
                return real.seek(offset, whence)

            def tell(self):
                return real.tell()

            def size(self):
                return real.size()

            def close(self):
                real.close()

        return __import__("pyarrow").PythonFile(Reader(), mode="r")

    def get_type_name(self):
        return "counting"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.real.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.real.get_file_info(selector)

    def open_input_stream(self, path):
        return self.real.open_input_stream(path)

    def open_output_stream(self, path, metadata):
        return self.real.open_output_stream(path)

    def _unused(self, *args):  # the writes and moves this test does not make
        raise NotImplementedError

    copy_file = create_dir = delete_dir = delete_dir_contents = delete_file = _unused
    delete_root_dir_contents = move = open_append_stream = _unused


def test_the_projection_is_read_by_ranges_one_module_at_a_time(both, monkeypatch):
    """A query reads each module's P by one range read of its own bytes (P kept in memory by none),
    never the file whole."""
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig
    from eogp_index.store.files import safetensors_header

    path = location.index_path(both[1]["s3"]) / "projection.safetensors"
    header = safetensors_header(path)
    size = path.stat().st_size
    pca = {key: e["data_offsets"][1] - e["data_offsets"][0] for key, e in header.items() if key.endswith("/pca")}
    handler = _Counting(path.filesystem)
    monkeypatch.setattr(location.RemotePath, "filesystem", property(lambda self: pafs.PyFileSystem(handler)))

    def projection_reads():
        reads = [n for where, _, n in handler.reads if where == path.fs_path]
        handler.reads.clear()
        return reads

    index = AttributionIndex.open(both[1]["s3"], gradients=GradientConfig(projection_memory_gb=1e-9))
    index.projection  # opened and checked (a file this small is fingerprinted whole)
    projection_reads()
    assert index.search("t1 t2 t3").limit(3).direction("positive").to_arrow().num_rows == 3
    queried = projection_reads()
    assert pca and sorted(queried) == sorted(pca.values())  # each P once, by one read of its own bytes
    assert sum(queried) < size


def test_serve_answers_from_an_index_at_a_url(both, opened):
    """The server opens the index at its URL and answers what the local index answers."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from eogp_index.serve.app import create_app, open_index
    from eogp_index.serve.config import ServeConfig

    with TestClient(create_app(open_index(both[1]["s3"], device="cpu"), ServeConfig())) as client:
        answer = client.post("/v1/query", json={"text": "t1 t2 t3", "k": 4, "direction": "both"})
        health = client.get("/healthz")
    assert answer.status_code == 200 and health.status_code == 200, answer.text
    served = [(r["direction"], r["id"], r["score"]) for r in answer.json()["results"]]
    local = opened["local"].search("t1 t2 t3").limit(4).direction("both").to_arrow().to_pylist()
    assert served == [(r["direction"], r["id"], r["score"]) for r in local] and served


def test_locations_parse_to_paths_urls_and_lance_settings(monkeypatch, tmp_path):
    """No server: how each kind of location is read, and what Lance is given for it."""
    assert location.index_path("idx") == Path("idx") and location.index_path("file:///data/idx") == Path("/data/idx")
    remote = location.index_path("s3://bucket/a/b/")
    assert (remote.scheme, remote.bucket, remote.key, remote.url) == ("s3", "bucket", "a/b", "s3://bucket/a/b")
    assert str(remote / "manifest.json") == "s3://bucket/a/b/manifest.json" and remote.parent.url == "s3://bucket/a"
    assert location.index_path("abfs://box@acct.dfs.core.windows.net/x").fs_path == "box/x"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    uri, options = location.lance_target(remote / "examples.lance")
    assert uri == "s3://bucket/a/b/examples.lance"
    assert options == {"aws_endpoint": "http://127.0.0.1:9000", "allow_http": "true", "aws_region": "us-east-1"}
    assert location.lance_target(tmp_path / "examples.lance") == (str(tmp_path / "examples.lance"), None)
    monkeypatch.setenv(location.CACHE_ENV, str(tmp_path))
    cache = location.local_cache_dir(remote)
    assert cache.parent == tmp_path and cache != location.local_cache_dir(location.index_path("s3://bucket/a/c"))
    assert location.local_cache_dir(Path("idx")) == Path("idx")  # a local index keeps its own layout


def test_a_sampled_fingerprint_of_an_object_equals_the_local_files(both, monkeypatch):
    """The fingerprint checked on every open, sampled by concurrent range reads of the object,
    is the one of the same bytes on a local disk."""
    from eogp_index.store import files

    monkeypatch.setattr(files, "FINGERPRINT_WHOLE_FILE_BYTES", 1024)  # sample even this small file
    monkeypatch.setattr(files, "FINGERPRINT_CHUNK_BYTES", 64)
    remote = location.index_path(both[1]["s3"]) / "projection.safetensors"
    local = both[1]["local"] / "projection.safetensors"
    assert local.stat().st_size > 1024
    sampled = files.file_fingerprint(remote)
    assert sampled == files.file_fingerprint(local)
    monkeypatch.setattr(files, "FINGERPRINT_WHOLE_FILE_BYTES", 1 << 40)
    assert files.file_fingerprint(remote) == files.file_fingerprint(local) != sampled  # whole, not sampled
    assert files.file_sha256(remote) == files.file_sha256(local)


def test_a_takedown_at_a_url_leaves_every_answer_and_is_recorded_in_the_bucket(both, tmp_path):
    root, indexes, _, _ = both
    source = location.index_path(indexes["s3"])
    url = f"s3://{BUCKET}/takedown"
    pafs.copy_files(source.fs_path, location.index_path(url).fs_path, source.filesystem, source.filesystem)
    (tmp_path / "ids.txt").write_text("d3\nd7\n")
    report = json.loads(
        _ok("delete", url, "--ids", tmp_path / "ids.txt", "--reason", "test", "--purge", "--json").stdout
    )
    assert report["rows_deleted"] == 2
    question = ["--text", "t1 t2 t3 t4", "-k", str(DOCUMENTS), "--direction", "both", "--json"]
    found = {i for side in _hits(_ok("query", url, *question)) for i, _ in side}
    assert found and not found & {"d3", "d7"}
    log = [json.loads(line) for line in (location.index_path(url) / "deletions.jsonl").read_text().splitlines()]
    assert sorted(entry["id"] for entry in log) == ["d3", "d7"]
    assert json.loads(_ok("info", url, "--json").stdout)["deletions"]["ids"] == 2
    again = json.loads(_ok("ingest", url, root / "shard.jsonl", "--id-field", "id", "--json").stdout)
    assert again["skipped_deleted"] == 2 and again["stored"] == 0
