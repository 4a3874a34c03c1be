"""Layout: which modules are units and where each parameter lives in its unit's flat buffer (``units.py``,
``slots.py``), what a parameter is while released (``released.py``), and where values come from before
any shard exists (``initialisers.py`` and ``materialize.py`` for models built on the meta device,
``sources.py`` for pretrained checkpoints).
Imports: ``memory`` (and the package's ``config`` / ``errors``).
"""
