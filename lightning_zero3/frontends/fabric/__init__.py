"""Fabric's door: ``Zero3FabricStrategy`` and ``Zero3FabricPrecision`` (``strategy.py``).

Imports: the shared modules of ``frontends/`` and every layer below; never ``trainer/``.
"""
