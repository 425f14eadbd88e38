"""An index past one machine: Ray actors that each hold a shard, and batch work over the shards.

Ray is the optional ``cluster`` extra (``pip install 'eogp-index[cluster]'``); only this package
imports it, and only when a command asks for ``--ray``.
"""
