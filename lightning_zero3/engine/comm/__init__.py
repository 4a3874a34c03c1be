"""Collectives and their timing: the one place that talks to other ranks.

``communicator.py`` issues every collective and counts its bytes and time (``records.py``, ``timing.py``,
``topology.py`` for the bytes that cross nodes); ``quantize.py`` encodes int8 gathers; ``agreement.py``
checks that every rank is about to run the same all-gather; ``collective_log.py`` keeps what this rank
is doing (its collectives per group, the one it waits in, its phase), which ``failure/`` publishes and
reads to end every rank when they wait in collectives that can never complete.
Imports: nothing else of the engine (a unit's group is seen through the small protocol it needs).
"""
