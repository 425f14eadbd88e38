"""IngestConfig: the one configuration of the three ingest entry points, and their keyword
arguments as replacements of its fields (no model: every check here runs before one is needed)."""

from __future__ import annotations

import dataclasses

import pytest

from eogp_index.config import DEFAULT_COMMIT_ROWS, IngestConfig
from eogp_index.errors import ConfigError


def test_keyword_arguments_replace_fields_and_unknown_ones_are_named():
    config = IngestConfig(batch_size=64, store_text=1024)
    assert config.with_options() is config
    assert config.with_options(batch_size=8) == IngestConfig(batch_size=8, store_text=1024)
    with pytest.raises(ConfigError, match=r"unknown ingest options \['batch'\]: IngestConfig's fields are"):
        config.with_options(batch=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("on_error", "ignore", r"on_error must be 'raise' or 'skip' \(--on-error\)"),
        ("batch_size", 0, r"IngestConfig.batch_size \(--batch-size\) must be a positive int"),
        ("block_documents", 2.5, r"IngestConfig.block_documents \(--block-documents\) must be a positive int"),
        ("store_text", True, r"IngestConfig.store_text \(--store-text-max-bytes\) must be a positive int"),
        ("commit_every", 0, r"commit_every \(--commit-every\) must be a positive int"),
        ("optimize_threshold", -1, r"optimize_threshold must be a non-negative int or None"),
    ],
)
def test_bad_values_fail_where_they_are_set(field, value, message):
    with pytest.raises(ConfigError, match=message):
        IngestConfig(**{field: value})


def test_rows_per_commit_are_whole_gradient_batches():
    assert IngestConfig().commit_rows(8) == DEFAULT_COMMIT_ROWS
    assert IngestConfig().commit_rows(6, default=6) == 6  # AttributionIndex.ingest: a gradient batch
    assert IngestConfig(batch_size=10).commit_rows(4) == 12
    assert IngestConfig(batch_size=3).commit_rows(8) == 3  # one smaller gradient batch


def test_an_entry_point_refuses_what_it_cannot_honour_before_it_needs_a_model():
    from ingest.distributed import run_distributed_ingest
    from ingest.pipeline import run_ingest

    with pytest.raises(ConfigError, match="commit_every does not apply here: it applies to torchrun workers"):
        run_ingest(None, [], IngestConfig(commit_every=2))
    with pytest.raises(ConfigError, match="commit_every"):
        run_distributed_ingest("no-index", [], commit_every=0)
    with pytest.raises(ConfigError, match="spec, shard_root do not apply here"):
        IngestConfig(spec=object(), shard_root="data").refuse(("spec", "shard_root"), "why")
