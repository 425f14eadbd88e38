"""Examples and queries to projected coordinates and stored rows: the room between the stored index
and the search.

* :mod:`~eogp_index.encode.encoder`: the :class:`~eogp_index.encode.encoder.Encoder`, the stored
  index with its model: projection, the first stage, block ingest's cache, Arrow rows.
* :mod:`~eogp_index.encode.measurements`: the one place a query of any kind (text, chat, token
  ids, prompt-completion, preference) becomes coordinates.
* :mod:`~eogp_index.encode.commits`: the one commit loop of every writer, and the ingest lock.
"""
