"""Failure handling: every rank ends, with a message that says why, instead of waiting forever.

``watchdog.py`` publishes what this rank is doing (``comm/collective_log.py``) from a heartbeat thread and
``hang_check.py`` reads its peers' records to end every rank when they wait in collectives that can never
complete; ``termination.py`` turns SIGTERM into the same end; ``process_exit.py`` closes the process groups
at exit, also after a failure.
Imports: ``comm`` only (what a rank is doing is recorded there, by the collectives themselves).
"""
