"""Stage 4 and the index on disk: one-bit codes (a codec per precision), the LanceDB table, the manifest, the hot copy."""
