"""An index past one machine: Ray actors that each hold a shard, and batch work over the shards.

Ray is the optional ``cluster`` extra (``pip install 'eogp-index[cluster]'``); only this package
imports it, and only when a command asks for ``--ray``.

==================  ================================================================
``runtime.py``      joining Ray; a table version's fragments split into disjoint shards
``shards.py``       ``eogp serve --ray``: the shard actors and the ingress's pool of them
``query.py``        a question answered by the shards (the one-process query, its scan sharded)
``merge.py``        the shards' top-k lists and roll-up parts merged into one process's answer
==================  ================================================================
"""
