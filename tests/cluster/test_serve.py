"""`eogp serve --ray`: the real app on loopback over shard actors on a local Ray cluster of
simulated nodes, answering exactly what one process answers; faults and new table versions.

The index: the tiny GPT-2 with the default rescoring tier (int8), its rows ingested in several
commits (several fragments), and a first pass (``flat``) for the candidates route. The reference: the same index opened by this process, queried
through the library (one process, its own hot copy).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from shardserver import Served, same_groups, same_hits, two_node_cluster
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2, tiny_index

from eogp_index.search import first_pass

pytestmark = pytest.mark.cluster
ray = pytest.importorskip("ray")

#: Queries: token ids of the tiny model's vocabulary.
QUERIES = [[3, 9, 14, 2, 7, 11], [5, 5, 21, 8, 1, 30, 2]]
FILTER = "`group` = 1"


def _open(path):
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    return AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8, device="cpu")
    )


@pytest.fixture(scope="module")
def index_path(tmp_path_factory):
    """A real index with an int8 rescoring tier, 40 rows in 5 fragments."""
    path = tmp_path_factory.mktemp("cluster") / "index"
    index = tiny_index(path, make_examples(40, seed=5), (0, 12, 20, 28, 33))
    first_pass.build(index, progress=False)  # the candidates route's first pass ("default", flat)
    return path


@pytest.fixture(scope="module")
def ray_cluster():
    """Two simulated nodes of one CPU each on loopback (three shards share them)."""
    with two_node_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module", params=[2, 3])
def served(request, index_path, ray_cluster):
    server = Served(index_path, request.param, ray_cluster.address, _open)
    yield server
    server.close()


def _expected(reference, ids, *, k=5, where=None, direction="both", normalize="none", rescore=None):
    question = reference.search({"input_ids": ids}).limit(k).where(where).direction(direction).normalize(normalize)
    return question.rescore(rescore).to_arrow().to_pylist()


@pytest.mark.parametrize(
    "options",
    [
        {},  # both sides, rescored from the int8 tier (the index's default)
        {"rescore": 0},  # the one-bit ranking
        {"where": FILTER, "direction": "positive"},
        {"where": "regexp_match(name, 'doc1.')", "rescore": 0},  # a filter only Lance plans
        {"normalize": "unit", "direction": "negative"},
        {"k": 40, "rescore": 0},  # every row: ties broken by table order across shards
    ],
    ids=["rescored", "one-bit", "filter", "lance-filter", "normalize", "all-rows"],
)
def test_every_answer_is_one_process_answer(served, options):
    options = {"k": 5, **options}
    for ids in QUERIES:
        response = served.query(ids, **options)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["shards"]["answered"] == list(range(len(served.pool))) and not body["shards"]["missing"]
        expected = _expected(served.reference, ids, **options)
        assert expected, "a query without hits compares nothing"
        same_hits(body["results"], expected)


def test_a_behaviour_and_a_roll_up_are_one_process_answers(served):
    body = {"queries": [{"input_ids": q} for q in QUERIES], "aggregate": "mean", "k": 4, "group_by": "group"}
    response = served.client.post("/v1/query", json=body)
    assert response.status_code == 200, response.text
    question = served.reference.search([{"input_ids": q} for q in QUERIES], many=True).aggregate("mean").limit(4)
    same_hits(response.json()["results"], question.to_arrow().to_pylist())
    same_groups(response.json()["groups"], question.group_by("group").to_arrow().to_pylist(), "group", rtol=1e-7)


def test_healthz_lists_every_shard_with_its_fragments(served):
    health = served.client.get("/healthz").json()
    shards = health["shards"]
    assert [s["shard"] for s in shards] == list(range(len(served.pool))) and all(s["alive"] for s in shards)
    fragments = sorted(f for s in shards for f in s["fragments"])
    table = served.reference.stored.store.dataset()
    assert fragments == sorted(f.fragment_id for f in table.get_fragments())
    assert sum(s["rows"] for s in shards) == served.reference.stored.store.count()
    assert {s["version"] for s in shards} == {served.reference.stored.store.version}
    assert len({s["node"] for s in shards}) == 2  # spread over both nodes


def _candidates(served, ids, C: int, **options):
    response = served.query(ids, candidates=C, **options)
    assert response.status_code == 200, response.text
    assert response.json()["shards"]["missing"] == []
    return response.json()["results"]


@pytest.mark.parametrize(
    "options",
    [
        {"rescore": 0},  # both sides, the one-bit ranking
        {"where": FILTER, "direction": "negative", "rescore": 0},
        {"k": 3, "rescore": 2},  # the merged candidates rescored from the int8 tier
    ],
    ids=["one-bit", "filter", "rescored"],
)
def test_candidates_of_at_least_a_shards_rows_are_the_exact_answer(served, options):
    options = {"k": 5, **options}
    C = max(served.alive(shard)["rows"] for shard in range(len(served.pool)))
    assert C < served.reference.stored.store.count()  # fewer than one process needs for every row
    for ids in QUERIES:
        expected = _expected(served.reference, ids, **options)
        assert expected, "a query without hits compares nothing"
        same_hits(_candidates(served, ids, C, **options), expected)
    # Each shard built its first pass over its own rows, of the saved one's kind.
    for shard in served.client.get("/healthz").json()["shards"]:
        assert shard["first_passes"] == {"default": shard["rows"]}


def test_few_candidates_are_rows_of_the_exact_scan_with_their_exact_scores(served):
    for ids in QUERIES:
        every_id, every_score = served.reference.scores([{"input_ids": ids}])
        exact = dict(zip(every_id, every_score[0].tolist()))
        hits = _candidates(served, ids, 4, k=3, rescore=0)
        assert hits and len(hits) <= 6
        for side in ("positive", "negative"):
            found = [h for h in hits if h["direction"] == side]
            assert [h["rank"] for h in found] == list(range(1, len(found) + 1))
            assert all((h["score"] > 0) == (side == "positive") for h in found)
            ordered = sorted(found, key=lambda h: -h["score"] if side == "positive" else h["score"])
            assert [h["id"] for h in found] == [h["id"] for h in ordered]
        np.testing.assert_allclose([h["score"] for h in hits], [exact[h["id"]] for h in hits], rtol=1e-5)


def test_candidates_of_a_first_pass_the_index_lacks_are_refused_naming_it(served):
    response = served.query(QUERIES[0], k=3, candidates=5, first_pass="absent")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        error["field"] == "first_pass" and "eogp build-candidates" in error["message"] and "absent" in error["message"]
    )


@pytest.mark.parametrize("served", [3], indirect=True)
def test_a_shard_killed_during_a_query_is_restarted_and_the_query_answers(served):
    actor = served.pool.actors[1]
    pid = served.alive(1)["pid"]
    killer = threading.Timer(0.05, lambda: ray.kill(actor, no_restart=False))
    killer.start()
    response = served.query(QUERIES[0], k=5, rescore=0)
    killer.join()
    assert response.status_code == 200, response.text
    same_hits(response.json()["results"], _expected(served.reference, QUERIES[0], rescore=0))
    # Killed after the answer: the next query finds it restarting, asks again, and is answered in full.
    ray.kill(actor, no_restart=False)
    response = served.query(QUERIES[1], k=5)
    assert response.status_code == 200, response.text
    assert response.json()["shards"]["missing"] == []
    same_hits(response.json()["results"], _expected(served.reference, QUERIES[1]))
    shard = served.alive(1)
    assert shard["pid"] != pid and shard["rows"] > 0  # a new process, its copy rebuilt


def test_shards_without_ray_is_refused_before_the_model_loads(index_path):
    from click.testing import CliRunner

    from eogp_index.cli import cli

    result = CliRunner().invoke(cli, ["serve", str(index_path), "--shards", "2"])
    assert result.exit_code == 2 and "--shards goes with --ray" in result.output


@pytest.mark.parametrize("served", [3], indirect=True)
def test_a_shard_gone_for_good_is_missing_allowed_or_named_then_replaced(served):
    ray.kill(served.pool.actors[2], no_restart=True)
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(served.pool.actors[2].info.remote())
    health = served.client.get("/healthz").json()
    assert health["status"] == "degraded" and not health["shards"][2]["alive"] and health["shards"][1]["alive"]
    response = served.query(QUERIES[0], k=5, rescore=0, allow_partial=True)
    assert response.status_code == 200, response.text
    report = response.json()["shards"]
    assert report["answered"] == [0, 1] and [m["shard"] for m in report["missing"]] == [2]
    # The partial answer is one process's answer over the shards that answered.
    kept = set(served.pool.assignments[0][1]) | set(served.pool.assignments[1][1])
    rows = served.reference.stored.store.read(["id"], None, with_row_address=True).to_pylist()
    ids = {r["id"] for r in rows if int(r["_rowaddr"]) >> 32 in kept}
    answered = {r["id"] for r in response.json()["results"]}
    assert answered and answered <= ids
    # Its replacement is killed for good too: without allow_partial the query is refused, naming it.
    pid = served.alive(2)["pid"]
    ray.kill(served.pool.actors[2], no_restart=True)
    response = served.query(QUERIES[0], k=5)
    assert response.status_code == 503, response.text
    assert "shard 2 of 3" in response.json()["error"]["message"]
    # Replaced again: the next query is answered in full by a new process.
    response = served.query(QUERIES[0], k=5, rescore=0)
    assert response.status_code == 200 and response.json()["shards"]["missing"] == [], response.text
    same_hits(response.json()["results"], _expected(served.reference, QUERIES[0], rescore=0))
    assert served.alive(2)["pid"] != pid


@pytest.mark.parametrize("served", [3], indirect=True)
def test_a_slow_shard_hits_the_shard_timeout_which_the_error_reports(served):
    timeout = served.pool.timeout_s
    served.pool.timeout_s = 1e-4
    try:
        response = served.query(QUERIES[0], k=3, rescore=0)
    finally:
        served.pool.timeout_s = timeout
    assert response.status_code == 503, response.text
    assert "shard timeout of 0.0001 s (--shard-timeout)" in response.json()["error"]["message"]


@pytest.mark.parametrize("served", [3], indirect=True)
def test_an_ingest_while_serving_is_taken_up_on_the_next_query(served, index_path):
    writer = _open(index_path)
    before = served.reference.stored.store.version
    writer.add_batch(make_examples(6, seed=9, prefix="new"))
    writer.stored.store.dataset().delete("id = 'ex-3'")
    response = served.query(QUERIES[0], k=40, rescore=0)
    assert response.status_code == 200, response.text
    served.reference.stored.store.refresh(force=True)
    assert served.reference.stored.store.version > before
    ids = {r["id"] for r in response.json()["results"]}
    assert "ex-3" not in ids and any(i.startswith("new-") for i in ids)
    same_hits(response.json()["results"], _expected(served.reference, QUERIES[0], k=40, rescore=0))
    assert sum(s["rows"] for s in served.client.get("/healthz").json()["shards"]) == 45
    # Each shard's first pass is rebuilt over its new rows: the new ones found, the deleted one never.
    hits = _candidates(served, QUERIES[0], 45, k=40, rescore=0)
    assert "ex-3" not in {h["id"] for h in hits}
    same_hits(hits, _expected(served.reference, QUERIES[0], k=40, rescore=0))
    for shard in served.client.get("/healthz").json()["shards"]:
        assert shard["first_passes"] == {"default": shard["rows"]}


def test_serve_ray_without_shards_starts_one_shard_per_node(index_path, ray_cluster):
    from eogp_index.cli import _shard_pool

    pool = _shard_pool(index_path, ray_cluster.address, None, 30.0)
    try:
        assert len(pool) == 2 and pool.timeout_s == 30.0
    finally:
        pool.close()
