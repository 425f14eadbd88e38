"""encode/commits.py on a real index: every writer holds the ingest lock while it commits."""

from __future__ import annotations

import pytest
from tinymodels import make_examples

from eogp_index.encode.commits import LOCK_FILE, Commits, index_lock
from eogp_index.errors import ConfigError


def test_the_library_ingest_is_refused_while_another_writer_holds_the_lock(fitted_index):
    examples = make_examples(6, seed=21, prefix="locked")
    before = fitted_index.store.count()
    with index_lock(fitted_index.path):  # another writer (its own open file: flock refuses a second one)
        with pytest.raises(ConfigError, match="another ingest .* is writing"):
            fitted_index.ingest(examples, progress=False)
        assert fitted_index.store.count() == before  # nothing written beside it
    assert (fitted_index.path / LOCK_FILE).exists()
    assert fitted_index.ingest(examples, progress=False) == 6  # the lock is free again
    with index_lock(fitted_index.path):  # and the library's run let it go
        pass


def test_commits_store_each_batch_in_one_commit_and_count_it(fitted_index):
    from eogp_index.config import IngestConfig

    commits = Commits(fitted_index.encoder, IngestConfig(batch_size=4, optimize_threshold=None))
    examples = make_examples(10, seed=22, prefix="commits")
    version = fitted_index.store.version
    committed = []
    try:
        commits.run([examples[:4], [], examples[4:]], on_commit=lambda batch: committed.append(len(batch)))
        commits.finish()
    finally:
        commits.close()
    assert committed == [4, 6] and commits.stored == 10
    assert commits.tokens == sum(e.num_tokens for e in examples)
    assert fitted_index.store.version == version + 2  # one commit a batch; the empty one passed over
