"""Which example ids a table already holds: the one de-duplication rule of every ingest path.

An example whose id is stored from the same shard and position is already stored (a rerun);
the same id from another place is a duplicate id, which the caller reports; an absent example
that a takedown recorded (its id or content hash in ``deletions.jsonl``) is ``"deleted"``. Both
:meth:`AttributionIndex.ingest <eogp_index.client.AttributionIndex.ingest>` and
``ingest.run_ingest`` (and its distributed form) ask :class:`StoredIds`.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal, Optional, Sequence

import numpy as np

from eogp_index.data.records import location_of
from eogp_index.store.table import Store


def sql_string(value: str) -> str:
    """``value`` as a SQL string literal for Lance filters (single quotes doubled)."""
    return "'" + value.replace("'", "''") + "'"


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (unlike ``hash``, salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def _location_key(shard: str, position: int) -> int:
    return stable_hash(f"{shard}\0{position}")


class StoredIds:
    """The ids the table holds and where each came from, as 16 bytes per stored row.

    One scan of ``id, shard, position`` at the start of a run; lookups are binary searches.
    Keeping hashes rather than strings lets a run resume into a table of many millions of rows
    without holding them all as Python objects. A hash hit for another location is confirmed
    with a query before a record is called a duplicate, so a hash collision cannot reject a
    good record.
    """

    def __init__(self, store: Store, *, deleted=None):
        self._store = store
        #: what takedowns recorded (:class:`~eogp_index.store.deletions.DeletedSet`), or None
        self._deleted = deleted
        self._added: dict[str, tuple[str, int]] = {}
        ids: list[np.ndarray] = []
        locations: list[np.ndarray] = []
        if store.table is not None:
            scanner = store.dataset().to_batches(columns=["id", "shard", "position"])
            for batch in scanner:
                rows = zip(
                    batch.column("id").to_pylist(),
                    batch.column("shard").to_pylist(),
                    batch.column("position").to_pylist(),
                )
                pairs = [(stable_hash(i), _location_key(s, p)) for i, s, p in rows]
                if pairs:
                    array = np.asarray(pairs, dtype=np.int64)
                    ids.append(array[:, 0])
                    locations.append(array[:, 1])
        id_hashes = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        location_hashes = np.concatenate(locations) if locations else np.zeros(0, np.int64)
        order = np.argsort(id_hashes, kind="stable")
        self._ids = id_hashes[order]
        self._locations = location_hashes[order]

    def __len__(self) -> int:
        return len(self._ids) + len(self._added)

    def remember(self, examples: Sequence[Any]) -> None:
        """Count ``examples`` (just stored by this process) as stored, for later lookups."""
        for example in examples:
            self._added[example.id] = (example.shard, example.position)

    def lookup(self, example: Any) -> tuple[Literal["absent", "same", "other", "deleted"], Optional[str]]:
        """Whether ``example.id`` is stored: not at all, for this shard/position, or elsewhere;
        ``"deleted"``: not stored, and a takedown recorded its id or content hash.

        ``example`` has ``id``, ``shard`` and ``position`` (an :class:`Example`). Returns the
        status and, for ``"other"``, the stored row's location (``"a.jsonl:3"``).
        """
        added = self._added.get(example.id)
        if added is not None:
            return ("same", None) if added == (example.shard, example.position) else ("other", location_of(*added))
        key = stable_hash(example.id)
        lo = int(np.searchsorted(self._ids, key, side="left"))
        hi = int(np.searchsorted(self._ids, key, side="right"))
        if lo == hi:
            return self._absent(example)
        if _location_key(example.shard, example.position) in self._locations[lo:hi]:
            return "same", None
        rows = self._store.read(["shard", "position"], where=f"id = {sql_string(example.id)}").to_pylist()
        if not rows:
            return self._absent(example)  # a 64-bit hash collision with another id
        for row in rows:
            if (row["shard"], row["position"]) == (example.shard, example.position):
                return "same", None
        return "other", location_of(rows[0]["shard"], rows[0]["position"])

    def _absent(self, example: Any) -> tuple[Literal["absent", "deleted"], None]:
        return ("deleted" if self._deleted is not None and self._deleted.matches(example) else "absent"), None
