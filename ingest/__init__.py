"""Reading corpus shards and tokenizing their records into training examples.

:mod:`ingest.readers` finds shards and streams raw records; :mod:`ingest.records` turns them
into :class:`Example` objects (token ids, loss labels, id, metadata).
"""

from ingest.readers import (
    ParseError,
    RawRecord,
    expand_shards,
    iter_raw_records,
    location_of,
    shard_names,
)
from ingest.records import (
    IGNORE_INDEX,
    Example,
    RecordSpec,
    Rejected,
    RunState,
    iter_examples,
    stable_id,
    tokenize_record,
)

__all__ = [
    "IGNORE_INDEX",
    "Example",
    "ParseError",
    "RawRecord",
    "RecordSpec",
    "Rejected",
    "RunState",
    "expand_shards",
    "iter_examples",
    "iter_raw_records",
    "location_of",
    "shard_names",
    "stable_id",
    "tokenize_record",
]
