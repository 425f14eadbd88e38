"""The shipped model's index in object storage, served in shards: `eogp fit` and `eogp ingest`
write it to a bucket of moto's S3 server on loopback, `eogp build-candidates` adds its first pass
there, and `eogp serve --ray`'s app over 2 and 3 shard actors (a local Ray cluster of two
simulated nodes) answers every question as one process answers it over the same files copied to
a local disk: ids, ranks and scores to 1e-5, both sides, a filter, the rescoring tier,
`normalize unit`, an aggregate with its roll-up, and first-pass candidates."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from s3server import s3_server
from shardserver import Served, same_groups, same_hits, two_node_cluster

from eogp_index.cli import cli

pytestmark = [pytest.mark.cluster, pytest.mark.objectstore]
ray = pytest.importorskip("ray")

BUCKET = "eogp-shards"
SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "default"
#: Training documents stored: 4 commits of 8 (4 fragments, split among the shards).
DOCUMENTS = 32
#: The shipped model at small settings: 64 coordinates a module, 8 fitting documents, 64 tokens.
FIT = ["-k", "64", "--variant", "eogp", "--curvature-examples", "8", "--pca-examples", "8", "--max-tokens", "64"]


def _ok(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def _open(index):
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    return AttributionIndex.open(index, gradients=GradientConfig(batch_size=8, device="cpu"))


def _queries(n: int = 2):
    lines = (SHIPPED / "queries.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped model fitted, ingested and given a first pass at ``s3://BUCKET/shipped`` (moto's
    variables set before Ray starts, so that the workers inherit them); its files copied to a local
    directory; a Ray cluster of two nodes. Yields (local path, URL, Ray address)."""
    import pyarrow.fs as pafs

    from eogp_index.data import location

    root = tmp_path_factory.mktemp("shipped-s3")
    with gzip.open(SHIPPED / "corpus" / "train.jsonl.gz", "rt") as corpus:
        documents = [next(corpus) for _ in range(DOCUMENTS)]
    (root / "train.jsonl").write_text("".join(documents))
    with s3_server(BUCKET, root / "cache"):
        url = f"s3://{BUCKET}/shipped"
        _ok("fit", SHIPPED / "model", "--data", root / "train.jsonl", "--out", url, *FIT)
        metadata = ["--metadata", "kind", "--metadata", "module"]
        _ok("ingest", url, root / "train.jsonl", "--id-field", "id", *metadata, "--batch-size", "8")
        _ok("build-candidates", url)
        remote = location.index_path(url)
        pafs.copy_files(remote.fs_path, str(root / "local"), remote.filesystem, pafs.LocalFileSystem())
        with two_node_cluster() as cluster:
            yield root / "local", url, cluster.address


@pytest.fixture(scope="module")
def reference(shipped):
    """One local process over the same files."""
    return _open(shipped[0])


@pytest.fixture(scope="module", params=[2, 3])
def served(request, shipped, reference):
    _, url, address = shipped
    server = Served(url, request.param, address, _open, reference=reference, timeout_s=120.0)
    yield server
    server.close()


def test_the_bucket_holds_the_shipped_models_index_split_among_the_shards(served, reference):
    health = [served.alive(shard) for shard in range(len(served.pool))]
    assert sum(shard["rows"] for shard in health) == DOCUMENTS == reference.stored.store.count()
    assert all(shard["rows"] for shard in health)  # 4 fragments: every shard holds some
    assert reference.stored.manifest.format_version == 4  # with its int8 rescoring tier
    assert Path(reference.stored.manifest.model["name"]).resolve() == (SHIPPED / "model").resolve()


@pytest.mark.parametrize(
    "options",
    [
        {},  # both sides, rescored from the int8 tier (the index's default)
        {"rescore": 0},  # the one-bit ranking
        {"where": "kind = 'method'", "direction": "positive"},
        {"normalize": "unit", "direction": "negative", "rescore": 0},
        {"k": DOCUMENTS, "rescore": 0},  # every row: ties broken by table order across shards
    ],
    ids=["rescored", "one-bit", "filter", "normalize", "all-rows"],
)
def test_every_answer_is_one_local_process_answer(served, reference, options):
    options = {"k": 5, **options}
    for text in _queries():
        got = served.answer({"text": text, **options})["results"]
        question = reference.search(text).limit(options["k"]).where(options.get("where"))
        question = question.direction(options.get("direction", "both")).normalize(options.get("normalize", "none"))
        expected = question.rescore(options.get("rescore")).to_arrow().to_pylist()
        assert expected, "a query without hits compares nothing"
        same_hits(got, expected)


def test_a_behaviour_and_its_roll_up_are_one_local_process_answers(served, reference):
    texts = _queries(3)
    body = {"queries": [{"text": t} for t in texts], "aggregate": "mean", "k": 4, "group_by": "kind"}
    answer = served.answer(body)
    question = reference.search(texts, many=True).aggregate("mean").limit(4)
    same_hits(answer["results"], question.to_arrow().to_pylist())
    same_groups(answer["groups"], question.group_by("kind").to_arrow().to_pylist(), "kind")


def test_candidates_covering_a_shards_rows_are_the_exact_answer(served, reference):
    C = max(served.alive(shard)["rows"] for shard in range(len(served.pool)))
    assert 2 * 5 <= C < DOCUMENTS  # the rescored rows fit in C; one process would need every row
    for text in _queries():
        got = served.answer({"text": text, "k": 5, "candidates": C, "rescore": 2})["results"]
        same_hits(got, reference.search(text).limit(5).rescore(2).to_arrow().to_pylist())
