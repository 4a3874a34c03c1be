"""Shards: a unit's flat group (master shard, gathered buffer, per-parameter views; ``flat_group.py``), how
its all-gather travels (``gather.py``), node-local secondary shards (``secondary.py``), and the live state
of a planned unit (``runtime.py``).
Imports: ``memory``, ``comm``, ``layout``, ``offload``.
"""
