"""eogp-index: an EOGP attribution index for language models, stored in LanceDB."""

__version__ = "0.1.0"
