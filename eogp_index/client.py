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

import copy
import dataclasses
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Literal, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
from torch import nn

from eogp_index.config import (
    CurvatureConfig,
    GradientConfig,
    IngestConfig,
    ModelDtype,
    ProjectionConfig,
    ScorePrecision,
    StorageConfig,
    check_score_precision,
)
from eogp_index.data.location import index_path
from eogp_index.data.readers import is_dataset_object
from eogp_index.data.records import Example
from eogp_index.encode.commits import Commits, index_lock
from eogp_index.encode.encoder import Encoder
from eogp_index.encode.measurements import Measured
from eogp_index.errors import ConfigError, IncompatibleIndexError, InputError
from eogp_index.fit.fitting import check_checkpoint, fit_projection
from eogp_index.gradients.experts import make_experts_trackable
from eogp_index.gradients.model import (
    adapter_fingerprint,
    dtype_name,
    freeze,
    hard_context_length,
    load_indexed_model,
    model_fingerprint,
    model_sha256,
    replace_conv1d,
    shared_weights_copy,
    torch_dtype,
)
from eogp_index.search.explain import Explanation, explain_documents
from eogp_index.search.query import InfluenceQuery, Query
from eogp_index.search.question import Question, check_checkpoint_weights, check_question
from eogp_index.search.searchers import HotSearcher, TorchSearcher, warm_kernels
from eogp_index.search.select import (
    Selection,
    SelectOptions,
    require_tier,
    scored_batches,
    select_documents,
    target_coordinates,
    write_selection,
)
from eogp_index.search.takedown import TakedownReport
from eogp_index.search.takedown import delete as delete_documents
from eogp_index.store.block_cache import BlockCache
from eogp_index.store.deletions import deleted_set
from eogp_index.store.maintenance import (
    DEFAULT_RETENTION,
    DEFAULT_TARGET_ROWS,
    OptimizeReport,
    optimize,
)
from eogp_index.store.manifest import check_compatible, open_dtype
from eogp_index.store.stored_ids import StoredIds
from eogp_index.store.stored_index import CHECKPOINTS_DIR, StoredIndex, prepare_index_dir


class _EncoderPart:
    """An attribute of :class:`AttributionIndex` that is its encoder's (read and set there)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, index, owner=None):
        return self if index is None else getattr(index.encoder, self.name)

    def __set__(self, index, value) -> None:
        setattr(index.encoder, self.name, value)


class AttributionIndex:
    """An EOGP attribution index with its model loaded: a directory (or an object-store URL,
    ``s3://bucket/prefix``) with a manifest, a projection and a LanceDB table
    (:class:`StoredIndex`), plus the model and tokenizer that project texts,
    held by its :class:`~eogp_index.encode.encoder.Encoder` (``index.encoder``, what
    :mod:`eogp_index.search` is given). The encoder's parts (:data:`ENCODER_PARTS`: ``stored``,
    ``model``, ``tokenizer``, ``gradients``, ``device``, ``manifest``, ...) are the index's too."""

    def __init__(
        self,
        stored: Union[StoredIndex, str, Path],
        model: Optional[nn.Module] = None,
        tokenizer=None,
        *,
        gradients: GradientConfig = GradientConfig(),
        checkpoint_models: Sequence[nn.Module] = (),
    ):
        if not isinstance(stored, StoredIndex):  # a directory or URL: what open() makes of it
            self.__dict__.update(
                type(self).open(stored, model=model, tokenizer=tokenizer, gradients=gradients).__dict__
            )
            return
        #: The stored index with its model: projection, rows and query measurements (``search/`` takes it).
        self.encoder = Encoder(stored, model, tokenizer, gradients, checkpoint_models)
        #: The batch :meth:`open` chose for the memory budget (``eogp plan INDEX``'s), or None.
        self.sizing: Optional[Dict[str, Any]] = None

    def __copy__(self) -> "AttributionIndex":
        # The encoder's parts are set on the encoder: a copy whose parts are replaced must not
        # change the original's, so it gets an encoder of its own (over the same parts).
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.encoder = copy.copy(self.encoder)
        return other

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
        checkpoints: Sequence[tuple] = (),
        checkpoint_weights: Optional[Sequence[float]] = None,
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
            checkpoints: an ensemble (docs/ensembles.md): ``(name, model)`` of each further
                checkpoint of the same training run, ``model`` being the first. Each is fitted
                (its own curvature and projection) on the same fitting documents, into
                ``checkpoints/<j>/``; every row stores each checkpoint's code and a score is
                ``Σ_c w_c · score_c``. Refused unless every checkpoint has ``model``'s architecture
                and attributed modules (:func:`~eogp_index.fit.fitting.check_checkpoint`).
            checkpoint_weights: with ``checkpoints``, each checkpoint's default weight ``w_c``
                (``C`` finite numbers; default ``1/C`` each, the mean); a query's
                ``checkpoint_weights`` replace them.

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
        path = index_path(path)
        others = _checkpoint_models(model, model_name, checkpoints, checkpoint_weights, adapter)
        model = shared_weights_copy(model)  # the fit prepares the index's own module objects, not the caller's
        gradients = _in_dtype(model, dtype or gradients.dtype, gradients)
        weights_fingerprint = model_fingerprint(model)
        adapter_entry = _adapter_entry(model, adapter)
        fit_options = dict(
            modules=modules, curvature=curvature, projection=projection, storage=storage, gradients=gradients
        )
        members = _fit_checkpoints(others, tokenizer, examples, path, fit_options, progress)
        fitted = fit_projection(model, tokenizer, examples, path, progress=progress, **fit_options)
        if rank == 0:
            stored = StoredIndex.create(
                path,
                fitted,
                model_name=model_name,
                tokenizer_name=getattr(tokenizer, "name_or_path", None),
                precision=storage.precision,
                damping_ratio=curvature.damping_ratio,
                max_tokens=gradients.max_tokens,
                curvature=_curvature_entry(fitted, curvature),
                table_uri=table_uri,
                weights_fingerprint=weights_fingerprint,
                adapter=adapter_entry,
                experts=gradients.experts,
                model_dtype=gradients.dtype,
                tier=storage.tier,
                members=members,
                weights=checkpoint_weights,
            )
        if distributed:
            dist.barrier()  # every rank is done with the fit's files
        for fit in [fitted, *(member["fitted"] for member in members)]:
            if rank == 0 and fit.folder is not None:
                fit.folder.finish()  # the cached coordinates and per-module P are in the projection now
        if rank != 0:
            stored = StoredIndex.open(path)
        stored.projection_memory = _projection_memory(gradients)
        for fitted_model in [model, *(member["model"] for member in members)]:
            freeze(fitted_model)  # fitting is done: from here on only output gradients are needed
        return cls(stored, model, tokenizer, gradients=gradients, checkpoint_models=[m["model"] for m in members])

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
        for j in range(stored.manifest.num_checkpoints):  # loads and checks the projections before the models
            stored.checkpoint_projection(j)
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
                where=str(stored.path) if stored.manifest.checkpoints is None else f"{stored.path} (checkpoint 0)",
            )
        else:  # written before fingerprints: the full hash
            check_compatible(stored.manifest, model_hash=model_sha256(model), where=str(stored.path))
        others = _open_checkpoints(stored, model_dtype, gradients.resolved_device())
        for prepared in [model, *others]:
            replace_conv1d(prepared)
            make_experts_trackable(prepared, dense=stored.manifest.model.get("experts") == "dense")  # as the fit did
            freeze(prepared)
            prepared.to(gradients.resolved_device()).eval()
        gradients, sizing = _sized(stored, model, gradients)
        index = cls(stored, model, tokenizer, gradients=gradients, checkpoint_models=others)
        index.sizing = sizing
        return index

    # -- gradients (the encoder's) ----------------------------------------------------------------
    def project(self, examples: Sequence[Example], *, progress: bool = False) -> np.ndarray:
        """Unquantized projected coordinates ``(n, K)`` float32, modules concatenated in order."""
        return self.encoder.project(examples, progress=progress)

    def query_examples(self, queries: Sequence[Query]) -> List[Example]:
        """Tokenize queries (texts, chats, ids or record dicts) as training records are tokenized.

        A preference query (two texts) has no single example: :meth:`query_coordinates` takes it.
        """
        return self.encoder.query_examples(queries)

    def measure(self, queries: Sequence[Query], *, max_query_tokens: Optional[int] = None) -> Measured:
        """Every query that measures, as coordinates ``(n_answered, K)`` from one gradient pass, and
        the error of each one that does not (:func:`eogp_index.encode.measurements.measure`)."""
        return self.encoder.measure(queries, max_query_tokens=max_query_tokens)

    def query_coordinates(self, queries: Sequence[Query]) -> np.ndarray:
        """Projected, unquantized query coordinates ``(n_queries, K)`` float32.

        A preference query ``{"prompt", "chosen", "rejected"}`` measures
        ``loss(chosen | prompt) - loss(rejected | prompt)``: its coordinates are the chosen
        completion's minus the rejected one's (scores are linear in them), so a positive score
        means training on the document raises ``log p(chosen | prompt) - log p(rejected | prompt)``.

        Raises:
            InputError: the first query that does not measure (:meth:`measure` answers the others).
        """
        return self.encoder.query_coordinates(queries)

    # -- storing ----------------------------------------------------------------------------------
    def ingest(self, examples: Iterable[Example], config: Optional[IngestConfig] = None, **options: Any) -> int:
        """Store examples not stored yet; returns the rows added.

        An id already stored from the same shard and position is skipped (a rerun), and so is an
        example a takedown deleted (:meth:`delete`; unless ``allow_deleted``); the same id
        from elsewhere is an :class:`InputError`, as in ``eogp ingest`` (same rule:
        :class:`~eogp_index.store.stored_ids.StoredIds`). For shards, rejects and scale-out use
        ``ingest.run_ingest`` (``eogp ingest``), which also records where each shard lives.
        Like it, commits the new examples in batches (one gradient batch each by default), or, when
        ``P`` does not stay in memory, in blocks with each module's ``P`` read once per block
        (:meth:`block_cache`: resumable after a kill, as ``eogp ingest``); compacts the table past
        the fragment threshold and ends with the hot copy up to date
        (:mod:`eogp_index.store.maintenance`). The commits are :class:`~eogp_index.encode.commits.Commits`'
        loop, under the index's ingest lock (:func:`~eogp_index.encode.commits.index_lock`).

        Args:
            config: the :class:`~eogp_index.config.IngestConfig` (default: its defaults). Its
                ``batch_size``, ``block_documents``, ``store_text``, ``optimize_threshold``,
                ``allow_deleted`` and ``progress`` apply here; the shard options (``spec``, ``on_error="skip"``,
                ``rejects_path``, ``shard_root``) and ``commit_every`` are refused.
            options: fields of ``config`` to replace, e.g. ``store_text=4096, progress=False``.

        Raises:
            ConfigError: another ingest (``eogp ingest``, another process's ``ingest``) is writing
                to the index: run again once it is done, to store what it did not.
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
        commits = Commits(self.encoder, config, default_rows=self.gradients.batch_size)
        bar = _bar(config.progress)
        try:
            with index_lock(self.path):  # beside `eogp ingest` or another process: one writer at a time
                self.stored.agree_store_text(store_text)
                if self.manifest.has_content_hashes and store_text is not None:
                    self.stored.sources.save()
                # read under the lock: what another writer stored (or a takedown deleted) is seen
                stored = StoredIds(self.store, deleted=deleted_set(self.path, allow_deleted=config.allow_deleted))
                commits.run(_fresh_commits(examples, stored, commits.rows_per_commit, bar))
                commits.finish(settle=False)
        finally:
            commits.close()
            if bar is not None:
                bar.close()
        return commits.stored

    def add_batch(self, examples: Sequence[Example], *, store_text: Optional[int] = None) -> int:
        """Project, encode and store one batch in one commit."""
        rows = self.encode_rows(examples, store_text=store_text)
        self.store.add(rows)
        return rows.num_rows

    def block_cache(
        self, config: IngestConfig = IngestConfig(), *, worker: Optional[int] = None, workers: int = 1
    ) -> Optional[BlockCache]:
        """:meth:`Encoder.block_cache <eogp_index.encode.encoder.Encoder.block_cache>`: block
        ingest's cache, or None for per-batch ingest. The caller closes it."""
        return self.encoder.block_cache(config, worker=worker, workers=workers)

    def encode_rows(self, examples: Sequence[Example], *, store_text: Optional[int] = None) -> pa.Table:
        """The Arrow rows of a batch, ready for :meth:`Store.add`; ``store_text``: keep each
        document's text up to this many UTF-8 bytes (:meth:`Encoder.encode_rows
        <eogp_index.encode.encoder.Encoder.encode_rows>`)."""
        return self.encoder.encode_rows(examples, store_text=store_text)

    # -- queries ----------------------------------------------------------------------------------
    def search(self, query: Union[Query, List[Query], Question], *, many: bool = False) -> InfluenceQuery:
        """A query builder: ``index.search(q).where(...).limit(k).direction("both").to_arrow()``.

        ``many=True`` takes a list of queries and answers each (``.to_list()``); a
        :class:`~eogp_index.search.question.Question` is answered as it is.
        """
        if isinstance(query, Question):
            return InfluenceQuery(self.encoder, question=query)
        return InfluenceQuery(self.encoder, query, many=many)

    def top_influential(
        self,
        query: Union[Query, Question],
        k: int = Question.k,
        *,
        where: Optional[str] = None,
        direction: Literal["positive", "negative", "both"] = Question.direction,
        candidates: Optional[int] = None,
        stream: bool = False,
        by_module: bool = False,
        route: Literal["auto", "hot", "stream", "sharded", "candidates"] = "auto",
    ) -> pa.Table:
        """The ``k`` stored examples that most help (``positive``) or hurt (``negative``) the query,
        or both sides (``both``, the default); the defaults are :class:`Question`'s.

        Args:
            query: one query, or a :class:`Question` (then the other arguments must be left out).
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
        if isinstance(query, Question):
            return InfluenceQuery(self.encoder, question=query).to_arrow()
        if stream:
            route = "stream"
        question = Question(
            queries=(query,),
            k=k,
            where=where,
            direction=direction,
            route=route,
            candidates=candidates,
            by_module=by_module,
        )
        return InfluenceQuery(self.encoder, question=question).to_arrow()

    def scores(
        self,
        queries: Union[Sequence[Query], Question],
        *,
        where: Optional[str] = None,
        precision: ScorePrecision = SelectOptions.precision,
    ) -> tuple[List[str], np.ndarray]:
        """Exact scores of every stored row (matching ``where``): ids and ``(n_queries, n_rows)`` float32.

        Positive = training on the example lowers the query's loss (kronfluence's convention);
        for a preference query ``{"prompt", "chosen", "rejected"}``, raises the margin
        ``log p(chosen | prompt) - log p(rejected | prompt)`` (:meth:`query_coordinates`).
        A :class:`Question` gives the queries, its ``where`` and its ``normalize``.
        ``precision``: ``1bit`` scores the code the queries scan (from the hot copy);
        ``rescore`` every row from the rescoring tier, streamed from the table in table order
        (:attr:`SelectOptions.precision <eogp_index.config.SelectOptions>`).
        """
        question = queries if isinstance(queries, Question) else Question(queries=tuple(queries), where=where)
        check_question(question, self.stored)
        check_score_precision(precision)
        if precision == "rescore":
            return self._tier_scores(question)
        y = self.stored.weigh(self.query_coordinates(list(question.queries)), question.checkpoint_weights)
        normalize = question.normalize
        searcher = (
            TorchSearcher(self.stored, self.device, normalize=normalize)
            if self.device.startswith("cuda")
            else HotSearcher(self.stored, normalize=normalize)
        )
        rowaddr, scores = searcher.scores(y, question.where)
        ids = self.stored.rows(rowaddr, ["id"]).column("id").to_pylist() if rowaddr.size else []
        return ids, scores

    def _tier_scores(self, question: Question) -> tuple[List[str], np.ndarray]:
        """:meth:`scores` from the rescoring tier: the table streamed batch by batch."""
        require_tier(self.stored)  # before the queries are measured
        y = target_coordinates(self.encoder, question.queries, "rescore", question.checkpoint_weights)
        ids: List[str] = []
        parts = [np.zeros((y.shape[0], 0), np.float32)]
        batches = scored_batches(
            self.stored, y, where=question.where, columns=["id"], normalize=question.normalize, precision="rescore"
        )
        for batch, scores in batches:
            ids.extend(batch.column("id").to_pylist())
            parts.append(scores)
        return ids, np.concatenate(parts, axis=1)

    def select(
        self,
        question: Union[Sequence[Query], Question],
        options: SelectOptions = SelectOptions(),
        *,
        out: Union[str, Path, None] = None,
    ) -> Selection:
        """The documents most influential for a target set (``eogp select``): the question's
        queries, ``where`` and ``normalize``, ``options``' share and rule; written to ``out``
        (.jsonl, .jsonl.gz or .parquet: the records with their scores) when given."""
        selection = select_documents(self.encoder, question, options)
        if out is not None:
            write_selection(self.stored, selection, index_path(out))
        return selection

    def explain(self, query: Union[Query, Question], example_id: str) -> Explanation:
        """Why ``example_id`` ranks for ``query`` (or a :class:`Question`'s one query): its score by
        module, its tokens' and the query's tokens' contributions (:mod:`eogp_index.search.explain`)."""
        return explain_documents(self.encoder, _one_query(query), [example_id])[0]

    def explain_many(self, query: Union[Query, Question], example_ids: Sequence[str]) -> List[Explanation]:
        """:meth:`explain` for several documents (e.g. a query's top 10) in one batched pass."""
        return explain_documents(self.encoder, _one_query(query), list(example_ids))

    def hot_codes(self):
        """The in-memory copy of the stored codes, refreshed when the table has changed."""
        return self.stored.hot_codes()

    def info(self) -> Dict[str, Any]:
        """The manifest plus live facts: row count, table version, path."""
        return self.stored.info()

    def delete(
        self,
        *,
        where: Optional[str] = None,
        ids: Optional[Sequence[str]] = None,
        reason: Optional[str] = None,
        purge: bool = False,
    ) -> TakedownReport:
        """Take documents down: delete the rows matching ``where`` (SQL over the stored columns) or
        with ``ids`` from every answer, record each id, its content hash, the time and ``reason``
        in ``deletions.jsonl`` (a later ingest of the same record is skipped), and with ``purge``
        erase them from every file of the index (``eogp delete``;
        :func:`eogp_index.search.takedown.delete`, which says what each step does).

        Returns:
            A :class:`~eogp_index.search.takedown.TakedownReport`.

        Raises:
            ConfigError: both ``where`` and ``ids``, or an ingest is writing to the index.
            InputError: a bad filter or id, or nothing to delete.
        """
        return delete_documents(self.stored, where=where, ids=ids, reason=reason, purge=purge)

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


def _one_query(query: Union[Query, Question]) -> Query:
    """The query a :class:`Question` of one query asks (an explanation is of one query); else ``query``."""
    if not isinstance(query, Question):
        return query
    if len(query.queries) != 1:
        raise ConfigError(f"an explanation is of one query; this question holds {len(query.queries)}", field="queries")
    return query.queries[0]


#: The encoder's parts, attributes of the index itself too: ``index.model`` is ``index.encoder.model``
#: (set there as well), ``index.manifest`` the stored index's.
ENCODER_PARTS = (
    "stored",
    "model",
    "tokenizer",
    "gradients",
    "device",
    "path",
    "manifest",
    "store",
    "layout",
    "codec",
    "projection",
)
for _part in ENCODER_PARTS:
    setattr(AttributionIndex, _part, _EncoderPart(_part))


def _sized(stored: StoredIndex, model: nn.Module, gradients: GradientConfig) -> tuple[GradientConfig, Dict[str, Any]]:
    """``gradients`` with the batch (documents, at most ``gradients.batch_size``) that fits the
    memory budget for ingest and queries, as ``eogp plan INDEX`` chooses it, and what was chosen
    (the plan's ``batch``, with ``budget`` and ``budget_from``)."""
    from eogp_index.fit.plan import memory_budget, shape_of_model
    from eogp_index.store.index_plan import plan_of_index

    device = gradients.resolved_device()
    budget, budget_from = memory_budget(gradients.memory_budget_gb, device)
    names = [m.name for m in stored.manifest.checkpoint_modules(0)]  # (an ensemble: each checkpoint's)
    shape = shape_of_model(model, names, name=stored.manifest.model["name"])
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
        if status == "absent":  # ("deleted": taken down, skipped)
            fresh.append(ex)
            stored.remember([ex])  # a repeat later in this call is then a rerun, not a new row
        if len(fresh) == size:
            yield fresh
            fresh = []
    if fresh:
        yield fresh


def _curvature_entry(fitted, curvature: CurvatureConfig) -> Dict[str, Any]:
    """The manifest's ``curvature``: the settings of the fit's curvature."""
    return {
        "num_examples": fitted.curvature_examples,
        "seed": curvature.seed,
        "batch_size": curvature.batch_size,
        "factors_dir": "curvature",
        "fitting_set": "fit/fitting_set.json",
        "disjoint_from_pca": fitted.disjoint,
    }


def _fit_checkpoints(others, tokenizer, examples, path, fit_options: Dict[str, Any], progress: bool) -> List[dict]:
    """An ensemble's further checkpoints, each fitted (its own curvature and projection) on the
    same documents into ``checkpoints/<j>/``: ``{"fitted", "name", "fingerprint", "model"}`` each."""
    members = []
    for j, (name, other) in enumerate(others, 1):
        _in_dtype(other, fit_options["gradients"].dtype, fit_options["gradients"])
        fingerprint = model_fingerprint(other)  # of the weights as loaded, as the first checkpoint's
        fit = fit_projection(
            other, tokenizer, examples, path / CHECKPOINTS_DIR / str(j), progress=progress, **fit_options
        )
        members.append({"fitted": fit, "name": name, "fingerprint": fingerprint, "model": other})
    return members


def _checkpoint_models(model, model_name, checkpoints, weights, adapter) -> List[tuple]:
    """An ensemble's further checkpoints as ``(name, the index's own copy of the model)``, each
    checked against ``model`` (:func:`~eogp_index.fit.fitting.check_checkpoint`); the weights
    checked for their count."""
    if not checkpoints:
        if weights is not None:
            raise ConfigError("checkpoint_weights weigh an ensemble's checkpoints; give checkpoints too")
        return []
    if adapter is not None:
        raise ConfigError("an ensemble of checkpoints with a LoRA adapter is not supported; merge the adapters first")
    if weights is not None:
        check_checkpoint_weights(weights, 1 + len(checkpoints))
    out = []
    for name, other in checkpoints:
        check_checkpoint(model, other, first_name=model_name, name=name)
        out.append((name, shared_weights_copy(other)))
    return out


def _open_checkpoints(stored: StoredIndex, dtype: str, device: str) -> List[nn.Module]:
    """An ensemble's models of checkpoints 1, 2, ... loaded from the manifest's names, each checked
    by its fingerprint (an empty list for one checkpoint).

    Raises:
        IncompatibleIndexError: a checkpoint whose weights changed, naming it.
    """
    models = []
    for j, entry in enumerate(stored.manifest.checkpoints or [], 0):
        if j == 0:
            continue
        loaded, _ = load_indexed_model({"name": entry["name"]}, None, device=device, dtype=dtype)
        found = model_fingerprint(loaded)
        if found != entry["weights_fingerprint"]:
            raise IncompatibleIndexError(
                f"{stored.path}: checkpoint {j} ({entry['name']!r}) has weights fingerprint {found[:20]}… but the "
                f"index was built with {entry['weights_fingerprint'][:20]}…: that checkpoint changed since, and "
                "scores would be wrong. Restore it, or build a new index"
            )
        models.append(loaded)
    return models


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
