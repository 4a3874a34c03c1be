"""Collectives and their timing: the one place that talks to other ranks.

``communicator.py`` issues every collective and counts its bytes and time (``records.py``, ``timing.py``,
``topology.py`` for the bytes that cross nodes); ``quantize.py`` encodes int8 gathers; ``agreement.py``
checks that every rank is about to run the same all-gather; ``watchdog.py`` and ``process_exit.py`` end
every rank together when one fails and close the process groups at exit.
Imports: nothing else of the engine (a unit's group is seen through the small protocol it needs).
"""
