"""Joining Ray, and the table's fragments split into disjoint shards."""

from __future__ import annotations

import socket
from typing import List, Optional, Sequence, Tuple

from ..errors import ConfigError


def require_ray():
    """The ``ray`` module, or a ConfigError naming the extra that installs it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            "--ray needs Ray, which is not installed: pip install 'eogp-index[cluster]' (make install does)"
        ) from exc
    return ray


#: How long a ``host:port`` address may take to accept a TCP connection before it is called
#: unreachable: Ray itself retries an unreachable address for minutes.
CONNECT_TIMEOUT_S = 5.0


def connect(address: Optional[str] = None, *, num_cpus: Optional[int] = None):
    """Joins the Ray cluster at ``address`` ("auto", "ray://host:port", "host:port"), or starts a
    local one when ``address`` is None or empty; a process already connected keeps its connection.

    Returns the ``ray`` module.

    Raises:
        ConfigError: an address that is not one, or a ``host:port`` that does not accept a TCP
            connection within :data:`CONNECT_TIMEOUT_S` (refused at once, before Ray retries it).
    """
    address = address or None
    if address and address != "auto":
        _check_reachable(address)
    ray = require_ray()
    if ray.is_initialized():
        return ray
    try:
        if address:
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        else:
            # A local Ray for one machine: no dashboard, the object store sized by Ray.
            ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    except ConnectionError as exc:
        raise ConfigError(
            f"could not join the Ray cluster at {address!r} ({exc}): start it with `ray start --head` "
            "on the head node, or leave out the address to start a local Ray"
        ) from exc
    return ray


def _check_reachable(address: str) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"--ray {address!r} is not a Ray address: give host:port of the head node (the GCS port "
            "`ray start --head` prints, 6379 by default), ray://host:port, auto, or nothing to start a local Ray"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConfigError(
            f"could not reach the Ray cluster at {address!r} ({exc}): start it with `ray start --head` on the "
            "head node and give the address it prints, or leave out the address to start a local Ray"
        ) from exc


def fragment_shards(fragments: Sequence[Tuple[int, int]], shards: int) -> List[List[int]]:
    """Splits a table version's fragments into ``shards`` disjoint sets, balanced by rows.

    ``fragments``: (fragment id, row count) pairs. Returns ``shards`` lists of fragment ids, each
    sorted; every fragment is in exactly one. Deterministic: the largest fragment goes to the
    lightest shard, ties to the lower shard and the lower fragment id, so every process that sees
    the same table version computes the same split. Shards can be empty when there are fewer
    fragments than shards.
    """
    if shards < 1:
        raise ConfigError(f"--shards must be at least 1, got {shards}")
    loads = [0] * shards
    owned: List[List[int]] = [[] for _ in range(shards)]
    for fragment_id, rows in sorted(fragments, key=lambda f: (-f[1], f[0])):
        lightest = min(range(shards), key=lambda s: (loads[s], s))
        owned[lightest].append(fragment_id)
        loads[lightest] += rows
    return [sorted(ids) for ids in owned]
