"""``eogp serve``: an influence query server and web page over one index.

The model and the hot copy load once; queries that arrive together share one gradient pass
(:mod:`~eogp_index.serve.batching`), and their scans are grouped by filter
(:mod:`~eogp_index.serve.engine`). :func:`eogp_index.serve.app.create_app` builds the ASGI app
(FastAPI on uvicorn, the ``serve`` extra); :mod:`~eogp_index.serve.config` holds its settings and
imports nothing heavy, so the command line can build its options from it.
"""
