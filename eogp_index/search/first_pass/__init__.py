"""First passes: at millions of rows, a few candidates per query side are scored exactly instead of every row.

One interface (:class:`~eogp_index.search.first_pass.base.FirstPass`), one class per kind, each
with its own frozen configuration, registered once under its name:

==========  =======================  ===============================================================
``flat``    :class:`FlatFirstPass`   FAISS RaBitQ fast scan of the decoded codes, by inner product
==========  =======================  ===============================================================

The kinds ``ivf``, ``hnsw`` and ``clustered`` are retired (``base.RETIRED_KINDS``): their files
are refused with the command that rebuilds them as ``flat``.

Built with ``eogp build-candidates --kind`` (or :func:`build`), used by ``query.candidates(C)``
(:func:`candidate_top_k`). Every answer carries exact scores; what a first pass can miss is
rows it never scores. Adding a kind: subclass ``FirstPass`` with ``kind="name"`` and a
``Config``, import its module here; the CLI, the query path and the contract test
(tests/search/test_first_pass_contract.py) take it from the registry.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from eogp_index.errors import ConfigError
from eogp_index.search.first_pass.base import (
    DEFAULT_KIND,
    RETIRED_KINDS,
    FirstPass,
    FirstPassConfig,
    SideAnswer,
    class_for,
    kind_class,
    kinds,
    make_config,
    require_signs,
)
from eogp_index.search.first_pass.faiss_flat import FlatConfig, FlatFirstPass

__all__ = [
    "FirstPass",
    "FirstPassConfig",
    "FlatFirstPass",
    "FlatConfig",
    "DEFAULT_KIND",
    "RETIRED_KINDS",
    "kinds",
    "kind_class",
    "class_for",
    "make_config",
    "build",
    "load",
    "open_first_pass",
    "clear_cache",
    "candidate_top_k",
]

load = FirstPass.load


def build(index, name: str = "default", config: FirstPassConfig = FlatConfig(), *, progress: bool = True) -> FirstPass:
    """Build (or replace) first pass ``name`` of ``index``, of the kind ``config`` configures.

    Args:
        index: a :class:`~eogp_index.store.stored_index.StoredIndex` (or an opened index) with
            ``precision="1bit"``.
        name: saved as ``<index>/faiss/<name>.*``.
        config: a kind's configuration (:class:`FlatConfig`).

    Raises:
        IncompatibleIndexError: the index stores coordinates, not signs.
        InputError: no rows stored yet, or an example id stored twice.
        ConfigError: ``config`` is no kind's configuration.
    """
    return class_for(config).build(getattr(index, "stored", index), name, config, progress=progress)


_CACHE: Dict[Tuple[str, str], Tuple[Tuple[int, int], FirstPass]] = {}
_CACHE_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget the first passes :func:`open_first_pass` keeps loaded (they hold codes in memory)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _stamp(path: Path) -> Optional[Tuple[int, int]]:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_mtime_ns, stat.st_size


def open_first_pass(index, name: str = "default", *, refresh: bool = True) -> FirstPass:
    """First pass ``name`` of ``index``, checked compatible and covering every stored row.

    Loaded once per process and reused while its JSON is unchanged. With ``refresh`` and a table
    newer than the recorded version, :meth:`FirstPass.refresh` brings it up to date (and saves).
    """
    stored = getattr(index, "stored", index)
    meta_path = FirstPass.paths(stored.path, name)["meta"]
    key = (str(stored.path.resolve()), name)  # (a Path, or an object-store RemotePath)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        stamp = _stamp(meta_path)
        if cached is None or stamp is None or cached[0] != stamp:
            first_pass = load(stored.path, name)
            _CACHE[key] = (_stamp(meta_path), first_pass)
        first_pass = _CACHE[key][1]
    first_pass.check_compatible(stored)
    # The table's latest version: another process may have ingested (Store.version looks cheaply).
    if refresh and stored.store.version not in (0, first_pass.table_version):
        first_pass = first_pass.refresh(stored)
        with _CACHE_LOCK:
            _CACHE[key] = (_stamp(meta_path), first_pass)
    return first_pass


def candidate_top_k(
    stored, y: np.ndarray, k: int, C: int, sides: Sequence[str], *, where: Optional[str] = None, name: str = "default"
) -> Dict[str, SideAnswer]:
    """One query's candidates per side from first pass ``name``, scored exactly (:meth:`FirstPass.top_k`).

    Args:
        stored: a :class:`~eogp_index.store.stored_index.StoredIndex` (or an ``AttributionIndex``).
        y: ``(1, K)`` float32. k: rows wanted per side. C: the first pass's budget per side.

    Returns:
        ``{side: (rowaddr (r,) uint64, exact scores (r,) float32, rows scored)}``; the ranking
        picks the best ``k``.

    Raises:
        IncompatibleIndexError: not a 1-bit index, or the first pass was built from other codes.
        IndexNotFoundError: no first pass ``name`` (build it first).
        ConfigError: ``C < k``.
    """
    if C < k:
        raise ConfigError(f"candidates C={C} must be at least k={k}")
    stored = getattr(stored, "stored", stored)
    require_signs(stored)
    return open_first_pass(stored, name).top_k(stored, y, k, C, sides, where=where)
