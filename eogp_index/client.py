"""The Python client: build an index, ingest examples, ask which ones influence a query.

Example:
    >>> from eogp_index import AttributionIndex
    >>> index = AttributionIndex.open("my-index")  # doctest: +SKIP
    >>> index.top_influential("The capital of France is Paris.", k=5, where="kind = 'function'")  # doctest: +SKIP
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Literal, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from eogp_index import __version__
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.fit.curvature import fit_curvature
from eogp_index.errors import ConfigError, IncompatibleIndexError, InputError
from eogp_index.gradients.capture import GradientCapture
from eogp_index.store.manifest import (
    MANIFEST_FILE,
    PROJECTION_FILE,
    TABLE_NAME,
    Manifest,
    ModuleEntry,
    check_compatible,
)
from eogp_index.gradients.model import find_attributed_modules, load_model, model_sha256, pad_token_id, replace_conv1d
from eogp_index.fit.projection import Projection, build_projection, file_sha256, fit_second_stage_pca
from eogp_index.store.codecs import SignLayout, concat_modules, encode
from eogp_index.store.table import RowInfo, Store, build_rows
from eogp_index.gradients.loss import collate

#: A query: a text, a chat (list of ``{"role", "content"}``), token ids, or a record dict
#: (``{"text": ...}``, ``{"messages": ...}``, ``{"input_ids": ..., "labels": ...}``).
Query = Union[str, Sequence[Dict[str, str]], Sequence[int], Dict[str, Any]]


@dataclass(frozen=True)
class TokenizedExample:
    """The minimum the gradient stage needs; ``ingest.records.Example`` satisfies it."""

    id: str
    input_ids: Sequence[int]
    labels: Sequence[int]
    shard: str = ""
    position: int = 0
    num_tokens: int = 0
    num_loss_tokens: int = 0
    truncated: bool = False
    metadata: Optional[Dict[str, Any]] = None


def _batches(items: Iterable[Any], size: int) -> Iterator[List[Any]]:
    batch: List[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class AttributionIndex:
    """An EOGP attribution index: a directory with a manifest, a projection and a LanceDB table."""

    def __init__(self, path: Path, manifest: Manifest, projection: Projection, model: nn.Module, tokenizer,
                 *, gradients: GradientConfig = GradientConfig()):
        self.path = Path(path)
        self.manifest = manifest
        self.projection = projection
        self.model = model
        self.tokenizer = tokenizer
        self.gradients = gradients
        self.layout = SignLayout(manifest.k)
        self.store = Store(manifest.store_uri(self.path), manifest.table)
        self._device = gradients.resolved_device()
        self._hot = None

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: Union[str, Path],
        model: nn.Module,
        tokenizer,
        examples: Sequence[TokenizedExample],
        *,
        model_name: str,
        modules: Optional[Sequence[str]] = None,
        curvature: CurvatureConfig = CurvatureConfig(),
        projection: ProjectionConfig = ProjectionConfig(k=256),
        storage: StorageConfig = StorageConfig(),
        gradients: GradientConfig = GradientConfig(),
        table_uri: Optional[str] = None,
        mode: Literal["create", "overwrite"] = "create",
        progress: bool = True,
    ) -> "AttributionIndex":
        """Fit curvature and projection on ``examples`` and write an empty index at ``path``.

        Args:
            examples: tokenized corpus examples; seeded samples of them fit the EK-FAC factors
                (``curvature.num_examples``) and the PCA (``projection.num_fit_examples``).
            model_name: recorded in the manifest; :meth:`open` reloads the model from it.
            table_uri: a LanceDB URI (object store or directory) for the table; ``None`` keeps it
                inside ``path``.
            mode: ``"create"`` refuses an existing index directory; ``"overwrite"`` replaces it.
        """
        path = Path(path)
        if (path / MANIFEST_FILE).exists():
            if mode != "overwrite":
                raise ConfigError(f"{path} already holds an index; pass mode='overwrite' (--overwrite) to replace it")
            shutil.rmtree(path)
        if not examples:
            raise InputError("no examples to fit the curvature and projection on")
        if table_uri is not None:
            remote = Store(table_uri, TABLE_NAME)
            if remote.table is not None:
                if mode != "overwrite":
                    raise ConfigError(f"{table_uri} already holds a table {TABLE_NAME!r}; pass mode='overwrite' "
                                      "(--overwrite) to replace it or choose another --table-uri")
                remote._db.drop_table(TABLE_NAME)
        path.mkdir(parents=True, exist_ok=True)
        weights_hash = model_sha256(model)
        replace_conv1d(model)
        device = gradients.resolved_device()
        model.to(device).eval()
        names = find_attributed_modules(model, modules)
        pairs = [(ex.input_ids, ex.labels) for ex in examples]
        pad_id = pad_token_id(tokenizer)
        factors = fit_curvature(model, pairs, names, path / "curvature", config=curvature, pad_token_id=pad_id,
                                device=device, progress=progress)
        proj = build_projection(factors, projection, storage, damping_ratio=curvature.damping_ratio)
        num_fit = 0
        if projection.second_stage == "pca":
            generator = torch.Generator().manual_seed(projection.seed)
            order = torch.randperm(len(examples), generator=generator)[: projection.num_fit_examples].sort().values
            fit_set = [examples[i] for i in order.tolist()]
            num_fit = len(fit_set)
            cached: Dict[str, List[torch.Tensor]] = {n: [] for n in names}
            capture = GradientCapture(model, names, proj.first_stage_transform)
            for batch in _progress(_batches(fit_set, gradients.batch_size), progress, "PCA fitting set",
                                   total=-(-len(fit_set) // gradients.batch_size)):
                outputs, _ = capture.run(_to_device(collate([(e.input_ids, e.labels) for e in batch], pad_id), device))
                for n in names:
                    cached[n].append(outputs[n].cpu())
            fit_second_stage_pca(proj, cached)
        proj_hash = proj.save(path / PROJECTION_FILE)
        layout = SignLayout(proj.k)
        manifest = Manifest(
            # A local directory is recorded absolute, so the index opens from any working directory.
            model={"name": str(Path(model_name).resolve()) if Path(model_name).is_dir() else model_name,
                   "weights_sha256": weights_hash,
                   "num_parameters": sum(p.numel() for p in model.parameters()),
                   "tokenizer": getattr(tokenizer, "name_or_path", None)},
            projection={"file": PROJECTION_FILE, "sha256": proj_hash, "variant": projection.variant,
                        "seed": projection.seed, "num_fit_examples": num_fit},
            modules=[ModuleEntry(name=n, d_out=p.shape[0], d_in=p.shape[1], m=p.m, k=p.k, damping=p.damping)
                     for n, p in proj.modules.items()],
            precision=storage.precision,
            damping_ratio=curvature.damping_ratio,
            bytes_per_example=layout.bytes_per_example(storage.precision),
            curvature={"num_examples": min(curvature.num_examples, len(examples)), "seed": curvature.seed,
                       "batch_size": curvature.batch_size, "factors_dir": "curvature"},
            max_tokens=gradients.max_tokens,
            table=TABLE_NAME,
            table_uri=table_uri,
            created_by=f"eogp-index {__version__}",
        )
        manifest.save(path)
        return cls(path, manifest, proj, model, tokenizer, gradients=gradients)

    @classmethod
    def open(cls, path: Union[str, Path], *, model: Optional[nn.Module] = None, tokenizer=None,
             model_name: Optional[str] = None, gradients: GradientConfig = GradientConfig()) -> "AttributionIndex":
        """Open an index; load its model from the manifest's name unless one is given.

        Args:
            model, tokenizer: an already loaded model and its tokenizer.
            model_name: load the model from here instead of the manifest's name (the model moved);
                its weights must still hash to the manifest's.

        Raises:
            IncompatibleIndexError: the model's weights or the projection file differ from the
                ones the index was built with.
        """
        path = Path(path)
        manifest = Manifest.load(path)
        projection_path = path / manifest.projection["file"]
        projection = Projection.load(projection_path)
        check_compatible(manifest, projection_hash=file_sha256(projection_path), where=str(path))
        if model is None:
            model, loaded_tokenizer = load_model(model_name or manifest.model["name"], device=gradients.resolved_device())
            tokenizer = tokenizer or loaded_tokenizer
        elif tokenizer is None:
            raise ConfigError("AttributionIndex.open: pass the tokenizer together with the model")
        check_compatible(manifest, model_hash=model_sha256(model), where=str(path))
        replace_conv1d(model)
        model.to(gradients.resolved_device()).eval()
        if projection.k != manifest.k or projection.names != manifest.module_names:
            raise IncompatibleIndexError(f"{projection_path} does not match the modules of {path / MANIFEST_FILE}")
        return cls(path, manifest, projection, model, tokenizer, gradients=gradients)

    # -- gradients ------------------------------------------------------------------------------
    def project(self, examples: Sequence[TokenizedExample], *, progress: bool = False) -> np.ndarray:
        """Unquantized projected coordinates ``(n, K)`` float32, modules concatenated in order."""
        capture = GradientCapture(self.model, self.manifest.module_names, self.projection.transform)
        pad_id = pad_token_id(self.tokenizer)
        parts = []
        for batch in _progress(_batches(examples, self.gradients.batch_size), progress, "projecting",
                               total=-(-len(examples) // self.gradients.batch_size)):
            for ex in batch:
                if not any(label != -100 for label in list(ex.labels)[1:]):
                    raise InputError(f"example {ex.id!r} has no tokens that count in the loss", location=ex.shard or None)
            pairs = [(ex.input_ids, ex.labels) for ex in batch]
            outputs, _ = capture.run(_to_device(collate(pairs, pad_id), self._device))
            parts.append(concat_modules([outputs[n].cpu().numpy() for n in self.manifest.module_names]))
        if not parts:
            return np.zeros((0, self.layout.num_coords), np.float32)
        return np.concatenate(parts, axis=0)

    def ingest(self, examples: Iterable[TokenizedExample], *, progress: bool = True) -> int:
        """Store examples whose ids are not stored yet; returns how many rows were added.

        Each batch is one commit. For shards, resumability, rejects and scale-out use
        ``ingest.run_ingest`` (``eogp ingest``), which calls this per batch.
        """
        existing = self.store.existing_ids()
        added = 0
        batch_size = self.gradients.batch_size
        for batch in _progress(_batches(examples, batch_size), progress, "ingesting"):
            fresh = [ex for ex in batch if ex.id not in existing]
            if fresh:
                added += self.add_batch(fresh)
                existing.update(ex.id for ex in fresh)
        return added

    def add_batch(self, examples: Sequence[TokenizedExample]) -> int:
        """Project, encode and store one batch in one commit."""
        rows = self.encode_rows(examples)
        self.store.add(rows)
        return rows.num_rows

    def encode_rows(self, examples: Sequence[TokenizedExample]) -> pa.Table:
        """The Arrow rows of a batch, ready for :meth:`Store.add` (also used by distributed ingest)."""
        coords = self.project(examples)
        encoded = encode(coords, self.layout, self.manifest.precision)  # type: ignore[arg-type]
        info = RowInfo(
            ids=[ex.id for ex in examples],
            shards=[ex.shard for ex in examples],
            positions=[ex.position for ex in examples],
            num_tokens=[ex.num_tokens or len(ex.input_ids) for ex in examples],
            num_loss_tokens=[ex.num_loss_tokens or sum(1 for x in list(ex.labels)[1:] if x != -100) for ex in examples],
            truncated=[ex.truncated for ex in examples],
            metadata=[dict(ex.metadata or {}) for ex in examples],
        )
        return build_rows(info, encoded, schema=self.store.schema)

    # -- queries --------------------------------------------------------------------------------
    def query_examples(self, queries: Sequence[Query]) -> List[TokenizedExample]:
        """Tokenize queries (texts, chats, ids or record dicts) like training records."""
        from eogp_index.gradients.records import RecordSpec, tokenize_record

        spec = RecordSpec(max_tokens=self.manifest.max_tokens)
        out = []
        for i, query in enumerate(queries):
            if isinstance(query, str):
                record: Dict[str, Any] = {"text": query}
            elif isinstance(query, dict):
                record = dict(query)
            elif len(query) and isinstance(query[0], dict):
                record = {"messages": list(query)}
            else:
                record = {"input_ids": [int(t) for t in query]}
            ex = tokenize_record(record, shard="query", position=i, spec=spec, tokenizer=self.tokenizer)
            out.append(TokenizedExample(id=f"query-{i}", input_ids=list(ex.input_ids), labels=list(ex.labels)))
        return out

    def query_coordinates(self, queries: Sequence[Query]) -> np.ndarray:
        """Projected, unquantized query coordinates ``(n_queries, K)`` float32."""
        return self.project(self.query_examples(queries))

    def scores(self, queries: Sequence[Query], *, where: Optional[str] = None) -> tuple[List[str], np.ndarray]:
        """Exact scores of every stored row (matching ``where``): ids and ``(n_queries, n_rows)`` float32.

        Positive = training on the example lowers the query's loss (kronfluence's convention).
        """
        y = self.query_coordinates(queries)
        matching = self.store.read(["id"], where, with_row_address=True)
        hot = self.hot_codes()
        rows = hot.positions(matching.column("_rowaddr").to_numpy())
        return matching.column("id").to_pylist(), self._scan_scores(hot, y, rows)

    def top_influential(
        self,
        query: Query,
        k: int = 20,
        *,
        where: Optional[str] = None,
        direction: Literal["positive", "negative", "both"] = "positive",
        candidates: Optional[int] = None,
        stream: bool = False,
    ) -> pa.Table:
        """The ``k`` stored examples that most help (``positive``) or hurt (``negative``) the query.

        Args:
            where: SQL filter on the stored columns (LanceDB's); only matching rows are scored.
            candidates: take this many candidates per direction from the FAISS index built with
                ``eogp build-faiss`` and rescore them exactly, instead of scanning every row.
            stream: scan the table batch by batch instead of the in-memory hot copy (for stores
                larger than memory).

        Returns:
            A ``pyarrow.Table`` with ``rank``, ``id``, ``score``, and the stored metadata
            columns (plus ``direction`` when ``direction="both"``), best first.
        """
        if k < 1:
            raise ConfigError(f"k must be at least 1, got {k}")
        if candidates is not None:
            from eogp_index.search.candidates import top_influential_with_candidates

            return top_influential_with_candidates(self, query, k, candidates, where=where, direction=direction)
        sides = ("positive", "negative") if direction == "both" else (direction,)
        y = self.query_coordinates([query])
        if stream:
            from eogp_index.search.sharded import fragment_top_k

            best = fragment_top_k(self.store, self.layout, self.manifest.precision, y, k, directions=sides,
                                  where=where)[0]
            found = {side: (best[side].rowaddr, best[side].scores) for side in sides}
        else:
            found = self._hot_top_k(y, k, where, sides)
        meta_cols = self.store.metadata_columns()
        ranked = {side: (self.store.take_rows(found[side][0].tolist(), meta_cols), found[side][1]) for side in sides}
        return ranked_table(ranked, with_direction=direction == "both")

    # -- the scan -------------------------------------------------------------------------------
    def hot_codes(self):
        """The in-memory copy of the stored codes, refreshed when the table has changed."""
        from eogp_index.store.hot import load_hot

        if self._hot is None or self._hot.version != self.store.version:
            self._hot = load_hot(self.store, self.layout, self.manifest.precision, self.path / "hot")
        return self._hot

    def _scan_scores(self, hot, y: np.ndarray, rows: Optional[np.ndarray]) -> np.ndarray:
        if self.manifest.precision == "1bit" and self._device.startswith("cuda"):
            from eogp_index.search.scan import scan_scores_torch

            codes, scales = (hot.codes, hot.scales) if rows is None else (hot.codes[rows], hot.scales[rows])
            return scan_scores_torch(codes, scales, y, self.layout, self._device).cpu().numpy()
        if self.manifest.precision == "1bit":
            from eogp_index.search.scan import scan_scores

            return scan_scores(hot.codes, hot.scales, y, self.layout, rows=rows)
        coords = hot.coords if rows is None else hot.coords[rows]
        return (y.astype(np.float32) @ coords.T).astype(np.float32)

    def _hot_top_k(self, y: np.ndarray, k: int, where: Optional[str], sides) -> Dict[str, tuple]:
        """``{side: (rowaddr (k,), scores (k,))}`` for the single query ``y`` ``(1, K)``."""
        hot = self.hot_codes()
        rows = None
        if where is not None:
            rows = hot.positions(self.store.read([], where, with_row_address=True).column("_rowaddr").to_numpy())
        if self.manifest.precision == "1bit" and not self._device.startswith("cuda"):
            from eogp_index.search.scan import scan_top_k

            top = scan_top_k(hot.codes, hot.scales, y, self.layout, k, rows=rows,
                             largest="positive" in sides, smallest="negative" in sides)
            picks = {"positive": (top.largest_indices, top.largest_scores),
                     "negative": (top.smallest_indices, top.smallest_scores)}
            return {side: (hot.rowaddr[picks[side][0][0]], picks[side][1][0]) for side in sides}
        # Unquantized storage, or the GPU: score every row, then pick.
        scores = self._scan_scores(hot, y, rows)[0]
        positions = np.arange(hot.num_rows) if rows is None else rows
        out = {}
        for side in sides:
            order = np.lexsort((positions, -scores if side == "positive" else scores))[:k]
            out[side] = (hot.rowaddr[positions[order]], scores[order])
        return out

    def _code_columns(self) -> List[str]:
        return ["signs", "scales"] if self.manifest.precision == "1bit" else ["coords"]

    def info(self) -> Dict[str, Any]:
        """The manifest plus live facts: row count, table version, bytes per example."""
        data = self.manifest.to_json()
        data["rows"] = self.store.count()
        data["table_version"] = self.store.version
        data["path"] = str(self.path)
        return data


def ranked_table(ranked: Dict[str, tuple], *, with_direction: bool) -> pa.Table:
    """The result of a top-k query: ``{side: (rows pa.Table, scores (k,))}``, best first, →
    one table with ``[direction,] rank, id, score`` leading and the stored columns after."""
    parts = []
    for side, (rows, scores) in ranked.items():
        part = rows.add_column(0, "score", pa.array(scores, pa.float32()))
        part = part.add_column(0, "rank", pa.array(np.arange(1, len(scores) + 1), pa.int32()))
        if with_direction:
            part = part.add_column(0, "direction", pa.array([side] * len(scores), pa.string()))
        parts.append(part)
    result = pa.concat_tables(parts)
    front = [c for c in ("direction", "rank", "id", "score") if c in result.column_names]
    return result.select(front + [c for c in result.column_names if c not in front])


def _to_device(batch: Dict[str, torch.Tensor], device: str) -> Dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _progress(iterable, enabled: bool, desc: str, total: Optional[int] = None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit="batch")
