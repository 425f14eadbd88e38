"""`eogp serve --ray`'s app on loopback for the cluster tests, on a simulated two-node Ray
cluster, and the comparisons of its answers with one process's: the same ids, ranks, sides and
groups, scores to 1e-5 relative."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import httpx
import numpy as np


@contextlib.contextmanager
def two_node_cluster() -> Iterator[Any]:
    """Two simulated Ray nodes of one CPU each on loopback, this process connected to them (three
    shards share them); shut down at the end."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class Served:
    """The app over ``shards`` shard actors of ``index`` (a path or a URL), run by uvicorn on
    loopback; ``open_index`` opens an index with its model (the ingress's, and by default the
    ``reference``: the same index answered by this process)."""

    def __init__(
        self,
        index,
        shards: int,
        address: str,
        open_index: Callable[[Any], Any],
        *,
        reference: Optional[Any] = None,
        timeout_s: float = 60.0,
    ):
        import uvicorn

        from eogp_index.cluster.shards import ShardPool
        from eogp_index.serve.app import create_app
        from eogp_index.serve.config import ServeConfig

        self.pool = ShardPool(str(index), shards, address=address, timeout_s=timeout_s)
        config = ServeConfig(port=0, batch_window_ms=0, shard_timeout_s=timeout_s)
        self.app = create_app(open_index(index), config, self.pool)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300.0)
        self.reference = open_index(index) if reference is None else reference

    def query(self, ids, **options):
        """``/v1/query`` for token ids ``ids``."""
        return self.client.post("/v1/query", json={"input_ids": ids, **options})

    def answer(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """``/v1/query``'s answer to ``body``, checked to be a full one (every shard answered)."""
        response = self.client.post("/v1/query", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["shards"]["answered"] == list(range(len(self.pool))) and not answer["shards"]["missing"]
        return answer

    def alive(self, shard: int, timeout_s: float = 120.0) -> dict:
        """Shard ``shard``'s /healthz entry once it answers: a replacement actor starts (and builds
        its copy) in the background, and on busy cores that outlasts /healthz's own short wait."""
        deadline = time.monotonic() + timeout_s
        while True:
            entry = self.client.get("/healthz").json()["shards"][shard]
            if entry["alive"] or time.monotonic() > deadline:
                assert entry["alive"], entry
                return entry
            time.sleep(0.2)

    def close(self):
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.pool.close()


def same_hits(got: List[dict], expected: List[dict]) -> None:
    """The same hits in the same order (side, rank, id), their scores (and one-bit scores) to 1e-5."""
    assert [(r.get("direction"), r["rank"], r["id"]) for r in got] == [
        (r.get("direction"), r["rank"], r["id"]) for r in expected
    ]
    np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in expected], rtol=1e-5, atol=0)
    if expected and "score_1bit" in expected[0]:
        np.testing.assert_allclose([r["score_1bit"] for r in got], [r["score_1bit"] for r in expected], rtol=1e-5)


def same_groups(got: List[dict], expected: List[dict], column: str, rtol: float = 1e-5) -> None:
    """The same groups (of ``column``) in the same order, their counts equal and their sums, means
    and maxima to ``rtol``."""
    assert expected, "a roll-up without groups compares nothing"
    assert [g[column] for g in got] == [g[column] for g in expected]
    for have, want in zip(got, expected):
        counts = ("rows", "top_positive", "top_negative")
        assert {n: have[n] for n in counts} == {n: want[n] for n in counts}
        values = ("sum", "mean", "max")
        np.testing.assert_allclose([have[n] for n in values], [want[n] for n in values], rtol=rtol)
