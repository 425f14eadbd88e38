"""Corpus data: shards read record by record, and records turned into tokenized examples (text, chat, ids).

Shared by ingest (training documents), queries (the same tokenization) and explanations (a
document read back from its shard)."""
