"""State: optimizer state between its sharded and its full form (``optimizer_state.py``), and filling the
shards from a checkpoint's sources (``loading.py``). The engine is seen through the small protocol each
needs.
Imports: every layer below (``memory``, ``comm``, ``layout``, ``offload``, ``shard``, ``grads``).
"""
