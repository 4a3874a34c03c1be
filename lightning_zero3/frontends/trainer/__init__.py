"""The Trainer's door: ``Zero3Strategy`` (``strategy.py``) with its precision plugin (``precision.py``),
its checkpoint hooks (``checkpointing.py``), its steps as named phases (``phases.py``) and the Trainer's side
of the automatic offload plan (``auto_plan.py``).

Imports: the shared modules of ``frontends/`` and every layer below; never ``fabric/``.
"""
