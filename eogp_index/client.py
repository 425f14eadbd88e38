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

import dataclasses
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Literal, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from eogp_index.config import (
    CurvatureConfig,
    GradientConfig,
    IngestConfig,
    ModelDtype,
    ProjectionConfig,
    StorageConfig,
)
from eogp_index.data.readers import is_dataset_object
from eogp_index.data.records import Example, RecordSpec, preference_pair, tokenize_record
from eogp_index.errors import ConfigError, IncompatibleIndexError, InputError
from eogp_index.fit.fitting import fit_projection
from eogp_index.gradients.capture import GradientCapture, batches, project_examples, run_batches
from eogp_index.gradients.experts import make_experts_trackable
from eogp_index.gradients.model import (
    adapter_fingerprint,
    dtype_name,
    freeze,
    hard_context_length,
    load_indexed_model,
    model_fingerprint,
    model_sha256,
    pad_token_id,
    replace_conv1d,
    shared_weights_copy,
    torch_dtype,
)
from eogp_index.search.explain import Explanation, explain_documents
from eogp_index.search.query import InfluenceQuery, Query, QueryOptions
from eogp_index.search.searchers import HotSearcher, TorchSearcher, warm_kernels
from eogp_index.store.block_cache import BlockCache, block_documents
from eogp_index.store.codecs import concat_modules
from eogp_index.store.maintenance import (
    DEFAULT_RETENTION,
    DEFAULT_TARGET_ROWS,
    OptimizeReport,
    after_ingest,
    maybe_optimize,
    optimize,
)
from eogp_index.store.manifest import check_compatible, open_dtype
from eogp_index.store.stored_ids import StoredIds
from eogp_index.store.stored_index import StoredIndex, prepare_index_dir
from eogp_index.store.table import RowInfo, build_rows


class AttributionIndex:
    """An EOGP attribution index with its model loaded: a directory with a manifest, a projection
    and a LanceDB table (:class:`StoredIndex`), plus the model and tokenizer that project texts."""

    def __init__(
        self, stored: StoredIndex, model: nn.Module, tokenizer, *, gradients: GradientConfig = GradientConfig()
    ):
        self.stored = stored
        self.model = model
        self.tokenizer = tokenizer
        self.gradients = gradients
        self.device = gradients.resolved_device()
        #: The batch :meth:`open` chose for the memory budget (``eogp plan INDEX``'s), or None.
        self.sizing: Optional[Dict[str, Any]] = None

    # The stored parts, as attributes of the index itself.
    path = property(lambda self: self.stored.path)
    manifest = property(lambda self: self.stored.manifest)
    store = property(lambda self: self.stored.store)
    layout = property(lambda self: self.stored.layout)
    codec = property(lambda self: self.stored.codec)
    projection = property(lambda self: self.stored.projection)

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: Union[str, Path],
        model: nn.Module,
        tokenizer,
        examples: Sequence[Example],
        *,
        model_name: str,
        adapter: Optional[str] = None,
        modules: Optional[Sequence[str]] = None,
        curvature: CurvatureConfig = CurvatureConfig(),
        projection: ProjectionConfig = ProjectionConfig(k=256),
        storage: StorageConfig = StorageConfig(),
        gradients: GradientConfig = GradientConfig(),
        table_uri: Optional[str] = None,
        mode: Literal["create", "overwrite"] = "create",
        progress: bool = True,
        dtype: Optional[ModelDtype] = None,
    ) -> "AttributionIndex":
        """Fit curvature and projection on ``examples`` and write an empty index at ``path``.

        Args:
            examples: tokenized corpus examples; seeded, disjoint samples of them fit the EK-FAC
                factors (``curvature.num_examples``) and the PCA (``projection.num_fit_examples``);
                with too few for both the sets overlap, with a warning.
            model_name: recorded in the manifest; :meth:`open` reloads the model from it.
            adapter: the directory of the LoRA adapter loaded into ``model``
                (:func:`~eogp_index.gradients.model.load_model`), reloaded with the base on open;
                required exactly when ``model`` has LoRA layers.
            table_uri: a LanceDB URI (object store or directory) for the table; ``None`` keeps it
                inside ``path``.
            mode: ``"create"`` refuses an existing index directory, and resumes an interrupted fit
                found there (``path/fit`` without a manifest); ``"overwrite"`` replaces either.
            dtype: the model's precision (default ``gradients.dtype``): ``"bfloat16"``,
                ``"float16"`` or ``"float32"`` casts the index's copy of the model to it (the
                model given keeps its own weights); ``"auto"`` keeps the dtype it was loaded in.
                Recorded in the manifest: the index is opened in it.

        ``model`` is left as it is: the fit prepares the index's own module objects over its
        weights, as :meth:`open` does.

        Under ``torch.distributed`` every rank calls this: the work is split
        (:mod:`eogp_index.fit.fitting`), rank 0 writes the index, and every rank returns it.
        """
        import torch.distributed as dist

        if not examples:
            raise InputError("no examples to fit the curvature and projection on")
        context = hard_context_length(model)
        if gradients.max_tokens is not None and context is not None and gradients.max_tokens > context:
            raise ConfigError(
                f"max_tokens (--max-tokens) is {gradients.max_tokens}, but {model_name} reads at most "
                f"{context} tokens; give at most {context} (longer documents are then cut, or split "
                "with `eogp ingest --long-documents windows`)"
            )
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        if rank == 0:
            path = prepare_index_dir(path, table_uri=table_uri, mode=mode)
        if distributed:
            dist.barrier()
        path = Path(path)
        model = shared_weights_copy(model)  # the fit prepares the index's own module objects, not the caller's
        gradients = _in_dtype(model, dtype or gradients.dtype, gradients)
        weights_fingerprint = model_fingerprint(model)
        adapter_entry = _adapter_entry(model, adapter)
        fitted = fit_projection(
            model,
            tokenizer,
            examples,
            path,
            modules=modules,
            curvature=curvature,
            projection=projection,
            storage=storage,
            gradients=gradients,
            progress=progress,
        )
        if rank == 0:
            stored = StoredIndex.create(
                path,
                fitted,
                model_name=model_name,
                tokenizer_name=getattr(tokenizer, "name_or_path", None),
                precision=storage.precision,
                damping_ratio=curvature.damping_ratio,
                max_tokens=gradients.max_tokens,
                curvature={
                    "num_examples": fitted.curvature_examples,
                    "seed": curvature.seed,
                    "batch_size": curvature.batch_size,
                    "factors_dir": "curvature",
                    "fitting_set": "fit/fitting_set.json",
                    "disjoint_from_pca": fitted.disjoint,
                },
                table_uri=table_uri,
                weights_fingerprint=weights_fingerprint,
                adapter=adapter_entry,
                experts=gradients.experts,
                model_dtype=gradients.dtype,
            )
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
    def open(
        cls,
        path: Union[str, Path],
        *,
        model: Optional[nn.Module] = None,
        tokenizer=None,
        model_name: Optional[str] = None,
        gradients: GradientConfig = GradientConfig(),
        dtype: Optional[ModelDtype] = None,
    ) -> "AttributionIndex":
        """Open an index; load its model from the manifest's name unless one is given.

        Args:
            model, tokenizer: an already loaded model and its tokenizer.
            model_name: load the model from here instead of the manifest's name (the model moved;
                an adapter directory replaces base and adapter); its weights must still hash to the
                manifest's.
            dtype: the model's precision (default ``gradients.dtype``); ``"auto"`` is the one the
                index was built in (``manifest.model.dtype``), and another one is refused
                (:func:`~eogp_index.store.manifest.open_dtype`): stored codes and queries must come
                from the same precision. A model passed in must already be in it.

        The model and projection are checked by the sampled fingerprints in the manifest (an
        index written before them: by full SHA-256s); :func:`~eogp_index.store.verify.verify_index` (``eogp verify``)
        hashes every byte. A model passed in is left as it is: the index prepares its own module
        objects over the same weights (:func:`~eogp_index.gradients.model.shared_weights_copy`;
        ``index.model``), with GPT-2's ``Conv1D`` layers as ``nn.Linear``, frozen (no parameter
        requires gradients, and queries and ingests leave no ``.grad``: only output gradients are
        taken), in eval mode and on the device. One model object may open several indexes, and
        ``index.model`` another one.

        Raises:
            IncompatibleIndexError: the model's weights, its dtype or the projection file differ
                from the ones the index was built with.
        """
        stored = StoredIndex.open(path)
        model_dtype = open_dtype(stored.manifest, dtype or gradients.dtype, where=str(stored.path))
        gradients = dataclasses.replace(gradients, dtype=model_dtype)
        if stored.has_hot_copy() and not gradients.resolved_device().startswith("cuda"):
            # An index that is queried here: the CPU scan kernels' first call costs a few hundred
            # ms (numba sets up its CPU target and loads the cached machine code), done on the
            # side while the model loads.
            threading.Thread(target=warm_kernels, args=(stored,), name="eogp-warm-kernels", daemon=True).start()
        stored.projection_memory = _projection_memory(gradients)
        stored.projection  # noqa: B018  (loads and checks the projection before the model is loaded)
        if model is None:
            model, loaded = load_indexed_model(
                stored.manifest.model, model_name, device=gradients.resolved_device(), dtype=model_dtype
            )
            tokenizer = tokenizer or loaded
        elif tokenizer is None:
            raise ConfigError("AttributionIndex.open: pass the tokenizer together with the model")
        elif dtype_name(model) != model_dtype:
            raise IncompatibleIndexError(
                f"{stored.path} was built with the model in {model_dtype} (manifest model.dtype) but the model given "
                f"is {dtype_name(model)}; pass model.to(torch.{model_dtype}), or let open load it"
            )
        else:  # prepared below on the index's own module objects: the caller's model is left as it is
            model = shared_weights_copy(model)
        if stored.manifest.model.get("weights_fingerprint"):
            check_compatible(
                stored.manifest,
                model_fingerprint=model_fingerprint(model),
                adapter_fingerprint=adapter_fingerprint(model),
                where=str(stored.path),
            )
        else:  # written before fingerprints: the full hash
            check_compatible(stored.manifest, model_hash=model_sha256(model), where=str(stored.path))
        replace_conv1d(model)
        make_experts_trackable(model, dense=stored.manifest.model.get("experts") == "dense")  # as the fit did
        freeze(model)
        model.to(gradients.resolved_device()).eval()
        gradients, sizing = _sized(stored, model, gradients)
        index = cls(stored, model, tokenizer, gradients=gradients)
        index.sizing = sizing
        return index

    # -- gradients --------------------------------------------------------------------------------
    def project(self, examples: Sequence[Example], *, progress: bool = False) -> np.ndarray:
        """Unquantized projected coordinates ``(n, K)`` float32, modules concatenated in order."""
        if not examples:
            return np.zeros((0, self.layout.num_coords), np.float32)
        names = self.manifest.module_names
        if self.projection.in_turn:
            # P does not stay in memory: the first stage of every batch, then each module's P read
            # once for all of them (the paper's batched queries), not once per batch.
            groups = self.first_stage_groups(examples, progress=progress)
            return concat_modules(
                [
                    torch.cat(self.projection.modules[name].second_groups(groups.pop(name))).cpu().numpy()
                    for name in names
                ]
            )
        capture = GradientCapture(
            self.model, names, self.projection.transform, checkpoint=self.gradients.gradient_checkpointing
        )
        out = project_examples(
            capture,
            examples,
            batch_size=self.gradients.batch_size,
            pad_token_id=pad_token_id(self.tokenizer),
            device=self.device,
            progress=progress,
        )
        return concat_modules([out[name].numpy() for name in names])

    def first_stage_groups(
        self, examples: Sequence[Example], *, progress: bool = False
    ) -> Dict[str, List[torch.Tensor]]:
        """First-stage coordinates at the projection's cache dtype, one ``(B, m_u)`` group per
        gradient batch: ``{module: [group, ...]}`` (on the model's device)."""
        names = self.manifest.module_names
        capture = GradientCapture(
            self.model,
            names,
            self.projection.cached_first_stage_transform,
            checkpoint=self.gradients.gradient_checkpointing,
        )
        groups: Dict[str, List[torch.Tensor]] = {name: [] for name in names}
        for _, outputs in run_batches(
            capture,
            examples,
            batch_size=self.gradients.batch_size,
            pad_token_id=pad_token_id(self.tokenizer),
            device=self.device,
            progress=progress,
        ):
            for name in names:
                groups[name].append(outputs[name])
        return groups

    def query_examples(self, queries: Sequence[Query]) -> List[Example]:
        """Tokenize queries (texts, chats, ids or record dicts) as training records are tokenized.

        A preference query (two texts) has no single example: :meth:`query_coordinates` takes it.
        """
        spec = RecordSpec(max_tokens=self.manifest.max_tokens)
        out = []
        for i, query in enumerate(queries):
            if preference_pair(query) is not None:
                raise InputError(
                    f"query {i}: a preference query ({{prompt, chosen, rejected}}) measures two "
                    "completions; it is answered by query, select and scores, not here"
                )
            if isinstance(query, str):
                record: Dict[str, Any] = {"text": query}
            elif isinstance(query, dict):
                record = dict(query)
            elif isinstance(query, (list, tuple)) and query and isinstance(query[0], dict):
                record = {"messages": list(query)}
            elif isinstance(query, (list, tuple)):
                record = {"input_ids": list(query)}
            else:
                raise InputError(
                    f"query {i}: expected a text, a chat (list of role/content dicts), token ids or a "
                    f"record dict, got {type(query).__name__}"
                )
            out.append(tokenize_record(record, shard="query", position=i, spec=spec, tokenizer=self.tokenizer))
        return out

    def query_coordinates(self, queries: Sequence[Query]) -> np.ndarray:
        """Projected, unquantized query coordinates ``(n_queries, K)`` float32.

        A preference query ``{"prompt", "chosen", "rejected"}`` measures
        ``loss(chosen | prompt) - loss(rejected | prompt)``: its coordinates are the chosen
        completion's minus the rejected one's (scores are linear in them), so a positive score
        means training on the document raises ``log p(chosen | prompt) - log p(rejected | prompt)``.
        """
        parts: List[Query] = []
        owner: List[int] = []
        sign: List[float] = []
        for i, query in enumerate(queries):
            pair = preference_pair(query)
            for part, s in zip(pair, (1.0, -1.0)) if pair is not None else [(query, 1.0)]:
                parts.append(part)
                owner.append(i)
                sign.append(s)
        x = self.project(self.query_examples(parts))
        if len(parts) == len(queries):
            return x
        y = np.zeros((len(queries), x.shape[1]), np.float32)
        np.add.at(y, np.asarray(owner), x * np.asarray(sign, np.float32)[:, None])
        return y

    # -- storing ----------------------------------------------------------------------------------
    def ingest(self, examples: Iterable[Example], config: Optional[IngestConfig] = None, **options: Any) -> int:
        """Store examples not stored yet; returns the rows added.

        An id already stored from the same shard and position is skipped (a rerun); the same id
        from elsewhere is an :class:`InputError`, as in ``eogp ingest`` (same rule:
        :class:`~eogp_index.store.stored_ids.StoredIds`). For shards, rejects and scale-out use
        ``ingest.run_ingest`` (``eogp ingest``), which also records where each shard lives.
        Like it, commits the new examples in batches (one gradient batch each by default), or, when
        ``P`` does not stay in memory, in blocks with each module's ``P`` read once per block
        (:meth:`block_cache`: resumable after a kill, as ``eogp ingest``); compacts the table past
        the fragment threshold and ends with the hot copy up to date
        (:mod:`eogp_index.store.maintenance`).

        Args:
            config: the :class:`~eogp_index.config.IngestConfig` (default: its defaults). Its
                ``batch_size``, ``block_documents``, ``store_text``, ``optimize_threshold`` and
                ``progress`` apply here; the shard options (``spec``, ``on_error="skip"``,
                ``rejects_path``, ``shard_root``) and ``commit_every`` are refused.
            options: fields of ``config`` to replace, e.g. ``store_text=4096, progress=False``.
        """
        if is_dataset_object(examples):
            raise ConfigError(
                "AttributionIndex.ingest takes tokenized Examples; ingest a datasets.Dataset or "
                "IterableDataset with ingest.run_ingest(index, [dataset], spec=RecordSpec(...)), which "
                "reads its records as a shard (resumable, recorded in sources.json)"
            )
        config = (config or IngestConfig()).with_options(**options)
        config.refuse(
            ("spec", "on_error", "rejects_path", "shard_root", "commit_every"),
            "AttributionIndex.ingest takes tokenized examples; to read shards (with rejects, or under "
            "torchrun) use ingest.run_ingest or eogp ingest",
        )
        store_text = config.store_text
        self.stored.agree_store_text(store_text)
        if self.manifest.has_content_hashes and store_text is not None:
            self.stored.sources.save()
        stored = StoredIds(self.store)
        cache = self.block_cache(config)
        rows_per_commit = (
            cache.documents
            if cache is not None
            else config.commit_rows(self.gradients.batch_size, default=self.gradients.batch_size)
        )
        bar = _bar(config.progress)
        added = optimized = 0
        try:
            for commit in _fresh_commits(examples, stored, rows_per_commit, bar):
                self.store.add(self.encode_commit(commit, cache=cache, store_text=store_text))  # one commit
                if cache is not None:
                    cache.clear()
                added += len(commit)
                optimized += maybe_optimize(self.stored, threshold=config.optimize_threshold) is not None
            if cache is not None:
                cache.clear()  # a block a killed run left, when this call had nothing left to store
        finally:
            if cache is not None:
                cache.close()
            if bar is not None:
                bar.close()
        if added and config.optimize_threshold is not None:
            after_ingest(self.stored, optimized=optimized > 0, threshold=config.optimize_threshold, settle=False)
        return added

    def add_batch(self, examples: Sequence[Example], *, store_text: Optional[int] = None) -> int:
        """Project, encode and store one batch in one commit."""
        rows = self.encode_rows(examples, store_text=store_text)
        self.store.add(rows)
        return rows.num_rows

    def block_cache(
        self, config: IngestConfig = IngestConfig(), *, worker: Optional[int] = None, workers: int = 1
    ) -> Optional[BlockCache]:
        """The cache of block ingest, or None for per-batch ingest: blocks when ``P`` does not stay
        in memory (:func:`~eogp_index.store.block_cache.block_documents`, sized by
        ``config.block_documents``). ``worker``: a torchrun worker's rank (its own cache), one of
        ``workers``. The caller closes it."""
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
        """:meth:`encode_rows` from the examples' projected coordinates ``(n, K)`` float32."""
        encoded = self.codec.encode(coordinates)
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
        return build_rows(info, encoded, schema=self.store.schema)

    # -- queries ----------------------------------------------------------------------------------
    def search(self, query: Union[Query, List[Query]], *, many: bool = False) -> InfluenceQuery:
        """A query builder: ``index.search(q).where(...).limit(k).direction("both").to_arrow()``.

        ``many=True`` takes a list of queries and answers each (``.to_list()``).
        """
        return InfluenceQuery(self, query, many=many)

    def top_influential(
        self,
        query: Query,
        k: int = 20,
        *,
        where: Optional[str] = None,
        direction: Literal["positive", "negative", "both"] = "positive",
        candidates: Optional[int] = None,
        stream: bool = False,
        by_module: bool = False,
        route: Literal["auto", "hot", "stream", "sharded", "candidates"] = "auto",
    ) -> pa.Table:
        """The ``k`` stored examples that most help (``positive``) or hurt (``negative``) the query.

        Args:
            where: SQL filter on the stored columns (LanceDB's); only matching rows are scored.
            candidates: score this many first-pass candidates per direction (``eogp build-candidates``)
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
        options = QueryOptions(
            k=k, where=where, direction=direction, route=route, candidates=candidates, by_module=by_module
        )
        return InfluenceQuery(self, query, options=options).to_arrow()

    def scores(self, queries: Sequence[Query], *, where: Optional[str] = None) -> tuple[List[str], np.ndarray]:
        """Exact scores of every stored row (matching ``where``): ids and ``(n_queries, n_rows)`` float32.

        Positive = training on the example lowers the query's loss (kronfluence's convention);
        for a preference query ``{"prompt", "chosen", "rejected"}``, raises the margin
        ``log p(chosen | prompt) - log p(rejected | prompt)`` (:meth:`query_coordinates`).
        """
        y = self.query_coordinates(queries)
        searcher = (
            TorchSearcher(self.stored, self.device) if self.device.startswith("cuda") else HotSearcher(self.stored)
        )
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

    def optimize(
        self,
        *,
        retention: Optional[timedelta] = DEFAULT_RETENTION,
        rebuild_hot: bool = True,
        target_rows: int = DEFAULT_TARGET_ROWS,
    ) -> OptimizeReport:
        """Compact the table, refresh its scalar indexes, remove versions older than ``retention``
        and rebuild the hot copy (``eogp optimize``; :func:`eogp_index.store.maintenance.optimize`).

        Ingest already does this past a fragment threshold; call it after writing the table by
        other means, or to drop old versions sooner.
        """
        return optimize(self.stored, retention=retention, rebuild_hot=rebuild_hot, target_rows=target_rows)


def _sized(stored: StoredIndex, model: nn.Module, gradients: GradientConfig) -> tuple[GradientConfig, Dict[str, Any]]:
    """``gradients`` with the batch (documents, at most ``gradients.batch_size``) that fits the
    memory budget for ingest and queries, as ``eogp plan INDEX`` chooses it, and what was chosen
    (the plan's ``batch``, with ``budget`` and ``budget_from``)."""
    from eogp_index.fit.plan import memory_budget, shape_of_model
    from eogp_index.store.index_plan import plan_of_index

    device = gradients.resolved_device()
    budget, budget_from = memory_budget(gradients.memory_budget_gb, device)
    shape = shape_of_model(model, stored.manifest.module_names, name=stored.manifest.model["name"])
    plan = plan_of_index(
        stored.path,
        shape=shape,
        batch_size=gradients.batch_size,
        memory_budget=budget,
        batch_tokens=gradients.batch_tokens,
        document_tokens=stored.manifest.max_tokens,
        projection_memory=_projection_memory(gradients),
        device="cpu" if device == "cpu" else "cuda",
    )
    sizing = {
        **plan.batch.to_json(),
        "budget": budget,
        "budget_from": budget_from,
        "p_resident": plan.projection_in_memory.resident,
    }
    return dataclasses.replace(gradients, batch_size=plan.batch.documents), sizing


def _in_dtype(model: nn.Module, dtype: Optional[str], gradients: GradientConfig) -> GradientConfig:
    """Cast ``model`` in place to ``dtype`` (``"auto"``/None: keep its own); ``gradients`` naming it."""
    if dtype not in (None, "auto"):
        model.to(torch_dtype(dtype))
    return dataclasses.replace(gradients, dtype=dtype_name(model))


def _projection_memory(gradients: GradientConfig) -> Optional[int]:
    """``gradients.projection_memory_gb`` in bytes; else half of ``memory_budget_gb`` (as ``eogp
    plan`` counts it); else None (the projection's own default)."""
    if gradients.projection_memory_gb is not None:
        return int(gradients.projection_memory_gb * (1 << 30))
    return None if gradients.memory_budget_gb is None else int(gradients.memory_budget_gb * 1e9) // 2


def _capped(text: str, max_bytes: int) -> Optional[str]:
    """``text`` if its UTF-8 fits ``max_bytes``; else None (never a cut document: explanations
    rebuild the document from it)."""
    return text if len(text.encode("utf-8")) <= max_bytes else None


def _bar(enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(desc="ingesting", unit="doc", dynamic_ncols=True)


def _fresh_commits(examples: Iterable[Example], stored: StoredIds, size: int, bar) -> Iterator[List[Example]]:
    """The examples not stored yet, ``size`` at a time (the last commit may be smaller).

    Raises:
        InputError: an id already stored from another shard or position.
    """
    fresh: List[Example] = []
    for ex in examples:
        if bar is not None:
            bar.update(1)
        status, where = stored.lookup(ex)
        if status == "other":
            raise InputError(
                f"duplicate id {ex.id!r}: already stored from {where}; ids must be unique",
                location=f"{ex.shard}:{ex.position}" if ex.shard else None,
            )
        if status == "absent":
            fresh.append(ex)
            stored.remember([ex])  # a repeat later in this call is then a rerun, not a new row
        if len(fresh) == size:
            yield fresh
            fresh = []
    if fresh:
        yield fresh


def _adapter_entry(model: nn.Module, adapter: Optional[str]) -> Optional[Dict[str, str]]:
    """The manifest's record of ``model``'s LoRA adapter, loaded from ``adapter``: ``{"path", "fingerprint"}``.

    Raises:
        ConfigError: the model has LoRA layers and no adapter directory is given, or the reverse.
    """
    fingerprint = adapter_fingerprint(model)
    if (fingerprint is None) != (adapter is None):
        raise ConfigError(
            "the model has LoRA layers but no adapter directory was given: pass adapter=<the directory it was "
            "loaded from>, so that the index can reload it"
            if adapter is None
            else f"adapter={adapter!r} was given but the model has no LoRA layers: load it with "
            "eogp_index.gradients.model.load_model(base, adapter=...)"
        )
    return None if fingerprint is None else {"path": str(adapter), "fingerprint": fingerprint}
