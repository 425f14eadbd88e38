"""Block ingest's cache: each module's ``P`` read once per block of documents, as the paper's
Appendix E does.

When the ``P`` matrices do not stay in memory (``--projection-memory-gb``), per-batch ingest
reads every module's ``P`` in every gradient batch. Block ingest
(:meth:`~eogp_index.encode.encoder.Encoder.encode_commit` with a :class:`BlockCache`) splits the
work instead:

1. the first stage of every gradient batch of the block runs on the model, and its coordinates
   (``{module: (B, m_u)}`` in FP16) are written to
   ``<index>/ingest-cache/batch-NNNNNN.safetensors`` by a background thread while the next batch
   runs;
2. then, module after module, ``P`` is read once and applied to the whole block's cached
   coordinates (:meth:`~eogp_index.fit.projection.ModuleProjection.second_groups`);
3. the block is encoded and stored in one commit, and the cache is removed.

The coordinates are those of per-batch ingest, bit for bit: the second stage rounds the first
stage to FP16 on every route, and is applied to the same row groups.

Resumable like the fit's cache (:mod:`eogp_index.fit.cache`): a kill leaves the table without any
of the block (it is one commit) and the block's cache, whose ``block.json`` records what the
block was (its examples' hash, the projection, the model, the batch size). The next run's first
block is the same documents when nothing else changed: it reuses every batch file found (each is
written under a temporary name and renamed, so a file present is complete) and computes the
rest. Any other block clears the cache first. Every document is stored once.

Each worker of a torchrun ingest keeps its own block in ``<index>/ingest-cache/rank-R/``; the
workers' blocks of a step are committed together, so each is committed whole or redone.

A remote index (:mod:`eogp_index.data.location`) keeps this cache on a local disk, in its local
cache folder.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from eogp_index.config import available_memory
from eogp_index.data.location import index_path, local_cache_dir
from eogp_index.data.records import Example
from eogp_index.fit.blocks import default_block_documents, free_disk_bytes, whole_batches
from eogp_index.fit.cache import atomic_write, examples_sha256
from eogp_index.store.stored_index import StoredIndex

CACHE_DIR = "ingest-cache"
BLOCK_RECORD = "block.json"
BLOCK_FORMAT_VERSION = 1


def block_documents(stored: StoredIndex, batch_size: int, asked: Optional[int], *, workers: int = 1) -> Optional[int]:
    """Documents per block (whole gradient batches of ``batch_size``), or None for per-batch
    ingest: when ``P`` stays in memory (nothing to amortize) or a block would be one batch.

    asked: ``IngestConfig.block_documents``; None sizes the block from the free disk and memory,
    split evenly between ``workers`` (torchrun workers each hold a block at once).
    """
    projection = stored.projection
    if not projection.in_turn:
        return None
    if asked is not None:
        documents = whole_batches(asked, batch_size)
    else:
        itemsize = projection.cache_dtype.itemsize
        documents = default_block_documents(
            projection.m,
            projection.tier_k,  # the coordinates each document's block holds: a wider tier's
            itemsize,
            batch_size,
            free_disk=free_disk_bytes(stored.cache_dir / CACHE_DIR) // workers,
            free_memory=available_memory() // workers,
        )
    return documents if documents > batch_size else None


class BlockCache:
    """``<index>/ingest-cache/`` (a torchrun worker's: ``rank-R/`` in it): one block's first-stage
    coordinates, a file per gradient batch, written by one background thread, and ``block.json``,
    what the block is.

    documents: the block's size (documents per commit).
    """

    def __init__(self, index_dir: Path, documents: int, *, worker: Optional[int] = None):
        # a remote index's block cache is on a local disk: its local cache folder (data.location)
        self.root = local_cache_dir(index_path(index_dir)) / CACHE_DIR
        self.dir = self.root if worker is None else self.root / f"rank-{worker}"
        self.documents = documents
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eogp-block-cache")
        self._pending: List[Future] = []

    def path(self, batch: int) -> Path:
        return self.dir / f"batch-{batch:06d}.safetensors"

    def begin(self, stored: StoredIndex, batch_size: int, block: Sequence[Example]) -> List[int]:
        """Start ``block`` (gradient batches of ``batch_size``): the batches a killed run already
        cached for this very block (reused), or none, the cache cleared and the new block recorded."""
        record = {
            "format": "eogp-ingest-block",
            "format_version": BLOCK_FORMAT_VERSION,
            "projection_sha256": stored.manifest.projection["sha256"],
            "weights_fingerprint": stored.manifest.model.get("weights_fingerprint"),
            "batch_size": batch_size,
            "documents": len(block),
            "examples_sha256": examples_sha256(block),
        }
        path = self.dir / BLOCK_RECORD
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):  # none, or not ours: start over
            found = None
        if found == record:
            return [i for i in range(-(-len(block) // batch_size)) if self.path(i).exists()]
        self.clear()
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(record)))
        return []

    def write(self, batch: int, coords: Dict[str, torch.Tensor]) -> None:
        """Queue one batch's ``{module: (B, m_u)}`` for writing; they leave the device now."""
        from safetensors.torch import save_file

        host = {name: z.detach().to("cpu").contiguous() for name, z in coords.items()}
        self._pending.append(self._writer.submit(atomic_write, self.path(batch), lambda tmp: save_file(host, str(tmp))))

    def wait(self) -> None:
        """Block until every queued batch is on disk (a failed write raises here)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def read(self, name: str, batches: int) -> List[torch.Tensor]:
        """Module ``name``'s coordinates of batches ``0..batches-1``: one ``(B, m_u)`` tensor each."""
        from safetensors import safe_open

        out = []
        for batch in range(batches):
            with safe_open(str(self.path(batch)), framework="pt") as handle:
                out.append(handle.get_tensor(name))
        return out

    def clear(self) -> None:
        """Remove this cache: a block just committed, or one a killed run left that is not the one
        starting."""
        self.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def clear_all(self) -> None:
        """Remove ``<index>/ingest-cache/`` whole, every worker's included: at the end of a run,
        when no worker writes any more (what an earlier run with more workers left goes too)."""
        self.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def close(self) -> None:
        """Stop the writer; what is cached stays (a block that failed is resumed by the next run)."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
