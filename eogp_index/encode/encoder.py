"""The encoder: a stored index with its model, turning examples into projected coordinates and
Arrow rows, and queries into coordinates.

:class:`Encoder` holds what :mod:`eogp_index.search` and the writers (:mod:`eogp_index.encode.commits`)
need from an opened index, and nothing of the facade: the
:class:`~eogp_index.store.stored_index.StoredIndex`, the model and tokenizer, the
:class:`~eogp_index.config.GradientConfig` and the device.
:class:`~eogp_index.client.AttributionIndex` owns one (``index.encoder``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from eogp_index.config import GradientConfig, IngestConfig
from eogp_index.data.records import Example, RecordSpec, check_record, location_of, query_record, tokenize_record
from eogp_index.encode.measurements import Measured, measure, measured, tokenize_queries
from eogp_index.errors import InputError
from eogp_index.gradients.capture import GradientCapture, batches, project_examples, run_batches
from eogp_index.gradients.model import pad_token_id
from eogp_index.store.block_cache import BlockCache, block_documents
from eogp_index.store.codecs import concat_modules
from eogp_index.store.manifest import prefixed
from eogp_index.store.stored_index import StoredIndex
from eogp_index.store.table import RowInfo, build_rows


class Encoder:
    """An opened index's stored parts with its model: examples → coordinates ``(n, K)`` → rows.

    Attributes:
        stored: the index on disk. model, tokenizer: the model the index was built with (frozen,
            on ``device``). gradients: batch size, checkpointing and dtype of the gradient passes.
        device: where the gradient passes run (``gradients.resolved_device()``).
    """

    def __init__(
        self,
        stored: StoredIndex,
        model: nn.Module,
        tokenizer,
        gradients: GradientConfig,
        checkpoint_models: Sequence[nn.Module] = (),
    ):
        self.stored = stored
        self.model = model
        self.tokenizer = tokenizer
        self.gradients = gradients
        self.device = gradients.resolved_device()
        #: an ensemble's models of checkpoints 1, 2, ... (``manifest.checkpoints``); ``model`` is
        #: checkpoint 0's. Empty for one checkpoint.
        self.checkpoint_models = list(checkpoint_models)

    path = property(lambda self: self.stored.path)
    manifest = property(lambda self: self.stored.manifest)
    store = property(lambda self: self.stored.store)
    layout = property(lambda self: self.stored.layout)
    codec = property(lambda self: self.stored.codec)

    @property
    def projection(self):
        """The projection, modules named as in :attr:`manifest` (an ensemble's: every checkpoint's,
        checkpoint ``j >= 1``'s named ``c<j>/<module>``)."""
        if self.manifest.checkpoints is None:
            return self.stored.projection
        return CombinedProjection(
            {
                prefixed(name, j): module
                for j in range(self.manifest.num_checkpoints)
                for name, module in self.stored.checkpoint_projection(j).modules.items()
            }
        )

    @property
    def models(self) -> List[nn.Module]:
        """Every checkpoint's model, in order (one for an index of one checkpoint)."""
        return [self.model, *self.checkpoint_models]

    # -- gradients --------------------------------------------------------------------------------
    def project(self, examples: Sequence[Example], *, progress: bool = False) -> np.ndarray:
        """Unquantized projected coordinates ``(n, T)`` float32, modules concatenated in order:
        the index's coordinates (``stored.coordinates``), ``T = K`` unless its rescoring tier is
        wider (``--rescore-k``), whose first ``k_u`` per module the one-bit code keeps
        (``stored.one_bit``). An ensemble's are every checkpoint's coordinates, each by its own
        model and projection, joined in checkpoint order (unweighted)."""
        if not examples:
            return np.zeros((0, self.stored.coordinates.num_coords), np.float32)
        parts = []
        for j, model in enumerate(self.models):
            projection = self.stored.checkpoint_projection(j)
            parts.extend(self.project_with(model, projection, examples, progress=progress))
        return concat_modules(parts)

    def project_with(self, model, projection, examples: Sequence[Example], *, progress: bool) -> List[np.ndarray]:
        """The coordinates of ``examples`` by one checkpoint's ``model`` and ``projection``:
        ``(n, t_u)`` per module, in module order."""
        names = projection.names
        if projection.in_turn:
            # P does not stay in memory: the first stage of every batch, then each module's P read
            # once for all of them (the paper's batched queries), not once per batch.
            groups = self._first_stage_groups(model, projection, examples, progress=progress)
            return [torch.cat(projection.modules[name].second_groups(groups.pop(name))).cpu().numpy() for name in names]
        capture = GradientCapture(model, names, projection.transform, checkpoint=self.gradients.gradient_checkpointing)
        out = project_examples(capture, examples, **self._batching(progress))
        return [out[name].numpy() for name in names]

    def first_stage_groups(
        self, examples: Sequence[Example], *, progress: bool = False
    ) -> Dict[str, List[torch.Tensor]]:
        """First-stage coordinates at the projection's cache dtype, one ``(B, m_u)`` group per
        gradient batch: ``{module: [group, ...]}`` (on the model's device); one checkpoint's."""
        return self._first_stage_groups(self.model, self.stored.projection, examples, progress=progress)

    def _first_stage_groups(self, model, projection, examples, *, progress: bool) -> Dict[str, List[torch.Tensor]]:
        names = projection.names
        capture = GradientCapture(
            model, names, projection.cached_first_stage_transform, checkpoint=self.gradients.gradient_checkpointing
        )
        groups: Dict[str, List[torch.Tensor]] = {name: [] for name in names}
        for _, outputs in run_batches(capture, examples, **self._batching(progress)):
            for name in names:
                groups[name].append(outputs[name])
        return groups

    def _batching(self, progress: bool) -> Dict[str, Any]:
        """How a gradient pass is batched: the options of :func:`~eogp_index.gradients.capture.run_batches`."""
        return {
            "batch_size": self.gradients.batch_size,
            "pad_token_id": pad_token_id(self.tokenizer),
            "device": self.device,
            "progress": progress,
        }

    def block_cache(
        self, config: IngestConfig = IngestConfig(), *, worker: Optional[int] = None, workers: int = 1
    ) -> Optional[BlockCache]:
        """The cache of block ingest, or None for per-batch ingest: blocks when ``P`` does not stay
        in memory (:func:`~eogp_index.store.block_cache.block_documents`, sized by
        ``config.block_documents``). ``worker``: a torchrun worker's rank (its own cache), one of
        ``workers``. The caller closes it. An ensemble ingests per batch (each checkpoint's ``P``
        read per batch when it does not stay in memory): its block cache would hold every
        checkpoint's first stage."""
        if self.manifest.checkpoints is not None:
            return None
        documents = block_documents(self.stored, self.gradients.batch_size, config.block_documents, workers=workers)
        return None if documents is None else BlockCache(self.path, documents, worker=worker)

    def encode_commit(
        self,
        examples: Sequence[Example],
        *,
        cache: Optional[BlockCache] = None,
        on_chunk: Optional[Callable[[Sequence[Example]], None]] = None,
        store_text: Optional[int] = None,
    ) -> pa.Table:
        """The Arrow rows of one commit, projected one gradient batch at a time; ``on_chunk(examples)``
        after each batch.

        With a ``cache`` (block ingest) the examples are one block: each batch's first stage is
        cached on disk (the batches a killed run cached for this very block are reused), then
        each module's ``P`` is read once for the whole block. The rows are those of per-batch
        ingest, bit for bit.
        """
        size = self.gradients.batch_size
        parts = list(batches(examples, size))
        if cache is None:
            tables = []
            for part in parts:
                tables.append(self.encode_rows(part, store_text=store_text))
                if on_chunk is not None:
                    on_chunk(part)
            return pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        done = set(cache.begin(self.stored, size, examples))
        for i, part in enumerate(parts):
            if i not in done:
                cache.write(i, {name: groups[0] for name, groups in self.first_stage_groups(part).items()})
            if on_chunk is not None:
                on_chunk(part)
        cache.wait()
        coords = []
        for name in self.manifest.module_names:
            groups = [z.to(self.device) for z in cache.read(name, len(parts))]
            coords.append(torch.cat(self.projection.modules[name].second_groups(groups)).cpu().numpy())
            del groups
        return self.rows(examples, concat_modules(coords), store_text=store_text)

    def encode_rows(self, examples: Sequence[Example], *, store_text: Optional[int] = None) -> pa.Table:
        """The Arrow rows of a batch, ready for :meth:`Store.add` (also used by distributed ingest).

        Args:
            store_text: keep each document's text (at most this many UTF-8 bytes; a longer one is
                stored as null and read back from its shard when explained); None stores none.
        """
        return self.rows(examples, self.project(examples), store_text=store_text)

    def rows(
        self, examples: Sequence[Example], coordinates: np.ndarray, *, store_text: Optional[int] = None
    ) -> pa.Table:
        """:meth:`encode_rows` from the examples' projected coordinates ``(n, T)`` float32
        (:meth:`project`), with the rescoring tier's columns when the index has one (every writer
        comes here): the one-bit code of the first ``k_u`` of each module's, the tier of all."""
        encoded = self.codec.encode(self.stored.one_bit(coordinates))
        columns = self.codec.split(encoded.columns())  # a column per checkpoint of an ensemble
        if self.stored.tier is not None:  # laid out as the table holds it (TierCodec.split)
            columns.update(self.stored.tier.split(self.stored.tier.encode(coordinates)))
        hashed = self.manifest.has_content_hashes
        info = RowInfo(
            ids=[ex.id for ex in examples],
            shards=[ex.shard for ex in examples],
            positions=[ex.position for ex in examples],
            num_tokens=[ex.num_tokens for ex in examples],
            num_loss_tokens=[ex.num_loss_tokens for ex in examples],
            truncated=[ex.truncated for ex in examples],
            metadata=[dict(ex.metadata) for ex in examples],
            content_sha256=[ex.content_sha256 for ex in examples] if hashed else None,
            content_kind=[ex.content_kind for ex in examples] if hashed else None,
            text=None if store_text is None else [_capped(ex.display_text, store_text) for ex in examples],
        )
        return build_rows(info, columns, schema=self.store.schema)

    # -- queries ----------------------------------------------------------------------------------
    @property
    def query_spec(self) -> RecordSpec:
        """How queries are tokenized: as records, cut to the index's ``max_tokens``."""
        return RecordSpec(max_tokens=self.manifest.max_tokens)

    def query_examples(self, queries: Sequence[Any]) -> List[Example]:
        """Tokenize queries (texts, chats, ids or record dicts) as training records are tokenized.

        A preference query (two completions) has no single example: :meth:`measure` takes it.
        """
        out = []
        for i, query in enumerate(queries):
            record = query_record(query, i)
            if check_record(record, self.query_spec, location_of("query", i), query=True).query_only:
                raise InputError(
                    f"query {i}: a preference query ({{prompt, chosen, rejected}}) measures two "
                    "completions; it is answered by query, select and scores, not here"
                )
            out.append(
                tokenize_record(record, shard="query", position=i, spec=self.query_spec, tokenizer=self.tokenizer)
            )
        return out

    def measure(self, queries: Sequence[Any], *, max_query_tokens: Optional[int] = None) -> Measured:
        """:func:`eogp_index.encode.measurements.measure` on this encoder: every query that
        measures, as coordinates in one gradient pass, and the error of each one that does not."""
        return measure(self, queries, max_query_tokens=max_query_tokens)

    def query_coordinates(self, queries: Sequence[Any]) -> np.ndarray:
        """Projected, unquantized query coordinates ``(n_queries, T)`` float32, the index's
        coordinates (:meth:`project`; the scans take the one-bit code's first ``k_u`` per module
        themselves, the rescoring all of them) (:mod:`eogp_index.encode.measurements`); the first
        bad query raises its :class:`InputError` before any gradient pass."""
        tokenized = tokenize_queries(self, queries)
        if tokenized.errors:
            raise tokenized.errors[min(tokenized.errors)]
        return measured(self, tokenized).coordinates


class CombinedProjection:
    """An ensemble's projections seen as one: ``modules`` maps each combined module name
    (``manifest.module_names``) to its checkpoint's
    :class:`~eogp_index.fit.projection.ModuleProjection`."""

    def __init__(self, modules: Dict[str, Any]):
        self.modules = modules

    @property
    def names(self) -> List[str]:
        return list(self.modules)


def _capped(text: str, max_bytes: int) -> Optional[str]:
    """``text`` if its UTF-8 fits ``max_bytes``; else None (never a cut document: explanations
    rebuild the document from it)."""
    return text if len(text.encode("utf-8")) <= max_bytes else None
