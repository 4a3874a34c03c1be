"""TensorBoard monitors of zero3: ``MemoryMonitor`` and ``CommMonitor`` (alone or together, no arguments needed).

    trainer = pl.Trainer(strategy="zero3", callbacks=[MemoryMonitor(), CommMonitor()], logger=TensorBoardLogger("runs"))

Figures are aggregated across ranks (mean and max) and logged under ``zero3/memory/`` and ``zero3/comm/``;
see ``memory.py`` and ``comm.py`` for every tag and ``monitor.py`` for how they are gathered.

Imports: Lightning and the ``engine`` (the figures are the engine's own counters), nothing of the doors.
"""

from .comm import CommMonitor
from .memory import MemoryMonitor
from .monitor import Zero3Monitor, Zero3MonitorError

__all__ = ["CommMonitor", "MemoryMonitor", "Zero3Monitor", "Zero3MonitorError"]
