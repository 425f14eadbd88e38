"""An index in object storage served in shards: the index's files in a bucket of moto's S3
server on loopback, `eogp serve --ray`'s app over 2 shard actors on a local Ray cluster of two
simulated nodes; every answer equals one process's answer over the same files on a local disk."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
from s3server import s3_server
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

pytestmark = [pytest.mark.cluster, pytest.mark.objectstore]
ray = pytest.importorskip("ray")

BUCKET = "eogp-shards"
QUERY = [3, 9, 14, 2, 7, 11]


def _open(path):
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    return AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8, device="cpu")
    )


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    """A local index (int8 tier, 30 rows in 3 fragments) and its copy at ``s3://BUCKET/idx``,
    on moto's server (its variables set before Ray starts, so that the workers inherit them), and
    a Ray cluster of two nodes. Yields (local path, URL, Ray address)."""
    import pyarrow.fs as pafs
    from ray.cluster_utils import Cluster

    from eogp_index.client import AttributionIndex
    from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
    from eogp_index.data import location

    path = tmp_path_factory.mktemp("sharded-s3") / "index"
    examples = make_examples(30, seed=8)
    index = AttributionIndex.create(
        path,
        make_tiny_gpt2(),
        TinyTokenizer(),
        examples,
        model_name="tiny",
        projection=ProjectionConfig(variant="eogp", k=16, m=64),
        curvature=CurvatureConfig(num_examples=16, batch_size=8),
        gradients=GradientConfig(batch_size=8),
        progress=False,
    )
    for start in (0, 10, 20):
        index.add_batch(examples[start : start + 10])

    with s3_server(BUCKET, tmp_path_factory.mktemp("cache")):
        url = f"s3://{BUCKET}/idx"
        remote = location.index_path(url)
        pafs.copy_files(str(path), remote.fs_path, pafs.LocalFileSystem(), remote.filesystem)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False},
        )
        cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        try:
            yield path, url, cluster.address
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_an_index_in_a_bucket_served_on_two_shards_answers_as_one_local_process(indexes):
    import uvicorn

    from eogp_index.cluster.shards import ShardPool
    from eogp_index.serve.app import create_app
    from eogp_index.serve.config import ServeConfig

    path, url, address = indexes
    pool = ShardPool(url, 2, address=address, timeout_s=120.0)
    app = create_app(_open(url), ServeConfig(port=0, batch_window_ms=0, shard_timeout_s=120.0), pool)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300.0) as client:
            health = client.get("/healthz").json()
            assert sum(shard["rows"] for shard in health["shards"]) == 30
            reference = _open(path)
            for options in ({}, {"where": "`group` = 1", "direction": "positive"}, {"rescore": 0, "k": 30}):
                got = client.post("/v1/query", json={"input_ids": QUERY, "k": 5, **options})
                assert got.status_code == 200, got.text
                hits = got.json()["results"]
                question = reference.search({"input_ids": QUERY}).limit(options.get("k", 5))
                question = question.where(options.get("where")).direction(options.get("direction", "both"))
                expected = question.rescore(options.get("rescore")).to_arrow().to_pylist()
                assert [(h.get("direction"), h["id"]) for h in hits] == [
                    (e.get("direction"), e["id"]) for e in expected
                ]
                np.testing.assert_allclose([h["score"] for h in hits], [e["score"] for e in expected], rtol=1e-5)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        pool.close()
