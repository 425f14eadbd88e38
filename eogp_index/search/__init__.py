"""Stage 5: scoring queries against stored codes — kernels, top-k, streamed, sharded and FAISS-candidate routes."""
