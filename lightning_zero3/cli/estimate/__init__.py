"""``lightning-zero3 estimate``: will a job fit, and with which offload plan.

    job.py       a job's model (built on the meta device), precision, batch and settings, from the
                 ``fit`` YAML or from a Hugging Face config
    baseline.py  the runtime's own memory: measured on this machine, or a stated default
    command.py   the command line: a table for people, ``--json`` for scripts

The figures come from ``engine/plan/`` (Lightning-free): the engine runs the same estimate at setup when
an offload setting is ``"auto"``.

Imports: ``engine/plan``, ``config``, and ``cli/fit.py`` to read a job's YAML as ``fit`` would.
"""
