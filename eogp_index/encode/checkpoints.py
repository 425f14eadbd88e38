"""``eogp add-checkpoint``: one more checkpoint of the training run added to a stored index.

The checkpoint is fitted (its own EK-FAC curvature and projection) on the index's recorded
fitting set (``fit/fitting_set.json``), its documents read back from the stored rows as
explanations read them (:meth:`~eogp_index.store.stored_index.StoredIndex.document_of`) and
checked against the recorded hashes, so it is the fit an ensemble of both fitted together makes.
Its code columns (``signs_c<j>``, ``scales_c<j>``, the tier's) are then filled for every stored
row by Lance's ``add_columns``, which writes new data files beside each fragment's and rewrites
none of the others. The manifest is written last: until then readers answer from the checkpoints
they had.

Resumable, under the index's ingest lock: the fit resumes from ``checkpoints/<j>/fit/``, a
finished fit is recorded in ``checkpoints/<j>/checkpoint.json``, and the column fill keeps
finished batches in a Lance UDF checkpoint file (``checkpoints/<j>/add-columns.sqlite`` in the
index's local cache folder), so a rerun after a kill computes only what was not done.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pyarrow as pa

from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.encode.commits import index_lock
from eogp_index.encode.encoder import Encoder
from eogp_index.errors import ConfigError, IncompatibleIndexError, InputError
from eogp_index.fit.cache import FIT_DIR, FITTING_SET_FILE, atomic_write, examples_sha256
from eogp_index.fit.fitting import check_checkpoint, check_tokenizer, fit_projection
from eogp_index.fit.sampling import FitSets
from eogp_index.gradients.experts import make_experts_trackable
from eogp_index.gradients.model import freeze, load_indexed_model, load_model, model_fingerprint, replace_conv1d
from eogp_index.store.codecs import SignLayout, checkpoint_column, codec_for, concat_modules, prefix_columns, tier_for
from eogp_index.store.manifest import Manifest, ModuleEntry, prefixed
from eogp_index.store.projection_file import load_projection
from eogp_index.store.stored_index import CHECKPOINTS_DIR, StoredIndex, _tier_entry, checkpoint_entry
from eogp_index.store.table import code_batch

#: A finished fit of the checkpoint being added: its manifest entry and modules.
STATE_FILE = "checkpoint.json"
#: Lance's record of the column fill's finished batches (in the local cache folder).
UDF_CHECKPOINT = "add-columns.sqlite"
log = logging.getLogger("eogp_index.fit")


@dataclasses.dataclass(frozen=True)
class AddedCheckpoint:
    """What ``eogp add-checkpoint`` did.

    Attributes:
        index: the index path. checkpoint: the new checkpoint's number ``j`` (``C - 1``). name: its
        model. rows: stored rows whose codes were filled. weights: every checkpoint's weight now.
    """

    index: str
    checkpoint: int
    name: str
    rows: int
    weights: List[float]

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def add_checkpoint(
    path,
    name: str,
    *,
    weight: Optional[float] = None,
    device: Optional[str] = None,
    progress: bool = False,
    on_batch: Optional[Callable[[int], None]] = None,
) -> AddedCheckpoint:
    """Fit checkpoint ``name`` on the index's fitting set, fill its codes for every stored row,
    and record it in the manifest (see the module docstring).

    Args:
        weight: the new checkpoint's weight; the others keep theirs (an index of one checkpoint:
            1). None: every checkpoint ``1/C``, the mean.
        on_batch: called with the number of batches filled so far, after each (tests kill here).

    Raises:
        IncompatibleIndexError: the checkpoint's architecture or tokenizer differs from the index's.
        InputError: a fitting document is not stored (so it cannot be read back), or reads back
            other tokens than it was fitted on.
        ConfigError: another ingest holds the index; the index has a LoRA adapter.
    """
    stored = StoredIndex.open(path)
    if stored.manifest.model.get("adapter") is not None:
        raise ConfigError(f"{stored.path} has a LoRA adapter; an ensemble of adapted checkpoints is not supported")
    if weight is not None and not np.isfinite(weight):
        raise ConfigError(f"--weight must be a finite number, got {weight!r}")
    with index_lock(stored.path):
        stored = StoredIndex.open(path)  # read under the lock: what another run recorded
        j = stored.manifest.num_checkpoints
        gradients = _gradients(stored, device)
        model, tokenizer = load_model(name, device=gradients.resolved_device(), dtype=gradients.dtype)
        first, first_tokenizer = load_indexed_model(
            stored.manifest.model, device=gradients.resolved_device(), dtype=gradients.dtype
        )
        check_checkpoint(first, model, first_name=stored.manifest.model["name"], name=name)
        check_tokenizer(first_tokenizer, tokenizer, first_name=stored.manifest.model["name"], name=name)
        del first
        state = _fitted(stored, j, name, model, tokenizer, gradients, progress)
        freeze(model)
        rows = _fill_columns(stored, j, state, model, tokenizer, gradients, on_batch)
        manifest = _with_checkpoint(stored.manifest, state, weight)
        manifest.save(stored.path)
        _forget_measurements(stored)
    return AddedCheckpoint(str(stored.path), j, name, rows, list(manifest.checkpoint_weights))


def _gradients(stored: StoredIndex, device: Optional[str]) -> GradientConfig:
    """The gradient passes of the index's fit (its batch and max_tokens), in its dtype."""
    settings = _fitting_set(stored)["settings"]
    return GradientConfig(
        batch_size=settings["gradient_batch_size"],
        max_tokens=settings["max_tokens"],
        dtype=stored.manifest.model_dtype,
        **({} if device is None else {"device": device}),
    )


def _fitting_set(stored: StoredIndex) -> Dict[str, Any]:
    path = stored.path / FIT_DIR / FITTING_SET_FILE
    if not path.exists():
        raise IncompatibleIndexError(
            f"{stored.path} has no {FIT_DIR}/{FITTING_SET_FILE} (the record of the documents it was fitted on), so "
            "another checkpoint cannot be fitted on the same ones; fit the ensemble anew with `eogp fit CKPT_A CKPT_B`"
        )
    return json.loads(path.read_text())


def _fitted(stored: StoredIndex, j: int, name: str, model, tokenizer, gradients, progress: bool) -> Dict[str, Any]:
    """Checkpoint ``j``'s fit: read from ``checkpoints/<j>/checkpoint.json`` when a run finished
    it, else fitted (resuming ``checkpoints/<j>/fit/``) and recorded there."""
    folder = stored.checkpoint_dir(j)
    found = folder / STATE_FILE
    if found.exists():
        state = json.loads(found.read_text())
        if state["entry"]["weights_fingerprint"] != model_fingerprint(model):
            raise ConfigError(
                f"{folder} holds the unfinished addition of checkpoint {state['entry']['name']!r}; rerun "
                f"`eogp add-checkpoint {stored.path} {state['entry']['name']}` to finish it first"
            )
        replace_conv1d(model)  # prepared as the fit prepares it
        make_experts_trackable(model, dense=stored.manifest.model.get("experts") == "dense")
        model.to(gradients.resolved_device()).eval()
        return state
    record = _fitting_set(stored)
    settings = record["settings"]
    sets = _fitting_documents(stored, record, tokenizer)
    fingerprint = model_fingerprint(model)
    fitted = fit_projection(
        model,
        tokenizer,
        [],
        folder,
        modules=settings["modules"],
        curvature=CurvatureConfig(**settings["curvature"]),
        projection=ProjectionConfig(**settings["projection"]),
        storage=StorageConfig(
            precision=settings["precision"], rescore=settings["rescore"] or "none", rescore_k=settings.get("rescore_k")
        ),
        gradients=gradients,
        progress=progress,
        sets=sets,
    )
    if fitted.projection.names != [m.name for m in stored.manifest.checkpoint_modules(0)]:
        raise IncompatibleIndexError(f"checkpoint {name!r} attributes other modules than the index's")
    state = {
        "entry": checkpoint_entry(stored.path, j, fitted, name, fingerprint),
        "modules": [
            dataclasses.asdict(ModuleEntry(n, p.shape[0], p.shape[1], p.m, p.k, p.damping))
            for n, p in fitted.projection.modules.items()
        ],
        "tier_k": list(fitted.projection.tier_k),
    }
    atomic_write(found, lambda tmp: tmp.write_text(json.dumps(state, indent=1)))
    if fitted.folder is not None:
        fitted.folder.finish()
    return state


def _fitting_documents(stored: StoredIndex, record: Dict[str, Any], tokenizer) -> FitSets:
    """The index's fitting sets, each document read back from its stored row, checked against
    the recorded hashes (the same tokens and labels, in the same order)."""
    sets = {}
    for key in ("curvature", "pca"):
        examples = []
        for example_id, _, _ in record[key]:
            row = stored.row(example_id, stored.document_columns())
            if row is None:
                raise InputError(
                    f"the fitting document {example_id!r} of {stored.path} is not stored in it, so it cannot be read "
                    "back to fit another checkpoint on it; ingest the fitting data, or fit the ensemble anew with "
                    "`eogp fit CKPT_A CKPT_B ...`"
                )
            examples.append(stored.document_of(row, tokenizer))
        if examples_sha256(examples) != record[f"{key}_sha256"]:
            raise InputError(
                f"the {key} fitting documents of {stored.path} read back from the stored rows are not the ones it was "
                "fitted on (other tokens: ingested with other options?); fit the ensemble anew with `eogp fit`"
            )
        sets[key] = examples
    return FitSets(curvature=sets["curvature"], pca=sets["pca"], disjoint=record["disjoint"])


def _part_codecs(stored: StoredIndex, state: Dict[str, Any]):
    """The one-bit (or float) codec and the tier codec of the new checkpoint's part alone."""
    layout = SignLayout(tuple(m["k"] for m in state["modules"]))
    coordinates = SignLayout(tuple(state["tier_k"]))
    return (
        layout,
        coordinates,
        codec_for(stored.manifest.precision, layout),
        tier_for(stored.manifest.tier_code, coordinates, record=stored.manifest.tier_records),
    )


def _fill_columns(stored, j: int, state, model, tokenizer, gradients, on_batch) -> int:
    """Checkpoint ``j``'s code columns of every stored row, added by Lance (resumable); the rows."""
    import lance

    store = stored.store
    if store.table is None:
        return 0
    layout, coordinates, codec, tier = _part_codecs(stored, state)
    names = [checkpoint_column(n, j) for n in (*codec.logical_columns, *(() if tier is None else tier.columns))]
    if all(n in store.schema.names for n in names):
        return store.count()  # filled by a run killed after the fill
    projection = load_projection(
        stored.path / state["entry"]["projection"]["file"], memory_limit=stored.projection_memory
    )
    encoder = Encoder(stored, model, tokenizer, gradients)
    done = [0]

    def fill(batch: pa.RecordBatch) -> pa.RecordBatch:
        examples = [stored.document_of(row, tokenizer) for row in batch.to_pylist()]
        y = concat_modules(encoder.project_with(model, projection, examples, progress=False)) if examples else None
        columns = {}
        if y is None:
            y = np.zeros((0, coordinates.num_coords), np.float32)
        columns.update(codec.encode(prefix_columns(y, coordinates, layout)).columns())
        if tier is not None:
            columns.update(tier.split(tier.encode(y)))
        done[0] += 1
        if on_batch is not None:
            on_batch(done[0])
        return code_batch({checkpoint_column(n, j): v for n, v in columns.items()}).to_batches()[0]

    sample = fill_schema(stored, j, codec, tier, layout, coordinates)
    cache = stored.cache_dir / CHECKPOINTS_DIR / str(j)
    cache.mkdir(parents=True, exist_ok=True)
    udf = lance.batch_udf(output_schema=sample, checkpoint_file=str(cache / UDF_CHECKPOINT))(fill)
    dataset = store.dataset()
    dataset.add_columns(udf, read_columns=stored.document_columns(), batch_size=max(1, gradients.batch_size * 4))
    store.refresh(force=True)
    (cache / UDF_CHECKPOINT).unlink(missing_ok=True)
    return store.count()


def fill_schema(stored, j: int, codec, tier, layout: SignLayout, coordinates: SignLayout) -> pa.Schema:
    """The schema of checkpoint ``j``'s code columns, as a batch of them writes them."""
    x = np.zeros((1, coordinates.num_coords), np.float32)
    columns = dict(codec.encode(prefix_columns(x, coordinates, layout)).columns())
    if tier is not None:
        columns.update(tier.split(tier.encode(x)))
    return code_batch({checkpoint_column(n, j): v for n, v in columns.items()}).schema


def _with_checkpoint(manifest: Manifest, state: Dict[str, Any], weight: Optional[float]) -> Manifest:
    """``manifest`` with the new checkpoint's modules, entry and weight: every checkpoint ``1/C``
    without ``weight``; else the others keep theirs (one checkpoint's: 1) and the new one gets it."""
    j = manifest.num_checkpoints
    checkpoints = [dict(c) for c in manifest.checkpoints or [_first_entry(manifest)]]
    checkpoints.append(dict(state["entry"]))
    if weight is None:
        for entry in checkpoints:
            entry["weight"] = 1.0 / len(checkpoints)
    else:
        checkpoints[-1]["weight"] = float(weight)
    modules = [*manifest.modules, *(ModuleEntry(**{**m, "name": prefixed(m["name"], j)}) for m in state["modules"])]
    layout = SignLayout(tuple(m.k for m in modules))
    coordinates = SignLayout((*manifest.tier_k, *state["tier_k"]))
    return dataclasses.replace(
        manifest,
        modules=modules,
        checkpoints=checkpoints,
        bytes_per_example=codec_for(manifest.precision, layout).bytes_per_example,
        tier=None if manifest.tier is None else _tier_entry(manifest.tier_code, layout, coordinates),
    )


def _first_entry(manifest: Manifest) -> Dict[str, Any]:
    """``checkpoints[0]`` of an index of one checkpoint: its ``model`` and ``projection``, weight 1."""
    model, projection = manifest.model, manifest.projection
    if not model.get("weights_fingerprint") or not projection.get("fingerprint"):
        raise IncompatibleIndexError(
            "the index records no weights or projection fingerprint (written by an older eogp-index); an ensemble "
            "checks each checkpoint by them: fit the ensemble anew with `eogp fit CKPT_A CKPT_B ...`"
        )
    return {
        "name": model["name"],
        "weights_sha256": model["weights_sha256"],
        "weights_fingerprint": model["weights_fingerprint"],
        "num_parameters": model["num_parameters"],
        "dir": ".",
        "projection": {key: projection[key] for key in ("file", "sha256", "fingerprint")},
        "weight": 1.0,
    }


def _forget_measurements(stored: StoredIndex) -> None:
    """The table's recall measurement and its queries are of the checkpoints before: removed (a
    query then uses the fit's rescoring factor until they are measured again by a new fit)."""
    from eogp_index.store.table_recall import QUERIES_FILE, RECORD_FILE

    for name in (QUERIES_FILE, RECORD_FILE):
        target = stored.path / name
        if target.exists():
            target.unlink()
