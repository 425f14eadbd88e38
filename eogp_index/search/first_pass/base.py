"""What every first pass is: the interface, the code the kinds share, and the registry of kinds.

A first pass answers one query side with a few rows of the store scored exactly, without scoring
every row: :meth:`FirstPass.top_k`. A kind is a subclass registered once by naming itself,
``class FlatFirstPass(FaissFirstPass, kind="flat")`` (:meth:`FirstPass.__init_subclass__`), with
its own frozen configuration class ``Config`` (a :class:`FirstPassConfig`). Everything else looks
a kind up here (:func:`kind_class`, :func:`class_for`); nothing compares kind names.

Every kind keeps its files in ``<index>/faiss/<name>.*`` (the folder's name is part of the
on-disk format, older than the kinds) and writes ``<name>.json`` last: it commits a
build. The JSON's ``kind`` says which class opens the files, its ``format`` and
``format_version`` which layout they have (schemas/index.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Mapping, Optional, Sequence, Tuple, Type, Union

from eogp_index.data.location import index_path, is_remote, local_cache_dir, upload, write_atomic
from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError
from eogp_index.version import __version__

if TYPE_CHECKING:  # recall.py scans the hot copy; imported where a recall is measured
    from eogp_index.search.first_pass.recall import Recall

#: The folder of ``<index>`` that holds every first pass's files.
FIRST_PASS_DIR = "faiss"
#: The command that builds a first pass (named in every "rebuild it" message).
BUILD_COMMAND = "eogp build-candidates"

#: ``kind`` → its class, filled by :meth:`FirstPass.__init_subclass__`.
_KINDS: Dict[str, Type["FirstPass"]] = {}
#: The kind :func:`~eogp_index.search.first_pass.build` and ``eogp build-candidates`` build by default.
DEFAULT_KIND = "flat"
#: Kinds this eogp-index no longer builds or opens, with why (for the message that asks for a rebuild).
RETIRED_KINDS: Dict[str, str] = {
    kind: "on real gradient codes it does not find 95% of the exact top 20 among 5 × 20 candidates (docs/benchmarks.md)"
    for kind in ("ivf", "hnsw", "clustered")
}

#: What :meth:`FirstPass.top_k` returns per side: row addresses ``(r,)`` uint64, their exact
#: scores ``(r,)`` float32, and how many rows were scored exactly to find them.
SideAnswer = Tuple[Any, Any, int]


def search_param(default: Any, help: str, **limits: Any) -> Any:
    """A configuration field read at search time (:meth:`FirstPass.set_search` may change it)."""
    return dataclasses.field(default=default, metadata={"help": help, "search": True, **limits})


def build_param(default: Any, help: str, **limits: Any) -> Any:
    """A configuration field read when the first pass is built (later: from its saved JSON)."""
    return dataclasses.field(default=default, metadata={"help": help, "search": False, **limits})


@dataclasses.dataclass(frozen=True)
class FirstPassConfig:
    """Base of every kind's configuration: fields made with :func:`build_param` or
    :func:`search_param`, checked against their ``min`` (``min_open``: excluded), ``max`` and
    ``choices`` metadata."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            where = f"{type(self).__name__}.{f.name}"
            if "choices" in meta and value not in meta["choices"]:
                raise ConfigError(f"{where} must be one of {list(meta['choices'])}, got {value!r}")
            if value is None or not ("min" in meta or "max" in meta):
                continue
            low, high = meta.get("min", float("-inf")), meta.get("max", float("inf"))
            above = value > low if meta.get("min_open") else value >= low
            if not (above and value <= high):
                span = f"{'>' if meta.get('min_open') else '>='} {low}" + (f" and <= {high}" if "max" in meta else "")
                raise ConfigError(f"{where} must be {span}, got {value!r}")

    @classmethod
    def search_params(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("search"))


def kinds() -> Tuple[str, ...]:
    """The registered kinds, in registration order."""
    return tuple(_KINDS)


def kind_class(kind: str) -> Type["FirstPass"]:
    """The class of first-pass kind ``kind``.

    Raises:
        ConfigError: no such kind.
    """
    try:
        return _KINDS[kind]
    except KeyError:
        if kind in RETIRED_KINDS:
            raise ConfigError(
                f"the {kind!r} first pass is retired: {RETIRED_KINDS[kind]}. Use --kind {DEFAULT_KIND}"
            ) from None
        raise ConfigError(f"unknown first-pass kind {kind!r}; the kinds are {list(_KINDS)}") from None


def class_for(config: FirstPassConfig) -> Type["FirstPass"]:
    """The kind whose ``Config`` ``config`` is.

    Raises:
        ConfigError: ``config`` is no kind's configuration.
    """
    for cls in _KINDS.values():
        if type(config) is cls.Config:
            return cls
    raise ConfigError(
        f"{type(config).__name__} is not the configuration of a first pass; pass one of "
        f"{[cls.Config.__name__ for cls in _KINDS.values()]}"
    )


def make_config(kind: str, **params: Any) -> FirstPassConfig:
    """``kind``'s configuration with ``params`` (the rest at their defaults).

    Raises:
        ConfigError: an unknown kind, a parameter the kind does not have, or a value out of range.
    """
    config_class = kind_class(kind).Config
    own = {f.name for f in dataclasses.fields(config_class)}
    other = sorted(set(params) - own)
    if other:
        raise ConfigError(
            f"the {kind!r} first pass has no parameter {', '.join(other)}; its parameters are {sorted(own)}"
        )
    return config_class(**params)


def require_signs(stored) -> None:
    """Refuse an index that stores coordinates: every first pass reads packed signs and scales."""
    if stored.manifest.precision != "1bit":
        raise IncompatibleIndexError(
            f"{stored.path}: first passes need stored signs, but this index stores precision "
            f"{stored.manifest.precision!r} coordinates. Use the exact scan (no candidates) or build a "
            "1-bit index (--precision 1bit)"
        )


def load_faiss():
    """The ``faiss`` module, or a ConfigError saying how to install it."""
    try:
        import faiss
    except ImportError as exc:  # pragma: no cover - faiss is a dependency of the cpu/gpu extras
        raise ConfigError("FAISS is not installed: pip install 'eogp-index[cpu]' (or [gpu])") from exc
    return faiss


def temporary(path: Path) -> Path:
    """Where ``path`` is written before :func:`commit` moves it into place: beside it, or for an
    index in an object store, a local file (uploaded by :func:`commit`)."""
    if is_remote(path):
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"eogp-{digest}-{path.name}.tmp-{os.getpid()}"
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def commit(paths: Sequence[Path]) -> None:
    """Move each written :func:`temporary` file into place, in order: the JSON goes last. In an
    object store each is one upload (whole or not at all); the JSON, uploaded last, names what
    the others are, so a reader that finds them disagreeing is told to rebuild."""
    for path in paths:
        if is_remote(path):
            try:
                upload(temporary(path), path)
            finally:
                temporary(path).unlink(missing_ok=True)
        else:
            temporary(path).replace(path)


def readable(path: Path) -> Path:
    """A local file holding ``path``'s bytes, for readers of local files only (FAISS): ``path``
    itself, or for an object, a copy in the index's local cache folder, fetched when the object
    changed (its size or time) or is not there yet."""
    if not is_remote(path):
        return path
    local = local_cache_dir(path.parent.parent) / FIRST_PASS_DIR / path.name
    stamp, seen = path.stamp(), local.with_name(f"{local.name}.stamp")
    if not local.exists() or not seen.exists() or seen.read_text() != stamp:
        write_atomic(local, path.read_bytes())
        write_atomic(seen, stamp)
    return local


class FirstPass(ABC):
    """One first pass of an index: its files, its configuration and how it answers a query side.

    Subclasses set ``FORMAT``, ``FORMAT_VERSION``, ``FILES`` (role → file suffix, ``meta`` the
    JSON) and ``Config``, register with ``kind=...``, and implement :meth:`build`, :meth:`_open`,
    :meth:`refresh`, :meth:`top_k`, :attr:`ntotal` and :attr:`build_params`.

    Attributes:
        index_dir, name: where the files are: ``<index_dir>/faiss/<name>.*``.
        config: the kind's ``Config``; its search parameters can be changed with :meth:`set_search`.
        meta: the ``<name>.json`` contents.
    """

    kind: ClassVar[str]
    Config: ClassVar[Type[FirstPassConfig]]
    FORMAT: ClassVar[str]
    FORMAT_VERSION: ClassVar[int]
    FILES: ClassVar[Mapping[str, str]] = {"meta": ".json"}
    #: Older format versions this code refuses, with what changed since (for the message).
    OLD_FORMATS: ClassVar[Mapping[int, str]] = {}

    def __init_subclass__(cls, *, kind: Optional[str] = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is None:  # a family of kinds (FaissFirstPass): shared code, not a kind itself
            return
        if kind in _KINDS:
            raise TypeError(f"first-pass kind {kind!r} is registered twice ({_KINDS[kind].__name__}, {cls.__name__})")
        cls.kind = kind
        _KINDS[kind] = cls

    def __init__(self, index_dir: Union[str, Path], name: str, config: FirstPassConfig, meta: Dict[str, Any]):
        self.index_dir = index_path(index_dir)
        self.name = name
        self.config = config
        self.meta = meta

    # -- files ---------------------------------------------------------------------------------
    @classmethod
    def paths(cls, index_dir: Union[str, Path], name: str) -> Dict[str, Path]:
        """``{"dir": <index_dir>/faiss, role: file, ...}`` of first pass ``name``.

        Raises:
            ConfigError: ``name`` is not a plain file name.
        """
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"a first pass's name must be a plain file name, got {name!r}")
        base = index_path(index_dir) / FIRST_PASS_DIR
        return {"dir": base, **{role: base / f"{name}{suffix}" for role, suffix in cls.FILES.items()}}

    @classmethod
    def rebuild_hint(cls, index_dir: Union[str, Path], name: str) -> str:
        return f"`{BUILD_COMMAND} {index_dir} --kind {cls.kind} --name {name}`"

    @classmethod
    def provenance(cls, stored, name: str) -> Dict[str, Any]:
        """The JSON fields every kind records: format, kind, layout, and what the codes came from."""
        return {
            "format": cls.FORMAT,
            "format_version": cls.FORMAT_VERSION,
            "name": name,
            "kind": cls.kind,
            "nbytes": stored.layout.nbytes,
            "k": list(stored.layout.k),
            "table": stored.manifest.table,
            "projection_sha256": stored.manifest.projection["sha256"],
            "weights_sha256": stored.manifest.model.get("weights_sha256"),
            "created_by": f"eogp-index {__version__}",
        }

    # -- opening -------------------------------------------------------------------------------
    @classmethod
    def load(
        cls, index_dir: Union[str, Path], name: str = "default", *, config: Optional[FirstPassConfig] = None
    ) -> "FirstPass":
        """Open first pass ``name`` of ``index_dir``, whichever its kind (its JSON says).

        Args:
            config: search parameters to use, a ``Config`` of the saved kind; build parameters
                always come from the saved files.

        Raises:
            IndexNotFoundError: no first pass ``name``.
            IncompatibleIndexError: an unknown kind, another format or format version, or files
                that disagree with the JSON (an interrupted write).
            ConfigError: ``config`` is another kind's configuration.
        """
        found, meta = FirstPass.saved(index_dir, name)
        meta_path = FirstPass.paths(index_dir, name)["meta"]
        if not issubclass(found, cls):
            raise IncompatibleIndexError(
                f"{meta_path} is a {found.kind!r} first pass, not a {cls.__name__}; open it "
                "with eogp_index.search.first_pass.load, which opens every kind"
            )
        if config is not None and type(config) is not found.Config:
            raise ConfigError(
                f"{meta_path} is a {found.kind!r} first pass: pass a {found.Config.__name__} "
                f"(or no config), not a {type(config).__name__}"
            )
        return found._open(index_path(index_dir), name, meta, config or found.Config())

    @staticmethod
    def saved(index_dir: Union[str, Path], name: str = "default") -> Tuple[Type["FirstPass"], Dict[str, Any]]:
        """The kind and the JSON of first pass ``name`` of ``index_dir``, checked as :meth:`load`
        checks them, without reading its other files.

        Raises:
            IndexNotFoundError: no first pass ``name``.
            IncompatibleIndexError: an unknown or retired kind, or another format or format version.
        """
        meta_path = FirstPass.paths(index_dir, name)["meta"]
        if not meta_path.exists():
            raise IndexNotFoundError(
                f"{meta_path} not found: no first pass named {name!r} in {index_dir}; build "
                f"one with `{BUILD_COMMAND} {index_dir} --name {name}`"
            )
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError as exc:
            raise IncompatibleIndexError(
                f"{meta_path} is not JSON ({exc}); rebuild it with `{BUILD_COMMAND} {index_dir} --name {name}`"
            ) from exc
        found = _KINDS.get(meta.get("kind"))
        if meta.get("kind") in RETIRED_KINDS:
            raise IncompatibleIndexError(
                f"{meta_path}: a first pass of kind {meta['kind']!r}, which is retired "
                f"({RETIRED_KINDS[meta['kind']]}); rebuild it with "
                f"`{BUILD_COMMAND} {index_dir} --kind {DEFAULT_KIND} --name {name}`"
            )
        if found is None:
            raise IncompatibleIndexError(
                f"{meta_path}: a first pass of kind {meta.get('kind')!r}, which this eogp-index does not know "
                f"(kinds: {list(_KINDS)}); rebuild it with `{BUILD_COMMAND} {index_dir} --name {name}`"
            )
        if meta.get("format") != found.FORMAT or meta.get("format_version") != found.FORMAT_VERSION:
            why = found.OLD_FORMATS.get(meta.get("format_version"))
            raise IncompatibleIndexError(
                f"{meta_path}: format {meta.get('format')!r} version {meta.get('format_version')!r}, but this "
                f"eogp-index reads {found.FORMAT!r} version {found.FORMAT_VERSION}{f' ({why})' if why else ''}; "
                f"rebuild it with {found.rebuild_hint(index_dir, name)}"
            )
        return found, meta

    @classmethod
    @abstractmethod
    def _open(cls, index_dir: Path, name: str, meta: Dict[str, Any], config: FirstPassConfig) -> "FirstPass":
        """Read the files of a first pass whose JSON (``meta``) is checked already."""

    @classmethod
    @abstractmethod
    def build(cls, stored, name: str, config: FirstPassConfig, *, progress: bool = False) -> "FirstPass":
        """Build (or replace) first pass ``name`` over every stored row of ``stored`` (a
        :class:`~eogp_index.store.stored_index.StoredIndex` with ``precision="1bit"``), and save it."""

    @classmethod
    def over_rows(cls, stored, meta: Dict[str, Any]) -> "FirstPass":
        """A first pass of this kind, with the build parameters of a saved one (``meta``: its JSON,
        :meth:`saved`), over the rows of ``stored``'s hot copy only, held in memory and never
        saved: what a shard of ``eogp serve --ray`` builds over its own rows. It answers
        :meth:`top_k` for that ``stored`` as the saved one answers for the whole index.

        Raises:
            ConfigError: a kind that cannot be built in memory (the default).
            IncompatibleIndexError: ``meta`` was made from other codes than ``stored``'s.
        """
        raise ConfigError(
            f"a {cls.kind!r} first pass cannot be built over a shard's rows; ask without candidates, or "
            "serve the index on one process (eogp serve without --ray)"
        )

    # -- keeping current -----------------------------------------------------------------------
    def check_compatible(self, stored) -> None:
        """Refuse an index whose codes are not the ones this first pass was made from.

        Raises:
            IncompatibleIndexError: other projection, model, layout or table; or not 1-bit.
        """
        require_signs(stored)
        checks = [
            ("projection sha256", self.meta.get("projection_sha256"), stored.manifest.projection.get("sha256")),
            ("model weights sha256", self.meta.get("weights_sha256"), stored.manifest.model.get("weights_sha256")),
            ("sign layout k", list(self.meta.get("k", [])), list(stored.layout.k)),
            ("table", self.meta.get("table"), stored.manifest.table),
        ]
        for what, ours, theirs in checks:
            if ours != theirs:
                raise IncompatibleIndexError(
                    f"{self.paths(self.index_dir, self.name)['meta']} was built from another index ({what}: {ours!r} "
                    f"here, {theirs!r} in {stored.path}); its rows would not match these. Rebuild it with "
                    f"{self.rebuild_hint(stored.path, self.name)}"
                )

    @abstractmethod
    def refresh(self, stored, *, progress: bool = False) -> "FirstPass":
        """This first pass brought to the table's current version (saved); returns the one to use
        (``self``, or a rebuilt one)."""

    @property
    def table_version(self) -> int:
        """The table version the first pass covers."""
        return int(self.meta["table_version"])

    @property
    @abstractmethod
    def ntotal(self) -> int:
        """Rows covered."""

    @property
    @abstractmethod
    def build_params(self) -> Dict[str, Any]:
        """The build parameters the files were made with, for reports (``eogp build-candidates``)."""

    def record_recall(self, stored, *, C: Optional[int] = None) -> "Recall":
        """Measure this first pass's recall (:func:`~eogp_index.search.first_pass.recall.measure_on_stored_rows`)
        at budget ``C`` (default ``5 k``) and record it in its JSON under ``recall``."""
        from eogp_index.search.first_pass.recall import measure_on_stored_rows

        recall = measure_on_stored_rows(self, stored, C=C)
        self.meta = {**self.meta, "recall": recall.to_json()}
        path = self.paths(self.index_dir, self.name)["meta"]
        temporary(path).write_text(json.dumps(self.meta, indent=2) + "\n")
        commit([path])
        return recall

    # -- searching -----------------------------------------------------------------------------
    def set_search(self, **params: Any) -> None:
        """Change search parameters (``None`` keeps one). A search parameter of another kind is
        ignored, so that one call can tune whichever kind an index has.

        Raises:
            ConfigError: a name that is no kind's search parameter, or a value out of range.
        """
        known = {p for cls in _KINDS.values() for p in cls.Config.search_params()}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ConfigError(f"{unknown} are not search parameters of a first pass; they are {sorted(known)}")
        own = self.Config.search_params()
        changes = {p: v for p, v in params.items() if p in own and v is not None}
        self.config = dataclasses.replace(self.config, **changes)

    @abstractmethod
    def top_k(
        self, stored, y, k: int, C: int, sides: Sequence[str], *, where: Optional[str] = None
    ) -> Dict[str, SideAnswer]:
        """One query's candidates per side, scored exactly.

        Args:
            stored: the :class:`~eogp_index.store.stored_index.StoredIndex` the first pass belongs to.
            y: ``(1, K)`` float32 query coordinates. k: rows wanted per side.
            C: the kind's budget per side (candidates, or rows scanned).
            sides: ``"positive"`` and/or ``"negative"``.
            where: SQL filter (:meth:`StoredIndex.matching_rows`); only matching rows are answered.

        Returns:
            ``{side: (rowaddr (r,) uint64, exact scores (r,) float32, rows scored)}``; the ranking
            picks the best ``k`` of each.
        """
