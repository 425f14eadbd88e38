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


def p_reads(plan: Dict[str, Any], *, block_documents: Optional[int] = None) -> Dict[str, Any]:
    """``P`` read per document in each way of applying it, and the block cache's disk, for a plan
    of :func:`~eogp_index.fit.plan.make_plan` (JSON-able).

    ``block_documents`` defaults to the plan's block (``memory.ingest_block``: sized from its
    memory budget as an ingest sizes its own, at most :data:`MAX_BLOCK_DOCUMENTS`). Keys:
    ``p_total_bytes``; ``per_document`` bytes of ``P`` read per ingested document when resident
    (read once, over the plan's ``--documents``), in turn per gradient batch, and in turn per
    block; ``cache_bytes_per_document`` and ``cache_bytes`` (the block's cache on disk);
    ``block_documents``; ``batch_size``.
    """
    rows = plan["modules"]
    p_total = sum(r["pca_bytes"] for r in rows)
    batch = int(plan["options"]["batch_size"])
    itemsize = FIRST_STAGE_ITEMSIZE
    planned = plan.get("memory", {}).get("ingest_block", {}).get("block_documents")
    block = whole_batches(block_documents or planned or MAX_BLOCK_DOCUMENTS, batch)
    per_doc_cache = cache_bytes_per_document([r["m"] for r in rows], itemsize) if p_total else 0
    documents = int(plan["store"]["documents"])
    return {
        "p_total_bytes": p_total,
        "documents": documents,
        "batch_size": batch,
        "block_documents": block,
        "per_document": {
            "resident": p_total / documents if documents else p_total,
            "per_batch": p_total / batch,
            "block": p_total / block,
        },
        "cache_bytes_per_document": per_doc_cache,
        "cache_bytes": per_doc_cache * block,
        "block_memory_bytes": block
        * block_memory_per_document([r["m"] for r in rows], [r["k"] for r in rows], itemsize)
        if p_total
        else 0,
    }
