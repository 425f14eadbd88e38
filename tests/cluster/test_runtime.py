"""The split of a table version's fragments into shards (no Ray needed)."""

import pytest

from eogp_index.cluster.runtime import fragment_shards
from eogp_index.errors import ConfigError


def test_every_fragment_lands_in_exactly_one_shard_balanced_by_rows():
    fragments = [(0, 100), (1, 10), (2, 60), (3, 50), (4, 40), (5, 5)]
    shards = fragment_shards(fragments, 2)
    assert sorted(f for shard in shards for f in shard) == [0, 1, 2, 3, 4, 5]
    rows = dict(fragments)
    loads = sorted(sum(rows[f] for f in shard) for shard in shards)
    assert loads == [125, 140]  # greedy: 100+40 and 60+50+10+5
    assert fragment_shards(list(reversed(fragments)), 2) == shards


def test_more_shards_than_fragments_leaves_some_empty_and_zero_shards_is_refused():
    assert fragment_shards([(7, 3)], 3) == [[7], [], []]
    with pytest.raises(ConfigError, match="--shards"):
        fragment_shards([(0, 1)], 0)
