"""The doors from Lightning onto the engine: everything here may import Lightning; nothing below it does.

    trainer/           ``Trainer(strategy="zero3")``: the strategy, its precision plugin, checkpointing,
                       the Trainer's steps as phases, the Trainer's side of the automatic offload plan
    fabric/            ``Fabric(strategy="zero3")``: the strategy and its precision plugin
    shared_setup.py    what both doors do the same way: processes, the engine's construction, teardown
    precision_core.py  what both precision plugins share (dtypes from ``config/precision_flags.py``,
                       autocast, the sharded loss scaler)
    cpu_threads.py     how many compute threads a rank on CPU uses
    registration.py    the name ``"zero3"`` in Lightning's registries (and the ``pytorch_lightning`` flavour)

Imports: ``engine``, ``config``, ``checkpoint``, ``export``, ``pretrained`` and ``errors``; within this
folder, the shared modules import neither door, and only ``registration.py`` imports both.
"""
