"""An index directory opened without its model: manifest, table, codec, hot copy, projection on demand.

Listing rows, reading metadata, indexing columns and reporting ``eogp info`` need no weights and
no torch. :class:`~eogp_index.client.AttributionIndex` adds the model (and the gradients it
takes to project a query) on top of one of these.

Example:
    >>> stored = StoredIndex.open("my-index")  # doctest: +SKIP
    >>> stored.info()["rows"]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from eogp_index.data.location import IndexPath, index_path, is_remote, local_cache_dir, remove_tree
from eogp_index.data.records import Example, RecordSpec, location_of, record_of, tokenize_windows
from eogp_index.errors import ConfigError, IncompatibleIndexError, InputError
from eogp_index.store.codecs import Codec, SignLayout, TierCodec, codec_for, prefix_columns, tier_for
from eogp_index.store.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    PROJECTION_FILE,
    TABLE_NAME,
    TIER_FORMAT_VERSION,
    Manifest,
    ModuleEntry,
    check_compatible,
    prefixed,
)
from eogp_index.store.sources import Sources
from eogp_index.store.stored_ids import sql_string
from eogp_index.store.table import Store

HOT_DIR = "hot"
#: An ensemble's checkpoints j >= 1: checkpoints/<j>/ (projection, curvature, a fit's stages).
CHECKPOINTS_DIR = "checkpoints"
#: The fit's stages (eogp_index.fit.cache); present without a manifest = an interrupted fit.
FIT_DIR = "fit"


def _record_from_text(text: str, kind: str, spec: RecordSpec) -> Dict[str, Any]:
    """The record a stored text came from: the text itself, or the chat / ids stored as JSON."""
    if kind == "text":
        return record_of({"text": text}, spec)
    value = json.loads(text)
    return record_of({"messages": value} if kind == "chat" else value, spec)


def _read_record(uri: str, shard: str, position: int) -> Dict[str, Any]:
    """Record ``position`` of the shard at ``uri``, streamed from its start."""
    from eogp_index.data.readers import iter_raw_records

    try:
        for raw in iter_raw_records(uri, shard=shard):
            if raw.position == position:
                if not isinstance(raw.record, dict):
                    break
                return raw.record
            if raw.position > position:
                break
    except (InputError, OSError) as exc:
        raise InputError(
            f"shard {shard!r} can no longer be read at {uri} ({exc}); restore it there, or ingest "
            "with --store-text so that explanations do not need the shard"
        ) from exc
    raise InputError(
        f"shard {shard!r} at {uri} no longer has a record at {location_of(shard, position)}; it "
        "changed since ingest. Restore it as it was"
    )


def check_index_dir(path: Union[str, Path], mode: str = "create") -> None:
    """Refuse to create an index at ``path`` when one is finished there (``mode="create"``); cheap,
    so that ``eogp fit`` says so before it loads the model."""
    if mode not in ("create", "overwrite"):
        raise ConfigError(f"mode must be 'create' or 'overwrite', got {mode!r}")
    if mode == "create" and (index_path(path) / MANIFEST_FILE).exists():
        raise ConfigError(f"{path} already holds an index; pass mode='overwrite' (--overwrite) to replace it")


def prepare_index_dir(path: Union[str, Path], *, table_uri: Optional[str] = None, mode: str = "create") -> IndexPath:
    """Make ``path`` ready for a new index.

    ``mode="create"`` refuses a finished index (one with a manifest). A directory with a ``fit/``
    folder but no manifest holds an interrupted fit: it is kept, and the fit resumes from it
    (:mod:`eogp_index.fit.cache` checks that the settings match). ``mode="overwrite"`` removes
    an index or an interrupted fit, and the table at ``table_uri``. ``path`` may be an
    object-store URL (:mod:`eogp_index.data.location`); a URL no layer reads is refused.
    """
    path = index_path(path)
    check_index_dir(path, mode)
    if (path / MANIFEST_FILE).exists() or (path / FIT_DIR).is_dir():
        if mode == "overwrite":
            remove_tree(path)
            if is_remote(path):  # the hot copy and block cache of the index replaced
                shutil.rmtree(local_cache_dir(path), ignore_errors=True)
    if table_uri is not None:
        remote = Store(table_uri, TABLE_NAME)
        if remote.table is not None:
            if mode != "overwrite":
                raise ConfigError(
                    f"{table_uri} already holds a table {TABLE_NAME!r}; pass mode='overwrite' "
                    "(--overwrite) to replace it or choose another --table-uri"
                )
            remote.drop()
    path.mkdir(parents=True, exist_ok=True)
    return path


class StoredIndex:
    """The on-disk parts of an index.

    Attributes:
        path: the index directory. manifest: its parsed ``manifest.json``.
        store: the LanceDB table. codec: how its rows encode coordinates (one per precision).
    """

    def __init__(self, path: Union[str, Path], manifest: Manifest):
        #: the index directory: a ``Path``, or a :class:`~eogp_index.data.location.RemotePath`
        self.path = index_path(path)
        #: where the parts that must be on a local disk live (the hot copy, block ingest's cache):
        #: the index directory, or a local cache folder for a remote index
        self.cache_dir = local_cache_dir(self.path)
        self.manifest = manifest
        self.layout = SignLayout(manifest.k)
        #: the index's coordinates per module: what the projection outputs and queries are
        #: projected to, the rescoring tier's (``manifest.tier_k``); the one-bit code keeps the
        #: first ``layout.k[u]`` of each module's (:meth:`one_bit`)
        self.coordinates = SignLayout(manifest.tier_k)
        if any(t < k for t, k in zip(self.coordinates.k, self.layout.k)) or len(self.coordinates.k) != len(
            self.layout.k
        ):
            raise IncompatibleIndexError(
                f"{self.path / MANIFEST_FILE}: tier.k {list(self.coordinates.k)} must give every module at least "
                f"its k {list(self.layout.k)}; the manifest is damaged. Rebuild the index with `eogp fit --overwrite`."
            )
        parts = manifest.checkpoint_parts  # an ensemble's modules per checkpoint: a code column each
        self.codec: Codec = codec_for(manifest.precision, self.layout, parts)
        #: the rescoring tier's codec (formats 3 and 4), or None: the index has no tier
        self.tier: Optional[TierCodec] = tier_for(
            manifest.tier_code, self.coordinates, parts, record=manifest.tier_records
        )
        self.store = Store(manifest.store_uri(self.path), manifest.table)
        self._hot = None

    def one_bit(self, y):
        """The one-bit code's coordinates ``(n, K)`` of the index's coordinates ``y``
        ``(n, T)`` (:attr:`coordinates`): the first ``k_u`` of each module's. ``y`` already
        ``(n, K)``, or an index whose tier has the one-bit code's coordinates: ``y`` itself."""
        return prefix_columns(y, self.coordinates, self.layout)

    def weigh(self, y, weights: Optional[Sequence[float]] = None):
        """Query coordinates ``y`` ``(n, T)`` (or ``(n, K)``) with each checkpoint's part times its
        weight (``weights``: one per checkpoint; None: the manifest's), so that the one scan of the
        combined codes scores ``Σ_c w_c · score_c`` exactly. An index of one checkpoint without
        ``weights``: ``y`` itself."""
        import numpy as np

        manifest = self.manifest
        if weights is None:
            if manifest.checkpoints is None:
                return y
            weights = manifest.checkpoint_weights
        y = np.asarray(y, np.float32)
        layout = self.coordinates if y.shape[1] == self.coordinates.num_coords else self.layout
        parts = manifest.checkpoint_parts or (layout.num_modules,)
        factors = np.repeat(
            np.repeat(np.asarray(weights, np.float32), parts), layout.k
        )  # (T,): a weight per coordinate
        return y * factors[None, :]

    @classmethod
    def open(cls, path: Union[str, Path]) -> "StoredIndex":
        """Read and validate the manifest; loads no model and imports no torch."""
        return cls(path, Manifest.load(index_path(path)))

    @classmethod
    def create(
        cls,
        path: Union[str, Path],
        fitted,
        *,
        model_name: str,
        tokenizer_name: Optional[str],
        precision: str,
        damping_ratio: float,
        curvature: Dict[str, Any],
        max_tokens: Optional[int],
        table_uri: Optional[str] = None,
        weights_fingerprint: Optional[str] = None,
        adapter: Optional[Dict[str, str]] = None,
        experts: str = "fused",
        model_dtype: str = "float32",
        tier: Optional[str] = None,
        members: Sequence[Dict[str, Any]] = (),
        weights: Optional[Sequence[float]] = None,
    ) -> "StoredIndex":
        """Write a fitted projection and its manifest into ``path`` (prepared by :func:`prepare_index_dir`).

        Args:
            fitted: a :class:`~eogp_index.fit.fitting.FittedProjection`.
            model_name: what :meth:`AttributionIndex.open` reloads the model from; a local
                directory is recorded absolute, so the index opens from any working directory.
            curvature: the curvature settings recorded in the manifest.
            weights_fingerprint: the model's sampled fingerprint
                (:func:`~eogp_index.gradients.model.model_fingerprint`, taken where
                ``fitted.weights_sha256`` was), checked on open instead of the full hash; without
                it, opening hashes every weight.
            adapter: a LoRA adapter on the base ``model_name``: ``{"path", "fingerprint"}``
                (:func:`~eogp_index.gradients.model.adapter_fingerprint`); its path is recorded absolute.
            experts: ``"dense"`` when fused experts were rebuilt as linear layers
                (:mod:`eogp_index.gradients.experts`), recorded so that opening rebuilds them.
            model_dtype: the dtype the model ran in (``"bfloat16"``), which every later open uses.
            tier: the rescoring tier's code (``StorageConfig.tier``: ``"int8"``, ``"int4"``,
                ``"fp16"``) or None for none; an index with a tier is format 3, one without it 2.
            members: an ensemble's checkpoints after the first (``fitted`` and ``model_name``'s):
                ``{"fitted", "name", "fingerprint"}`` each, fitted on the same documents into
                ``checkpoints/<j>/`` (docs/ensembles.md); empty: one checkpoint, written as before.
            weights: with ``members``, each checkpoint's default weight (default: ``1/C`` each).
        """
        from eogp_index.fit.code_choice import fidelity_record
        from eogp_index.store.files import file_fingerprint
        from eogp_index.store.projection_file import save_projection
        from eogp_index.version import __version__

        path = index_path(path)
        projection = fitted.projection
        proj_hash = save_projection(projection, path / PROJECTION_FILE)
        fits = [fitted, *(member["fitted"] for member in members)]
        layout = SignLayout(tuple(k for f in fits for k in f.projection.k))
        coordinates = SignLayout(tuple(k for f in fits for k in f.projection.tier_k))
        model_entry = {
            "name": _model_name(model_name),
            "weights_sha256": fitted.weights_sha256,
            "num_parameters": fitted.num_parameters,
            "tokenizer": tokenizer_name,
            "dtype": model_dtype,
        }
        if weights_fingerprint is not None:
            model_entry["weights_fingerprint"] = weights_fingerprint
        if experts != "fused":
            model_entry["experts"] = experts
        if adapter is not None:
            model_entry["adapter"] = {
                "path": str(Path(adapter["path"]).resolve()),
                "fingerprint": adapter["fingerprint"],
            }
        projection_entry = {
            "file": PROJECTION_FILE,
            "sha256": proj_hash,
            "variant": projection.config.variant,
            "seed": projection.config.seed,
            "num_fit_examples": fitted.pca_examples,
            "pca_dtype": projection.config.pca_dtype,
            "rotation": projection.rotation_record(),
            "fingerprint": file_fingerprint(path / PROJECTION_FILE),
        }
        fidelity = fidelity_record(projection.choices, fitted.recall)
        if fidelity is not None:
            projection_entry["fidelity"] = fidelity
        checkpoints = _checkpoint_entries(
            path, fitted, model_name, weights_fingerprint, projection_entry, members, weights
        )
        manifest = Manifest(
            model=model_entry,
            projection=projection_entry,
            modules=[
                ModuleEntry(name=prefixed(n, j), d_out=p.shape[0], d_in=p.shape[1], m=p.m, k=p.k, damping=p.damping)
                for j, f in enumerate(fits)
                for n, p in f.projection.modules.items()
            ],
            precision=precision,
            damping_ratio=damping_ratio,
            bytes_per_example=codec_for(precision, layout).bytes_per_example,  # type: ignore[arg-type]
            curvature=curvature,
            max_tokens=max_tokens,
            table=TABLE_NAME,
            table_uri=table_uri,
            created_by=f"eogp-index {__version__}",
            format_version=FORMAT_VERSION if tier is None else TIER_FORMAT_VERSION,
            tier=None if tier is None else _tier_entry(tier, layout, coordinates),
            checkpoints=checkpoints,
        )
        manifest.save(path)
        queries = [getattr(f, "held_out_queries", None) for f in fits]
        if tier is not None and all(q is not None for q in queries):
            import numpy as np

            from eogp_index.store.table_recall import save_queries

            # an ensemble's queries as a query is scanned: each checkpoint's part times its weight
            weighted = [q * w for q, w in zip(queries, manifest.checkpoint_weights)] if members else queries
            save_queries(path, np.concatenate(weighted, axis=1), fitted.held_out_hashes)
        # Not the fitted projection itself: the rows must be projected with P as stored (FP16 by
        # default), so the projection is read back (lazily) from the file on first use.
        return cls(path, manifest)

    #: Bytes the projection's ``P`` matrices may hold in memory (None: the default of
    #: :func:`~eogp_index.config.default_projection_memory`); set it before first use.
    projection_memory: Optional[int] = None

    @functools.cached_property
    def projection(self):
        """The fitted projection (``fit.projection.Projection``) of checkpoint 0 (the only one
        without ``manifest.checkpoints``), loaded and checked on first use.

        Checked by the sampled fingerprint the manifest records (an index written before
        fingerprints: by the file's full SHA-256); ``P`` is read lazily (see
        :func:`~eogp_index.store.projection_file.load_projection`).
        """
        return self.checkpoint_projection(0)

    def checkpoint_projection(self, j: int):
        """Checkpoint ``j``'s projection (its modules named as in its model), loaded, checked and
        cached on first use; checkpoint 0's is :attr:`projection`'s."""
        cache = self.__dict__.setdefault("_checkpoint_projections", {})
        if j not in cache:
            cache[j] = self._load_projection(j)
        return cache[j]

    def checkpoint_dir(self, j: int) -> IndexPath:
        """Where checkpoint ``j`` keeps its projection and curvature: the index directory for
        checkpoint 0, ``checkpoints/<j>`` for the others."""
        return self.path if j == 0 else self.path / CHECKPOINTS_DIR / str(j)

    def _load_projection(self, j: int):
        from eogp_index.store.files import file_fingerprint, file_sha256
        from eogp_index.store.projection_file import load_projection

        manifest = self.manifest
        entry = manifest.projection if j == 0 else manifest.checkpoints[j]["projection"]
        where = str(self.path) if manifest.checkpoints is None else f"{self.path} (checkpoint {j})"
        path = self.path / entry["file"]
        if path.exists():  # (a missing file is reported by load_projection)
            recorded = dataclasses.replace(manifest, projection=entry)
            if entry.get("fingerprint"):
                check_compatible(recorded, projection_fingerprint=file_fingerprint(path), where=where)
            else:
                check_compatible(recorded, projection_hash=file_sha256(path), where=where)
        projection = load_projection(path, memory_limit=self.projection_memory)
        if projection.config.pca_dtype != manifest.pca_dtype:
            raise IncompatibleIndexError(
                f"{path} stores P as {projection.config.pca_dtype} but {self.path / MANIFEST_FILE} says "
                f"{manifest.pca_dtype}; the index was refitted partway. Rebuild it with `eogp fit --overwrite`."
            )
        modules = manifest.checkpoint_modules(j)
        if projection.k != tuple(m.k for m in modules) or projection.names != [m.name for m in modules]:
            raise IncompatibleIndexError(
                f"{path} does not match the modules of {self.path / MANIFEST_FILE}; "
                "the index was refitted partway. Rebuild it with `eogp fit --overwrite`."
            )
        start = sum((manifest.checkpoint_parts or (0,))[:j])
        tier_k = self.coordinates.k[start : start + len(modules)]
        if projection.tier_k != tier_k:
            raise IncompatibleIndexError(
                f"{path} projects {list(projection.tier_k)} coordinates per module but {self.path / MANIFEST_FILE} "
                f"records a rescoring tier of {list(tier_k)} (tier.k; absent: the modules' k): the "
                "projection file and the manifest come from different fits. Rebuild it with `eogp fit --overwrite`."
            )
        return projection

    def hot_codes(self, *, consolidate: bool = False):
        """The hot copy of the stored rows (:class:`~eogp_index.store.hot.HotCodes`): memory-mapped
        from ``<index>/hot`` when it holds the table's current version, else brought up to date
        (new fragments read from the table). ``consolidate`` rewrites it as one segment.
        """
        from eogp_index.store.hot import load_hot

        # store.version is a stat of the table's version directory, not a Lance call; the first
        # load may not even open the table (load_hot adopts the version the copy recorded).
        if consolidate or self._hot is None or self._hot.version != self.store.version:
            self._hot = None  # let the old copy's mappings go before the new one is made
            self._hot = load_hot(self.store, self.codec, self.cache_dir / HOT_DIR, consolidate=consolidate)
        return self._hot

    def has_hot_copy(self) -> bool:
        """Whether ``<index>/hot`` (a remote index: the local cache's) holds a hot copy (of any version)."""
        from eogp_index.store.hot import STATE_FILE

        return (self.cache_dir / HOT_DIR / STATE_FILE).exists()

    def loaded_hot(self):
        """The hot copy if this process has loaded it and it is current, else None (loads nothing:
        the streaming routes read the table instead)."""
        hot = self._hot
        return hot if hot is not None and hot.version == self.store.version else None

    def matching_rows(self, where: Optional[str], hot=None):
        """Sorted ``(m,)`` int64 positions in the hot copy (``hot``, default :meth:`hot_codes`) of
        the rows matching the SQL filter ``where``; None without a filter.

        Evaluated by DataFusion over the hot columns, or by Lance for what DataFusion does not
        plan; cached per table version (:mod:`eogp_index.store.filters`).

        Raises:
            InputError: a filter that neither accepts, naming it and the stored columns.
        """
        if where is None:
            return None
        from eogp_index.store.filters import matching_positions

        return matching_positions(self.hot_codes() if hot is None else hot, where, self.store)

    def rows(self, rowaddr, columns: Optional[List[str]] = None):
        """The non-code columns (all, or ``columns``) of the rows at Lance row addresses ``rowaddr``,
        in that order, as a ``pyarrow.Table``: from the hot copy when it is loaded and current,
        else taken from the table."""
        import numpy as np

        hot = self.loaded_hot()
        if hot is not None and hot.num_rows:
            return hot.take(hot.positions(np.asarray(rowaddr, np.uint64)), columns)
        columns = list(columns) if columns is not None else self.store.metadata_columns()
        return self.store.take_rows(list(np.asarray(rowaddr, np.uint64).tolist()), columns)

    @functools.cached_property
    def sources(self) -> Sources:
        """Where the ingested shards live and how their records were read (``sources.json``)."""
        return Sources.load(self.path)

    def agree_store_text(self, max_bytes: Optional[int]) -> None:
        """Check an ingest's ``--store-text`` setting against the index's (the first ingest sets it)."""
        if max_bytes is not None and not self.manifest.has_content_hashes:
            raise ConfigError(
                f"{self.path} has index format {self.manifest.format_version}, which has no text "
                "column; ingest without --store-text, or build a new index with this version"
            )
        if self.manifest.has_content_hashes:
            self.sources.agree_store_text(max_bytes, table_exists=self.store.table is not None)

    def row(self, example_id: str, columns: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
        """The stored row of ``example_id`` (all columns but the codes by default), or None."""
        if self.store.table is None:
            return None
        columns = columns or [c for c in self.store.metadata_columns()]
        rows = self.store.read(columns, where=f"id = {sql_string(example_id)}").to_pylist()
        return rows[0] if rows else None

    def document(self, example_id: str, tokenizer) -> Example:
        """The stored document ``example_id``, tokenized as it was ingested: from its stored text,
        else read back from its shard. Its content hash must equal the stored one.

        Raises:
            InputError: no such id; the shard moved, changed or no longer holds the record.
            IncompatibleIndexError: a format-1 index, whose rows record no content hash.
        """
        if not self.manifest.has_content_hashes:
            raise IncompatibleIndexError(
                f"{self.path} has index format {self.manifest.format_version}, whose rows record no content hash, "
                "so a document read back could not be checked; re-ingest into an index made by this version"
            )
        row = self.row(example_id, self.document_columns())
        if row is None:
            raise InputError(f"no stored example has id {example_id!r} in {self.path}")
        return self.document_of(row, tokenizer)

    def document_columns(self) -> List[str]:
        """The stored columns :meth:`document_of` reads a document back from."""
        wanted = ["id", "shard", "position", "content_sha256", "content_kind"]
        names = self.store.schema.names if self.store.schema is not None else []
        return wanted + [name for name in ("text", "window", "parent_id") if name in names]

    def document_of(self, row: Dict[str, Any], tokenizer) -> Example:
        """:meth:`document` of a stored row's :meth:`document_columns` (read in bulk by the caller)."""
        example_id = row["id"]
        recorded = self.sources.data["shards"].get(row["shard"], {}).get("record_spec", {})
        # A window of a split document stores its own span, not the document: read it from the shard.
        split = recorded.get("long_documents") == "windows" and row.get("parent_id") not in (None, row["id"])
        if row.get("text") is not None and not split:
            # Tokenized as at ingest: the shard's recorded max_tokens when it has one, else the index's.
            spec = RecordSpec(
                max_tokens=recorded.get("max_tokens", self.manifest.max_tokens),
                long_documents=recorded.get("long_documents", "truncate"),
            )
            record, where = _record_from_text(row["text"], row["content_kind"], spec), "its stored text"
        else:
            uri, spec = self.sources.shard(row["shard"])
            record, where = _read_record(uri, row["shard"], row["position"]), uri
        windows = tokenize_windows(record, shard=row["shard"], position=row["position"], spec=spec, tokenizer=tokenizer)
        # A window of a long document (long_documents="windows"): the one of the stored number.
        number = row.get("window") if spec.long_documents == "windows" else None
        example = windows[0] if number is None else next((w for w in windows if w.metadata["window"] == number), None)
        if example is None:
            raise InputError(
                f"example {example_id!r}: the record at {location_of(row['shard'], row['position'])} in "
                f"{where} has no window {number} any more; restore the shard as it was ingested"
            )
        if example.content_sha256 != row["content_sha256"]:
            raise InputError(
                f"example {example_id!r}: the record at {location_of(row['shard'], row['position'])} in {where} has "
                "changed since it was ingested (its content hash differs), so an explanation would be wrong. Restore "
                "the shard as it was, or ingest the new version into a new index"
            )
        return dataclasses.replace(example, id=example_id)

    def info(self, *, hits: Optional[int] = None, rescore: Optional[int] = None) -> Dict[str, Any]:
        """The manifest plus live facts: row count, table version, path, ``deletions``
        (:func:`~eogp_index.store.deletions.deletions_info`: takedowns, and whether a deleted id
        fitted the index), and ``bytes``: both
        tiers' bytes per row and on disk and what a query of ``hits`` per side rescoring
        ``rescore · hits`` rows reads (:func:`~eogp_index.fit.plan.tier_size`; defaults:
        the question's ``k`` and the default rescoring factor,
        :func:`~eogp_index.store.table_recall.default_rescore_factor`); with a tier,
        ``table_recall``: the recall measured on the table (None when not measured)."""
        from eogp_index.fit.plan import tier_size
        from eogp_index.store.deletions import deletions_info
        from eogp_index.store.table_recall import current_record, default_rescore_factor

        data = self.manifest.to_json()
        data["rows"] = self.store.count()
        data["table_version"] = self.store.version
        data["path"] = str(self.path)
        data["deletions"] = deletions_info(self.path, self.store)
        tier = self.manifest.tier
        data["bytes"] = tier_size(
            data["rows"],
            self.manifest.bytes_per_example,
            self.manifest.tier_code,
            self.coordinates.num_coords,
            0 if tier is None else tier["bytes_per_example"],
            hits=hits,
            rescore=default_rescore_factor(self) if rescore is None else rescore,
        ).to_json()
        if tier is not None:  # the recall measured on the table (None: not measured)
            data["table_recall"] = current_record(self.path)
        return data

    def count(self, where: Optional[str] = None) -> int:
        return self.store.count(where)


def _model_name(name: str) -> str:
    """A model's name as the manifest records it: a local directory absolute."""
    return str(Path(name).resolve()) if Path(name).is_dir() else name


def checkpoint_entry(path, j: int, fitted, name: str, fingerprint: str) -> Dict[str, Any]:
    """``manifest.checkpoints[j]`` of checkpoint ``j`` (``j >= 1``): its projection written to
    ``checkpoints/<j>/projection.safetensors`` (no ``weight`` yet)."""
    from eogp_index.store.files import file_fingerprint
    from eogp_index.store.projection_file import save_projection

    relative = f"{CHECKPOINTS_DIR}/{j}/{PROJECTION_FILE}"
    (path / CHECKPOINTS_DIR / str(j)).mkdir(parents=True, exist_ok=True)
    digest = save_projection(fitted.projection, path / relative)
    return {
        "name": _model_name(name),
        "weights_sha256": fitted.weights_sha256,
        "weights_fingerprint": fingerprint,
        "num_parameters": fitted.num_parameters,
        "dir": f"{CHECKPOINTS_DIR}/{j}",
        "projection": {"file": relative, "sha256": digest, "fingerprint": file_fingerprint(path / relative)},
    }


def _checkpoint_entries(path, fitted, model_name, fingerprint, projection_entry, members, weights):
    """``manifest.checkpoints`` of an ensemble: checkpoint 0 (``model``, ``projection``) and each
    member's, weighted (``weights``; None: ``1/C`` each); None without members."""
    if not members:
        return None
    if fingerprint is None:
        raise ConfigError("an ensemble records each checkpoint's weights fingerprint; give weights_fingerprint")
    first = {
        "name": _model_name(model_name),
        "weights_sha256": fitted.weights_sha256,
        "weights_fingerprint": fingerprint,
        "num_parameters": fitted.num_parameters,
        "dir": ".",
        "projection": {key: projection_entry[key] for key in ("file", "sha256", "fingerprint")},
    }
    rest = [checkpoint_entry(path, j, m["fitted"], m["name"], m["fingerprint"]) for j, m in enumerate(members, 1)]
    entries = [first, *rest]
    for entry, weight in zip(entries, weights or [1.0 / len(entries)] * len(entries)):
        entry["weight"] = float(weight)
    return entries


def _tier_entry(code: str, layout: SignLayout, coordinates: SignLayout) -> Dict[str, Any]:
    """``manifest.tier`` of a tier of ``code`` over ``coordinates`` (per module); its ``k`` only
    when wider than the one-bit code's ``layout``, so that a tier of the same coordinates writes
    the manifest as before."""
    entry: Dict[str, Any] = {"code": code, "bytes_per_example": TierCodec(code, coordinates).bytes_per_example}
    if coordinates.k != layout.k:
        entry["k"] = list(coordinates.k)
    return entry
