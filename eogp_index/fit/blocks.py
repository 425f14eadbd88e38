"""Blocks of documents over which each module's ``P`` is read once: their size and what they cost.

When the ``P`` matrices do not stay in memory (``GradientConfig.projection_memory_gb``), reading
them is the price of projecting: every module's ``P`` is read whenever it is applied. Applied in
the backward hook, that is once per gradient batch (``Σ_u 2·m_u·k_u / B`` bytes per document).
Block ingest (:mod:`eogp_index.store.block_cache`) follows the paper's Appendix E instead: the first-stage
coordinates of a block of documents are cached on disk (``Σ_u m_u`` values per document, in
FP16), then each module's ``P`` is read once and applied to the whole block. The block
trades cache disk (``block × Σ_u 2·m_u`` bytes) for ``P`` reads (``Σ_u 2·m_u·k_u / block`` per
document); :func:`default_block_documents` sizes it from the free disk and memory, and
:func:`p_reads` gives both sides for ``eogp plan``.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from eogp_index.config import MAX_BLOCK_DOCUMENTS

#: Bytes per cached first-stage coordinate (FP16: ``fit.projection.FIRST_STAGE_DTYPE``).
FIRST_STAGE_ITEMSIZE = 2
#: Shares of the free disk and of the available memory a default block may take.
DISK_SHARE = 0.5
MEMORY_SHARE = 0.25


def cache_bytes_per_document(ms: Sequence[int], cache_itemsize: int) -> int:
    """Disk the block cache takes per document: every module's ``m_u`` first-stage coordinates."""
    return cache_itemsize * sum(ms)


def block_memory_per_document(ms: Sequence[int], ks: Sequence[int], cache_itemsize: int) -> int:
    """Memory a block holds per document while ``P`` is applied: the module's cached coordinates
    read back (``m_u`` at the cache's dtype, the widest module) and the block's final coordinates
    (``Σ_u k_u`` float32, kept until the block is encoded)."""
    return cache_itemsize * max(ms) + 4 * sum(ks)


def default_block_documents(
    ms: Sequence[int], ks: Sequence[int], cache_itemsize: int, batch_size: int, *, free_disk: int, free_memory: int
) -> int:
    """Documents per block, in whole gradient batches: at most :data:`MAX_BLOCK_DOCUMENTS`, and no
    more than :data:`DISK_SHARE` of ``free_disk`` of cache or :data:`MEMORY_SHARE` of
    ``free_memory`` while applying ``P``. At least one batch (then ingest reads ``P`` per batch)."""
    by_disk = int(DISK_SHARE * free_disk) // max(1, cache_bytes_per_document(ms, cache_itemsize))
    by_memory = int(MEMORY_SHARE * free_memory) // max(1, block_memory_per_document(ms, ks, cache_itemsize))
    documents = min(MAX_BLOCK_DOCUMENTS, by_disk, by_memory)
    return max(batch_size, documents // batch_size * batch_size)


def whole_batches(documents: int, batch_size: int) -> int:
    """``documents`` rounded up to whole gradient batches."""
    return -(-documents // batch_size) * batch_size


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


@dataclass(frozen=True)
class PerDocument:
    """Bytes of ``P`` read per ingested document: resident (read once for every document), in
    turn per gradient batch, and in turn per block."""

    resident: float
    per_batch: float
    block: float


@dataclass(frozen=True)
class PReads:
    """``P`` read per document in each way of applying it, against the block cache's disk and
    memory (:func:`p_reads`); :meth:`to_json` is ``eogp plan --json``'s ``p_reads``."""

    p_total_bytes: int
    documents: int
    batch_size: int
    block_documents: int
    per_document: PerDocument
    cache_bytes_per_document: int
    cache_bytes: int
    block_memory_bytes: int

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def p_reads(
    ms: Sequence[int],
    ks: Sequence[int],
    p_total: int,
    *,
    batch_size: int,
    documents: int,
    block_documents: Optional[int] = None,
) -> PReads:
    """``P`` read per document in each way of applying it, and the block cache's disk, for
    modules of widths ``ms`` and ``ks`` whose ``P`` take ``p_total`` bytes in all (none: no P),
    ingested ``batch_size`` documents per gradient batch: resident (read once for all
    ``documents``), in turn per batch, and in turn per block of ``block_documents`` (rounded up
    to whole batches; default :data:`MAX_BLOCK_DOCUMENTS`), with the block's cache on disk and
    its memory while each ``P`` is applied. :meth:`Plan.p_reads <eogp_index.fit.plan.Plan.p_reads>`
    gives a plan's.
    """
    block = whole_batches(block_documents or MAX_BLOCK_DOCUMENTS, batch_size)
    per_doc_cache = cache_bytes_per_document(ms, FIRST_STAGE_ITEMSIZE) if p_total else 0
    return PReads(
        p_total_bytes=p_total,
        documents=documents,
        batch_size=batch_size,
        block_documents=block,
        per_document=PerDocument(
            resident=p_total / documents if documents else p_total,
            per_batch=p_total / batch_size,
            block=p_total / block,
        ),
        cache_bytes_per_document=per_doc_cache,
        cache_bytes=per_doc_cache * block,
        block_memory_bytes=block * block_memory_per_document(ms, ks, FIRST_STAGE_ITEMSIZE) if p_total else 0,
    )
