"""The per-example gradient, shared by fitting, ingest and queries: records → tokens → (a, g) per module."""
