"""The errors eogp-index raises.

Every message says what went wrong, where (a file, a line, a field, a module name) and how
to fix it. Catch :class:`EOGPError` to handle all of them.
"""

from __future__ import annotations


class EOGPError(Exception):
    """Base class of every error eogp-index raises on purpose."""


class ConfigError(EOGPError, ValueError):
    """A configuration value is out of range or inconsistent with another.

    ``field`` names the option or question field at fault (``"k"``, ``"candidates"``) when known;
    the server reports it as the request field.
    """

    def __init__(self, message: str, *, field: str | None = None):
        self.field = field
        super().__init__(message)


class InputError(EOGPError, ValueError):
    """Bad user data: a malformed record, a missing or mistyped field, an empty document.

    ``location`` names the shard and line or row (``"data/train.jsonl:17"``) when known;
    ``field`` the record or question field at fault (``"prompt"``, ``"where"``), which the server
    reports as the request field.
    """

    def __init__(
        self, message: str, *, location: str | None = None, reason: str | None = None, field: str | None = None
    ):
        self.location = location
        self.field = field
        self.reason = reason or message
        super().__init__(f"{location}: {message}" if location else message)


class QueryTooLongError(InputError):
    """A query has more tokens than the caller accepts (``max_query_tokens``); the server answers 413."""


class ModelError(EOGPError):
    """The model cannot be attributed as asked (no matching modules, unsupported layer)."""


class IndexNotFoundError(EOGPError, FileNotFoundError):
    """The index directory or one of its artifacts is missing."""


class IncompatibleIndexError(EOGPError):
    """The index was built for another model, projection or format version.

    Scoring against it would return wrong numbers, so eogp-index refuses instead.
    """


class NoSpaceError(EOGPError):
    """A file system has no room for what eogp-index must write there.

    ``path`` is where it would be written, ``needed`` the bytes it takes (an estimate where the
    message says "about"), ``free`` the bytes free there when it was refused.
    """

    def __init__(self, message: str, *, path: str, needed: int, free: int):
        self.path = path
        self.needed = needed
        self.free = free
        super().__init__(message)


class ShardUnavailableError(EOGPError):
    """A shard of a served index did not answer (its actor died and did not come back within one
    retry, or it ran past the shard timeout). ``shards``: the ids of the shards that did not answer.
    """

    def __init__(self, message: str, *, shards):
        self.shards = list(shards)
        super().__init__(message)
