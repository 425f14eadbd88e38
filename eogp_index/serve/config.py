"""The server's settings: one frozen dataclass, also the source of ``eogp serve``'s options.

Imports nothing heavy (no torch, no FastAPI): ``eogp --help`` builds its options from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from eogp_index.errors import ConfigError


@dataclass(frozen=True)
class ServeConfig:
    """How ``eogp serve`` listens, batches and limits requests.

    A request that waits in the queue longer than ``timeout_s`` (or whose batch runs past it)
    is answered 504; a full queue is answered 503 with ``Retry-After``.
    """

    host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "Address to bind. The default is reachable from this machine only; 0.0.0.0 opens it to "
            "the network (then set --token)."
        },
    )
    port: int = field(default=8000, metadata={"help": "TCP port to listen on (0: any free port).", "min": 0})
    token: Optional[str] = field(
        default=None,
        metadata={"help": "Require 'Authorization: Bearer TOKEN' on /v1/ endpoints (the page asks for it once)."},
    )
    write_token: Optional[str] = field(
        default=None,
        metadata={
            "help": "Allow DELETE /v1/examples (takedowns) to requests with 'Authorization: Bearer "
            "WRITE_TOKEN'; without it the server refuses deletes."
        },
    )
    batch_window_ms: float = field(
        default=2.0,
        metadata={
            "help": "Close a batch when no query has arrived for this long (at most 10x this after its "
            "first); queries that queue while the model is busy join the next pass.",
            "min": 0.0,
        },
    )
    max_batch: int = field(default=32, metadata={"help": "Most queries in one gradient pass.", "min": 1})
    queue_size: int = field(
        default=256,
        metadata={
            "help": "Most requests waiting for the model; beyond it requests get 503 with Retry-After.",
            "min": 1,
        },
    )
    timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "Seconds a request may wait and run before it is answered 504.",
            "min": 0.0,
            "min_open": True,
        },
    )
    max_k: int = field(default=100, metadata={"help": "Largest k a query may ask for.", "min": 1})
    max_query_tokens: int = field(
        default=1024, metadata={"help": "Longest query, in tokens before the index's truncation.", "min": 1}
    )
    max_request_bytes: int = field(
        default=1 << 20, metadata={"help": "Largest request body, in bytes (413 beyond it).", "min": 1}
    )
    max_queries: int = field(
        default=64,
        metadata={"help": "Most queries in one behaviour query (queries answered together with aggregate).", "min": 1},
    )
    shard_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "With --ray: seconds a shard may take to answer one scan; a shard past it is missing from the "
            "answer (an error naming it, unless the request sets allow_partial).",
            "min": 0.0,
            "min_open": True,
        },
    )

    def __post_init__(self) -> None:
        for name in ("max_batch", "queue_size", "max_k", "max_query_tokens", "max_request_bytes", "max_queries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ServeConfig.{name} must be a positive integer, got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"ServeConfig.port must be in 0..65535, got {self.port!r}")
        if self.batch_window_ms < 0 or self.timeout_s <= 0 or not self.shard_timeout_s > 0:
            raise ConfigError(
                "ServeConfig.batch_window_ms must be >= 0, and timeout_s and shard_timeout_s > 0, got "
                f"{self.batch_window_ms!r}, {self.timeout_s!r} and {self.shard_timeout_s!r}"
            )
        if self.token is not None and not self.token.strip():
            raise ConfigError("ServeConfig.token must not be empty; leave --token out to serve without one")
        if self.write_token is not None and not self.write_token.strip():
            raise ConfigError("ServeConfig.write_token must not be empty; leave --write-token out to refuse deletes")

    @property
    def window_s(self) -> float:
        return self.batch_window_ms / 1000.0
