"""Corpus runs into an index: every record of the shards, checked, projected and stored.

:mod:`eogp_index.data` (the library core) reads shards and tokenizes one record;
:mod:`ingest.records` adds the checks across a run's records, :mod:`ingest.pipeline` the
resumable run with rejects, :mod:`ingest.distributed` the torchrun workers.
"""

from eogp_index.data.readers import (
    ParseError,
    RawRecord,
    dataset_shard,
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
    "dataset_shard",
    "expand_shards",
    "iter_examples",
    "iter_raw_records",
    "location_of",
    "shard_names",
    "stable_id",
    "tokenize_record",
]
