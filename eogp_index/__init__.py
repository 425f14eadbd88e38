"""eogp-index: an EOGP attribution index for language models, stored in LanceDB.

Example:
    >>> from eogp_index import AttributionIndex  # doctest: +SKIP
    >>> index = AttributionIndex.open("my-index")  # doctest: +SKIP
    >>> index.top_influential("Paris is the capital of France.", k=5)  # doctest: +SKIP
"""

__version__ = "0.1.0"

from eogp_index.client import AttributionIndex  # noqa: E402
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig  # noqa: E402
from eogp_index.errors import (  # noqa: E402
    ConfigError,
    EOGPError,
    IncompatibleIndexError,
    IndexNotFoundError,
    InputError,
    ModelError,
)

__all__ = [
    "AttributionIndex",
    "CurvatureConfig",
    "GradientConfig",
    "ProjectionConfig",
    "StorageConfig",
    "EOGPError",
    "ConfigError",
    "InputError",
    "ModelError",
    "IndexNotFoundError",
    "IncompatibleIndexError",
]
