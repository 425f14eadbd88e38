"""eogp-index: an EOGP attribution index for language models, stored in LanceDB.

Example:
    >>> from eogp_index import AttributionIndex  # doctest: +SKIP
    >>> index = AttributionIndex.open("my-index")  # doctest: +SKIP
    >>> index.top_influential("Paris is the capital of France.", k=5)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from eogp_index.version import __version__  # noqa: F401  (the one place the version is written)

# Names resolved on first access (PEP 562): `import eogp_index` (and so `eogp --help`) must not
# pay for torch, transformers and LanceDB, which `eogp_index.client` imports.
_LAZY = {
    "AttributionIndex": "eogp_index.client",
    "StoredIndex": "eogp_index.store.stored_index",
    "CurvatureConfig": "eogp_index.config",
    "GradientConfig": "eogp_index.config",
    "IngestConfig": "eogp_index.config",
    "ProjectionConfig": "eogp_index.config",
    "StorageConfig": "eogp_index.config",
    "SelectOptions": "eogp_index.config",
    "Question": "eogp_index.search.question",
    "EOGPError": "eogp_index.errors",
    "ConfigError": "eogp_index.errors",
    "InputError": "eogp_index.errors",
    "ModelError": "eogp_index.errors",
    "IndexNotFoundError": "eogp_index.errors",
    "IncompatibleIndexError": "eogp_index.errors",
    "NoSpaceError": "eogp_index.errors",
    "QueryTooLongError": "eogp_index.errors",
}

__all__ = list(_LAZY)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from eogp_index.client import AttributionIndex
    from eogp_index.config import (
        CurvatureConfig,
        GradientConfig,
        IngestConfig,
        ProjectionConfig,
        SelectOptions,
        StorageConfig,
    )
    from eogp_index.errors import (
        ConfigError,
        EOGPError,
        IncompatibleIndexError,
        IndexNotFoundError,
        InputError,
        ModelError,
        NoSpaceError,
        QueryTooLongError,
    )
    from eogp_index.search.question import Question
    from eogp_index.store.stored_index import StoredIndex


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'eogp_index' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
