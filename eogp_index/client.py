"""The Python client: build an index, ingest examples, ask which ones influence a query.

:class:`AttributionIndex` is a facade over the pipeline's stages: it fits with
:mod:`eogp_index.fit`, keeps the directory, table and codes through
:class:`~eogp_index.store.stored_index.StoredIndex`, projects examples with the model
(:mod:`eogp_index.gradients`), and answers queries with :mod:`eogp_index.search`.

Example:
    >>> from eogp_index import AttributionIndex
    >>> index = AttributionIndex.open("my-index")  # doctest: +SKIP
    >>> index.top_influential("The capital of France is Paris.", k=5, where="kind = 'function'")  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterable, List, Literal, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
from torch import nn

from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import ConfigError, InputError
from eogp_index.fit.fitting import fit_projection
from eogp_index.gradients.capture import GradientCapture, batches, project_examples
from eogp_index.gradients.model import (
    freeze,
    hard_context_length,
    load_model,
    model_fingerprint,
    model_sha256,
    pad_token_id,
    replace_conv1d,
)
from eogp_index.data.records import Example, RecordSpec, tokenize_record
from eogp_index.search.explain import Explanation, explain_documents
from eogp_index.search.query import InfluenceQuery, Query, QueryOptions
from eogp_index.search.searchers import HotSearcher, TorchSearcher, warm_kernels
from eogp_index.store.codecs import concat_modules
from eogp_index.store.maintenance import (
    DEFAULT_FRAGMENT_THRESHOLD,
    DEFAULT_RETENTION,
    DEFAULT_TARGET_ROWS,
    OptimizeReport,
    after_ingest,
    maybe_optimize,
    optimize,
)
from eogp_index.store.manifest import check_compatible
from eogp_index.store.stored_ids import StoredIds
from eogp_index.store.stored_index import StoredIndex, prepare_index_dir
from eogp_index.store.table import RowInfo, build_rows

class AttributionIndex:
    """An EOGP attribution index with its model loaded: a directory with a manifest, a projection
    and a LanceDB table (:class:`StoredIndex`), plus the model and tokenizer that project texts."""

    def __init__(self, stored: StoredIndex, model: nn.Module, tokenizer, *,
                 gradients: GradientConfig = GradientConfig()):
        self.stored = stored
        self.model = model
        self.tokenizer = tokenizer
        self.gradients = gradients
        self.device = gradients.resolved_device()

    # The stored parts, as attributes of the index itself.
    path = property(lambda self: self.stored.path)
    manifest = property(lambda self: self.stored.manifest)
    store = property(lambda self: self.stored.store)
    layout = property(lambda self: self.stored.layout)
    codec = property(lambda self: self.stored.codec)
    projection = property(lambda self: self.stored.projection)

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Union[str, Path], model: nn.Module, tokenizer, examples: Sequence[Example], *,
               model_name: str, modules: Optional[Sequence[str]] = None,
               curvature: CurvatureConfig = CurvatureConfig(), projection: ProjectionConfig = ProjectionConfig(k=256),
               storage: StorageConfig = StorageConfig(), gradients: GradientConfig = GradientConfig(),
               table_uri: Optional[str] = None, mode: Literal["create", "overwrite"] = "create",
               progress: bool = True) -> "AttributionIndex":
        """Fit curvature and projection on ``examples`` and write an empty index at ``path``.

        Args:
            examples: tokenized corpus examples; seeded, disjoint samples of them fit the EK-FAC
                factors (``curvature.num_examples``) and the PCA (``projection.num_fit_examples``);
                with too few for both the sets overlap, with a warning.
            model_name: recorded in the manifest; :meth:`open` reloads the model from it.
            table_uri: a LanceDB URI (object store or directory) for the table; ``None`` keeps it
                inside ``path``.
            mode: ``"create"`` refuses an existing index directory, and resumes an interrupted fit
                found there (``path/fit`` without a manifest); ``"overwrite"`` replaces either.

        Under ``torch.distributed`` every rank calls this: the work is split
        (:mod:`eogp_index.fit.fitting`), rank 0 writes the index, and every rank returns it.
        """
        import torch.distributed as dist

        if not examples:
            raise InputError("no examples to fit the curvature and projection on")
        context = hard_context_length(model)
        if gradients.max_tokens is not None and context is not None and gradients.max_tokens > context:
            raise ConfigError(f"max_tokens (--max-tokens) is {gradients.max_tokens}, but {model_name} reads at most "
                              f"{context} tokens; give at most {context} (longer documents are then cut, or split "
                              "with `eogp ingest --long-documents windows`)")
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        if rank == 0:
            path = prepare_index_dir(path, table_uri=table_uri, mode=mode)
        if distributed:
            dist.barrier()
        path = Path(path)
        weights_fingerprint = model_fingerprint(model)  # before fitting swaps GPT-2's Conv1D, like weights_sha256
        fitted = fit_projection(model, tokenizer, examples, path, modules=modules, curvature=curvature,
                                projection=projection, storage=storage, gradients=gradients, progress=progress)
        if rank == 0:
            stored = StoredIndex.create(
                path, fitted, model_name=model_name, tokenizer_name=getattr(tokenizer, "name_or_path", None),
                precision=storage.precision, damping_ratio=curvature.damping_ratio, max_tokens=gradients.max_tokens,
                curvature={"num_examples": fitted.curvature_examples, "seed": curvature.seed,
                           "batch_size": curvature.batch_size, "factors_dir": "curvature",
                           "fitting_set": "fit/fitting_set.json", "disjoint_from_pca": fitted.disjoint},
                table_uri=table_uri, weights_fingerprint=weights_fingerprint)
        if distributed:
            dist.barrier()  # every rank is done with the fit's files
        if rank == 0 and fitted.folder is not None:
            fitted.folder.finish()  # the cached coordinates and per-module P are in the projection now
        if rank != 0:
            stored = StoredIndex.open(path)
        stored.projection_memory = _projection_memory(gradients)
        freeze(model)  # fitting is done: from here on only output gradients are needed
        return cls(stored, model, tokenizer, gradients=gradients)

    @classmethod
    def open(cls, path: Union[str, Path], *, model: Optional[nn.Module] = None, tokenizer=None,
             model_name: Optional[str] = None, gradients: GradientConfig = GradientConfig()) -> "AttributionIndex":
        """Open an index; load its model from the manifest's name unless one is given.

        Args:
            model, tokenizer: an already loaded model and its tokenizer.
            model_name: load the model from here instead of the manifest's name (the model moved);
                its weights must still hash to the manifest's.

        The model and projection are checked by the sampled fingerprints in the manifest (an
        index written before them: by full SHA-256s); :func:`~eogp_index.store.verify.verify_index` (``eogp verify``)
        hashes every byte. The model is frozen: no parameter requires gradients, and queries and
        ingests leave no ``.grad`` (only output gradients are taken).

        Raises:
            IncompatibleIndexError: the model's weights or the projection file differ from the
                ones the index was built with.
        """
        stored = StoredIndex.open(path)
        if stored.has_hot_copy() and not gradients.resolved_device().startswith("cuda"):
            # An index that is queried here: the CPU scan kernels' first call costs a few hundred
            # ms (numba sets up its CPU target and loads the cached machine code), done on the
            # side while the model loads.
            threading.Thread(target=warm_kernels, args=(stored,), name="eogp-warm-kernels", daemon=True).start()
        stored.projection_memory = _projection_memory(gradients)
        stored.projection  # noqa: B018  (loads and checks the projection before the model is loaded)
        if model is None:
            model, loaded = load_model(model_name or stored.manifest.model["name"], device=gradients.resolved_device())
            tokenizer = tokenizer or loaded
        elif tokenizer is None:
            raise ConfigError("AttributionIndex.open: pass the tokenizer together with the model")
        if stored.manifest.model.get("weights_fingerprint"):
            check_compatible(stored.manifest, model_fingerprint=model_fingerprint(model), where=str(stored.path))
        else:  # written before fingerprints: the full hash
            check_compatible(stored.manifest, model_hash=model_sha256(model), where=str(stored.path))
        replace_conv1d(model)
        freeze(model)
        model.to(gradients.resolved_device()).eval()
        return cls(stored, model, tokenizer, gradients=gradients)

    # -- gradients --------------------------------------------------------------------------------
    def project(self, examples: Sequence[Example], *, progress: bool = False) -> np.ndarray:
        """Unquantized projected coordinates ``(n, K)`` float32, modules concatenated in order."""
        if not examples:
            return np.zeros((0, self.layout.num_coords), np.float32)
        names = self.manifest.module_names
        capture = GradientCapture(self.model, names, self.projection.transform,
                                  checkpoint=self.gradients.gradient_checkpointing)
        out = project_examples(capture, examples, batch_size=self.gradients.batch_size,
                               pad_token_id=pad_token_id(self.tokenizer), device=self.device, progress=progress)
        return concat_modules([out[name].numpy() for name in names])

    def query_examples(self, queries: Sequence[Query]) -> List[Example]:
        """Tokenize queries (texts, chats, ids or record dicts) as training records are tokenized."""
        spec = RecordSpec(max_tokens=self.manifest.max_tokens)
        out = []
        for i, query in enumerate(queries):
            if isinstance(query, str):
                record: Dict[str, Any] = {"text": query}
            elif isinstance(query, dict):
                record = dict(query)
            elif isinstance(query, (list, tuple)) and query and isinstance(query[0], dict):
                record = {"messages": list(query)}
            elif isinstance(query, (list, tuple)):
                record = {"input_ids": list(query)}
            else:
                raise InputError(f"query {i}: expected a text, a chat (list of role/content dicts), token ids or a "
                                 f"record dict, got {type(query).__name__}")
            out.append(tokenize_record(record, shard="query", position=i, spec=spec, tokenizer=self.tokenizer))
        return out

    def query_coordinates(self, queries: Sequence[Query]) -> np.ndarray:
        """Projected, unquantized query coordinates ``(n_queries, K)`` float32."""
        return self.project(self.query_examples(queries))

    # -- storing ----------------------------------------------------------------------------------
    def ingest(self, examples: Iterable[Example], *, progress: bool = True, store_text: Optional[int] = None,
               optimize_threshold: Optional[int] = DEFAULT_FRAGMENT_THRESHOLD) -> int:
        """Store examples not stored yet, one commit per gradient batch; returns the rows added.

        An id already stored from the same shard and position is skipped (a rerun); the same id
        from elsewhere is an :class:`InputError`, as in ``eogp ingest`` (same rule:
        :class:`~eogp_index.store.stored_ids.StoredIds`). For shards, rejects and scale-out use
        ``ingest.run_ingest`` (``eogp ingest``), which also records where each shard lives.
        Like it, compacts the table past the fragment threshold and ends with the hot copy up to
        date (:mod:`eogp_index.store.maintenance`).

        Args:
            store_text: keep each document's text, up to this many UTF-8 bytes (see
                :meth:`encode_rows`); every ingest into one index uses the same setting.
            optimize_threshold: compact past this many small fragments (None: never; as
                ``ingest.run_ingest``).
        """
        self.stored.agree_store_text(store_text)
        if self.manifest.has_content_hashes and store_text is not None:
            self.stored.sources.save()
        stored = StoredIds(self.store)
        added = optimized = 0
        for batch in batches(examples, self.gradients.batch_size) if not progress else _bar(examples, self):
            fresh = []
            for ex in batch:
                status, where = stored.lookup(ex)
                if status == "other":
                    raise InputError(f"duplicate id {ex.id!r}: already stored from {where}; ids must be unique",
                                     location=f"{ex.shard}:{ex.position}" if ex.shard else None)
                if status == "absent":
                    fresh.append(ex)
                    stored.remember([ex])  # a repeat later in this call is then a rerun, not a new row
            if fresh:
                added += self.add_batch(fresh, store_text=store_text)
                optimized += maybe_optimize(self.stored, threshold=optimize_threshold) is not None
        if added and optimize_threshold is not None:
            after_ingest(self.stored, optimized=optimized > 0, threshold=optimize_threshold, settle=False)
        return added

    def add_batch(self, examples: Sequence[Example], *, store_text: Optional[int] = None) -> int:
        """Project, encode and store one batch in one commit."""
        rows = self.encode_rows(examples, store_text=store_text)
        self.store.add(rows)
        return rows.num_rows

    def encode_rows(self, examples: Sequence[Example], *, store_text: Optional[int] = None) -> pa.Table:
        """The Arrow rows of a batch, ready for :meth:`Store.add` (also used by distributed ingest).

        Args:
            store_text: keep each document's text (at most this many UTF-8 bytes; a longer one is
                stored as null and read back from its shard when explained); None stores none.
        """
        encoded = self.codec.encode(self.project(examples))
        hashed = self.manifest.has_content_hashes
        info = RowInfo(ids=[ex.id for ex in examples], shards=[ex.shard for ex in examples],
                       positions=[ex.position for ex in examples], num_tokens=[ex.num_tokens for ex in examples],
                       num_loss_tokens=[ex.num_loss_tokens for ex in examples],
                       truncated=[ex.truncated for ex in examples], metadata=[dict(ex.metadata) for ex in examples],
                       content_sha256=[ex.content_sha256 for ex in examples] if hashed else None,
                       content_kind=[ex.content_kind for ex in examples] if hashed else None,
                       text=None if store_text is None else [_capped(ex.display_text, store_text) for ex in examples])
        return build_rows(info, encoded, schema=self.store.schema)

    # -- queries ----------------------------------------------------------------------------------
    def search(self, query: Union[Query, List[Query]], *, many: bool = False) -> InfluenceQuery:
        """A query builder: ``index.search(q).where(...).limit(k).direction("both").to_arrow()``.

        ``many=True`` takes a list of queries and answers each (``.to_list()``).
        """
        return InfluenceQuery(self, query, many=many)

    def top_influential(self, query: Query, k: int = 20, *, where: Optional[str] = None,
                        direction: Literal["positive", "negative", "both"] = "positive",
                        candidates: Optional[int] = None, stream: bool = False, by_module: bool = False,
                        route: Literal["auto", "hot", "stream", "sharded", "candidates"] = "auto") -> pa.Table:
        """The ``k`` stored examples that most help (``positive``) or hurt (``negative``) the query.

        Args:
            where: SQL filter on the stored columns (LanceDB's); only matching rows are scored.
            candidates: rescore this many FAISS candidates per direction (``eogp build-faiss``)
                instead of scanning every row.
            stream: scan the table batch by batch instead of the in-memory hot copy.
            by_module: add a ``modules`` column: each hit's per-module score terms, which sum to
                its score.
            route: ``sharded`` under torchrun splits the table's fragments over the workers.

        Returns:
            A ``pyarrow.Table`` with ``rank``, ``id``, ``score``, and the stored metadata columns
            (plus ``direction`` when ``direction="both"``), best first; empty before any ingest.
        """
        if candidates is not None:
            route = "candidates"
        elif stream:
            route = "stream"
        options = QueryOptions(k=k, where=where, direction=direction, route=route, candidates=candidates,
                               by_module=by_module)
        return InfluenceQuery(self, query, options=options).to_arrow()

    def scores(self, queries: Sequence[Query], *, where: Optional[str] = None) -> tuple[List[str], np.ndarray]:
        """Exact scores of every stored row (matching ``where``): ids and ``(n_queries, n_rows)`` float32.

        Positive = training on the example lowers the query's loss (kronfluence's convention).
        """
        y = self.query_coordinates(queries)
        searcher = TorchSearcher(self.stored, self.device) if self.device.startswith("cuda") else HotSearcher(self.stored)
        rowaddr, scores = searcher.scores(y, where)
        ids = self.stored.rows(rowaddr, ["id"]).column("id").to_pylist() if rowaddr.size else []
        return ids, scores

    def explain(self, query: Query, example_id: str) -> Explanation:
        """Why ``example_id`` ranks for ``query``: its score by module, its tokens' and the query's
        tokens' contributions (:mod:`eogp_index.search.explain`)."""
        return explain_documents(self, query, [example_id])[0]

    def explain_many(self, query: Query, example_ids: Sequence[str]) -> List[Explanation]:
        """:meth:`explain` for several documents (e.g. a query's top 10) in one batched pass."""
        return explain_documents(self, query, list(example_ids))

    def hot_codes(self):
        """The in-memory copy of the stored codes, refreshed when the table has changed."""
        return self.stored.hot_codes()

    def info(self) -> Dict[str, Any]:
        """The manifest plus live facts: row count, table version, path."""
        return self.stored.info()

    def optimize(self, *, retention: Optional[timedelta] = DEFAULT_RETENTION, rebuild_hot: bool = True,
                 target_rows: int = DEFAULT_TARGET_ROWS) -> OptimizeReport:
        """Compact the table, refresh its scalar indexes, remove versions older than ``retention``
        and rebuild the hot copy (``eogp optimize``; :func:`eogp_index.store.maintenance.optimize`).

        Ingest already does this past a fragment threshold; call it after writing the table by
        other means, or to drop old versions sooner.
        """
        return optimize(self.stored, retention=retention, rebuild_hot=rebuild_hot, target_rows=target_rows)


def _projection_memory(gradients: GradientConfig) -> Optional[int]:
    """``gradients.projection_memory_gb`` in bytes (None: the projection's own default)."""
    return None if gradients.projection_memory_gb is None else int(gradients.projection_memory_gb * (1 << 30))


def _capped(text: str, max_bytes: int) -> Optional[str]:
    """``text`` if its UTF-8 fits ``max_bytes``; else None (never a cut document: explanations
    rebuild the document from it)."""
    return text if len(text.encode("utf-8")) <= max_bytes else None


def _bar(examples: Iterable[Example], index: AttributionIndex):
    from tqdm.auto import tqdm

    return tqdm(batches(examples, index.gradients.batch_size), desc="ingesting", unit="batch")
