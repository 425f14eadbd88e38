"""Fixtures of the record and reader tests (the tokenizer and shard writers are in tests/shards.py)."""

import pytest


@pytest.fixture(autouse=True)
def _quiet(quiet_datasets):
    """No progress bars or cache writes outside tmp_path from `datasets`."""
