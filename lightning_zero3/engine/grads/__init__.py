"""Gradients: which gradients arrived (``arrivals.py``), their reduce-scatter into this rank's gradient
shards in one order on every rank (``reduction.py``), clipping and unscaling wherever the shards live
(``gradients.py``), and the user's optimizer moved onto the shards (``optim.py``).
Imports: ``memory``, ``comm``, ``layout``, ``offload``, ``shard``.
"""
