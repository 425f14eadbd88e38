"""The index manifest: what the stored rows mean, versioned and validated (schemas/).

An index answers queries only from the model and projection it was built with: the manifest
records the model's weight hash and the projection file's hash (full SHA-256s, checked by
``eogp verify``) and, since this release, cheap sampled fingerprints of both (checked on every
open); :func:`check_compatible` refuses anything else rather than return wrong scores.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional

from eogp_index.data.location import index_path, write_atomic
from eogp_index.errors import IncompatibleIndexError, IndexNotFoundError

FORMAT = "eogp-index"
#: 2: rows carry content_sha256 and content_kind (and text with --store-text), and the index
#: directory has sources.json (where each shard lives). Version 1 indexes are still read.
#: The optional ``projection.rotation`` (variant eogp-rot) needs no bump: the rotation is folded
#: into the stored P, so codes mean what they meant (signs of the coordinates P^T z).
#: The optional ``model.dtype`` (the model's precision) needs no bump either: absent means
#: float32, what every index without it was built in, and a reader that ignores it loads the
#: model in float32, whose weights fingerprint then refuses a bf16/fp16 index.
#: 3: the optional rescoring tier (``tier``: its code and bytes; the table's ``tier`` and
#: ``tier_scales`` columns). An index without a tier is still written as version 2, byte for byte
#: as before; a reader of version 2 refuses a tiered index rather than ingest rows without it.
#: The optional ``tier.k`` (a tier wider than the one-bit code, ``--rescore-k``) needs no bump:
#: absent means the one-bit ``k``, what every format-3 index without it stores, and a reader
#: that does not know it refuses the manifest (the schema allows no other field) rather than
#: read tier rows of the wrong width.
#: 4: an int8 or int4 tier's codes and scales in one record per row (the ``tier`` column; no
#: ``tier_scales``), so that rescoring reads a row in one read. Every tiered index is written as
#: 4; a version-3 index is still read, and rows added to it keep its two columns.
FORMAT_VERSION = 2
TIER_FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST_FILE = "manifest.json"
PROJECTION_FILE = "projection.safetensors"
TABLE_NAME = "examples"


@dataclass(frozen=True)
class ModuleEntry:
    name: str
    d_out: int
    d_in: int
    m: int
    k: int
    damping: float


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` (see ``schemas/manifest.schema.json``)."""

    model: Dict[str, Any]
    projection: Dict[str, Any]
    modules: List[ModuleEntry]
    precision: str
    damping_ratio: float
    bytes_per_example: int
    curvature: Dict[str, Any]
    max_tokens: Optional[int] = None
    table: str = TABLE_NAME
    table_uri: Optional[str] = None
    created_by: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    #: format 3: the rescoring tier, ``{"code": "int8" | "int4" | "fp16", "bytes_per_example"}``
    #: and, for a tier wider than the one-bit code, ``"k"``: its coordinates per module;
    #: None: the index has none
    tier: Optional[Dict[str, Any]] = None
    #: an ensemble's checkpoints, in order (``docs/ensembles.md``): ``{"name", "weights_sha256",
    #: "weights_fingerprint", "dir", "projection": {"file", "sha256", "fingerprint"}, "weight"}``
    #: each; None: one checkpoint (``model`` and ``projection``)
    checkpoints: Optional[List[Dict[str, Any]]] = None

    @property
    def num_checkpoints(self) -> int:
        """How many checkpoints' codes each row holds (1 without ``checkpoints``)."""
        return 1 if self.checkpoints is None else len(self.checkpoints)

    @property
    def checkpoint_parts(self) -> Optional[tuple[int, ...]]:
        """Modules per checkpoint in :attr:`modules` (the same attributed modules each), or None
        for one checkpoint."""
        if self.checkpoints is None:
            return None
        per = len(self.modules) // len(self.checkpoints)
        return (per,) * len(self.checkpoints)

    @property
    def checkpoint_weights(self) -> tuple[float, ...]:
        """Each checkpoint's default weight in the score (``(1.0,)`` for one checkpoint)."""
        if self.checkpoints is None:
            return (1.0,)
        return tuple(float(c["weight"]) for c in self.checkpoints)

    def checkpoint_modules(self, j: int) -> List[ModuleEntry]:
        """Checkpoint ``j``'s modules, named as in its model (without the ``c<j>/`` prefix)."""
        parts = self.checkpoint_parts or (len(self.modules),)
        start = sum(parts[:j])
        return [
            ModuleEntry(**{**asdict(m), "name": unprefixed(m.name, j)}) for m in self.modules[start : start + parts[j]]
        ]

    @property
    def tier_code(self) -> Optional[str]:
        """The rescoring tier's code, or None when the index has no tier."""
        return None if self.tier is None else self.tier["code"]

    @property
    def rescore_factor(self) -> Optional[int]:
        """The default rescoring factor the fit measured (``projection.fidelity.recall.factor``: the
        smallest whose held-out recall of the tier's top rows reached the target), or None when
        the index records none (no tier, no held-out documents, or written before the record)."""
        recall = (self.projection.get("fidelity") or {}).get("recall") or {}
        return recall.get("factor")

    @property
    def tier_k(self) -> tuple[int, ...]:
        """The rescoring tier's coordinates per module (``tier.k``; absent: the one-bit :attr:`k`,
        as in every index without a tier or with one of the same coordinates). The one-bit code
        keeps the first ``k_u`` of module ``u``'s ``tier_k[u]``."""
        if self.tier is None or self.tier.get("k") is None:
            return self.k
        return tuple(int(v) for v in self.tier["k"])

    @property
    def k(self) -> tuple[int, ...]:
        return tuple(m.k for m in self.modules)

    def store_uri(self, index_dir) -> str:
        """Where the table lives: ``table_uri`` if set, else the index directory."""
        return self.table_uri or str(index_dir)

    @property
    def has_content_hashes(self) -> bool:
        """Format 2 and later: every row records its content's hash (explanations can verify it)."""
        return self.format_version >= 2

    @property
    def tier_records(self) -> bool:
        """Format 4 and later: an int8 or int4 tier's codes and scales are one record per row."""
        return self.format_version >= 4

    @property
    def pca_dtype(self) -> str:
        """The stored precision of the PCA matrices ``P``: ``"fp16"`` or ``"fp32"`` (an index
        written before the field existed stored them in float32)."""
        return self.projection.get("pca_dtype", "fp32")

    @property
    def model_dtype(self) -> str:
        """The dtype the model ran in when the index was built (``"bfloat16"``): the one it is
        opened in. An index written before the field existed ran it in float32."""
        return self.model.get("dtype", "float32")

    @property
    def variant(self) -> str:
        return self.projection["variant"]

    @property
    def rotation(self) -> Dict[str, Any]:
        """The rotation folded into the stored ``P`` (``{"kind": "none"}`` or ``{"kind": "hadamard",
        "rounds", "seed"}``). An index written before the field existed has none. Nothing reads it to
        answer queries (``P`` already includes it): it records how the index was made."""
        return dict(self.projection.get("rotation") or {"kind": "none"})

    @property
    def module_names(self) -> List[str]:
        return [m.name for m in self.modules]

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data["modules"] = [asdict(m) for m in self.modules]
        if data["tier"] is None:  # no tier: the version-2 manifest, as before
            del data["tier"]
        if data["checkpoints"] is None:  # one checkpoint: the manifest as before
            del data["checkpoints"]
        return data

    def save(self, index_dir) -> None:
        data = self.to_json()
        path = index_path(index_dir) / MANIFEST_FILE
        validate(data, source=path)
        write_atomic(path, json.dumps(data, indent=2) + "\n")  # a reader never sees half a manifest

    @classmethod
    def load(cls, index_dir) -> "Manifest":
        path = index_path(index_dir) / MANIFEST_FILE
        if not path.exists():
            raise IndexNotFoundError(f"{path} not found: {index_dir} is not an eogp index (create one with `eogp fit`)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise IncompatibleIndexError(f"{path}: not valid JSON ({exc})") from exc
        if data.get("format") != FORMAT:
            raise IncompatibleIndexError(f"{path}: not an eogp-index manifest (format={data.get('format')!r})")
        if data.get("format_version") not in READABLE_VERSIONS:
            raise IncompatibleIndexError(
                f"{path}: format version {data.get('format_version')} but this eogp-index reads versions "
                f"{list(READABLE_VERSIONS)}; rebuild the index or install a matching eogp-index"
            )
        validate(data, source=path)
        data = dict(data)
        data["modules"] = [ModuleEntry(**m) for m in data["modules"]]
        return cls(**data)


def prefixed(name: str, j: int) -> str:
    """Module ``name`` of checkpoint ``j`` in an ensemble's combined layout: ``c<j>/name`` (``j >= 1``)."""
    return name if j == 0 else f"c{j}/{name}"


def unprefixed(name: str, j: int) -> str:
    """The model's name of module ``name`` of checkpoint ``j`` (:func:`prefixed`'s inverse)."""
    prefix = f"c{j}/"
    return name[len(prefix) :] if j and name.startswith(prefix) else name


def validate(data: Dict[str, Any], *, source) -> None:
    """Validate a manifest dict against the JSON Schema shipped in ``schemas/``."""
    import jsonschema

    schema = json.loads(_schema_text())
    try:
        jsonschema.validate(data, schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise IncompatibleIndexError(f"{source}: manifest field {where}: {exc.message}") from exc


def _schema_text() -> str:
    """The manifest's JSON Schema: the source tree's ``schemas/`` when the package runs from one
    (its spec is the one its code writes), else the installed copy."""
    local = Path(__file__).resolve().parents[2] / "schemas" / "manifest.schema.json"
    if local.is_file():
        return local.read_text()
    return resources.files("eogp_index.schemas").joinpath("manifest.schema.json").read_text()


def check_compatible(
    manifest: Manifest,
    *,
    model_hash: Optional[str] = None,
    projection_hash: Optional[str] = None,
    model_fingerprint: Optional[str] = None,
    projection_fingerprint: Optional[str] = None,
    adapter_fingerprint: Optional[str] = None,
    where: str = "this index",
) -> None:
    """Refuse a model or projection other than the one the index was built with.

    ``*_hash`` are full SHA-256s (``manifest.model.weights_sha256``, ``manifest.projection.sha256``);
    ``*_fingerprint`` the sampled fingerprints the manifest records when it has them;
    ``adapter_fingerprint`` that of the loaded model's LoRA adapter (``None``: it has none).
    """
    adapter = manifest.model.get("adapter")
    if adapter is not None and model_fingerprint is not None and adapter_fingerprint != adapter["fingerprint"]:
        state = "has no LoRA adapter" if adapter_fingerprint is None else "has another one"
        raise IncompatibleIndexError(
            f"{where} was built for the LoRA adapter {adapter['path']!r} on {manifest.model['name']!r}, but the "
            f"model given {state} (adapter fingerprint {str(adapter_fingerprint)[:20]}…, the index's "
            f"{adapter['fingerprint'][:20]}…): the adapter changed since the index was built, and scores would "
            "be wrong. Load the adapter the index was built with, or build a new index."
        )
    if model_fingerprint is not None and model_fingerprint != manifest.model.get("weights_fingerprint"):
        raise IncompatibleIndexError(
            f"{where} was built for model {manifest.model['name']!r} (weights fingerprint "
            f"{str(manifest.model.get('weights_fingerprint'))[:20]}…) but the model given has fingerprint "
            f"{model_fingerprint[:20]}…: its weights, names, dtypes or shapes differ; scores would be wrong. "
            "Load the model the index was built with, or build a new index."
        )
    if projection_fingerprint is not None and projection_fingerprint != manifest.projection.get("fingerprint"):
        raise IncompatibleIndexError(
            f"{where}: the projection file's fingerprint {projection_fingerprint[:20]}… differs from the "
            f"manifest's {str(manifest.projection.get('fingerprint'))[:20]}…; the projection was changed after "
            "the rows were stored. Rebuild the index."
        )
    if model_hash is not None and model_hash != manifest.model["weights_sha256"]:
        raise IncompatibleIndexError(
            f"{where} was built for model {manifest.model['name']!r} (weights sha256 "
            f"{manifest.model['weights_sha256'][:12]}…) but the model given hashes to {model_hash[:12]}…; "
            "scores would be wrong. Load the model the index was built with, or build a new index."
        )
    if projection_hash is not None and projection_hash != manifest.projection["sha256"]:
        raise IncompatibleIndexError(
            f"{where}: the projection file's sha256 {projection_hash[:12]}… differs from the manifest's "
            f"{manifest.projection['sha256'][:12]}…; the projection was changed after the rows were stored. "
            "Rebuild the index."
        )


def open_dtype(manifest: Manifest, requested: Optional[str], *, where: str = "this index") -> str:
    """The dtype to run the index's model in: the manifest's, whatever ``requested`` says unless
    it names another one, which is refused.

    Coordinates taken in bfloat16 and in float32 differ by the model's own rounding, so an index's
    stored codes and a query's coordinates must come from the same precision (and the weights
    fingerprint is of the weights in that dtype). ``None`` and ``"auto"`` mean the manifest's.

    Raises:
        IncompatibleIndexError: ``requested`` is another dtype; the message says how to open it.
    """
    built = manifest.model_dtype
    if requested in (None, "auto", built):
        return built
    raise IncompatibleIndexError(
        f"{where} was built with the model in {built} (manifest model.dtype) but {requested} was asked for: its "
        f"codes are {built} gradients, so queries must be too. Open it with --dtype {built} (or auto, the "
        f"default), or build a new index with --dtype {requested}."
    )
