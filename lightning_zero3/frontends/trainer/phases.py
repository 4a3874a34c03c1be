"""The Trainer's steps as phases (engine/comm/collective_log.py), and its SIGTERM handler replaced.

``PhasesMixin`` goes before Lightning's strategy class in ``Zero3Strategy``'s bases: each step method
runs inside a phase named after it and the step number, so a message about ranks that wait in
different collectives says "training step 3 > backward" rather than only which collective. A phase
costs a list append and pop per call, not per collective.

On ``on_train_start`` (Lightning registers its signal handlers after ``setup``, just before it), the
SIGTERM handler that Lightning registered is replaced: see [Note: SIGTERM while a collective waits] in
engine/failure/termination.py.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from ...engine.comm.collective_log import LOG, phase
from ...engine.failure.termination import lightning_handler


class PhasesMixin:
    """Step phases and the SIGTERM handler for a Lightning strategy (``self`` is the strategy)."""

    def _step_number(self) -> int:
        module = getattr(self, "lightning_module", None)
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer.global_step if trainer is not None else 0

    # Under automatic optimization ``training_step`` and ``backward`` run inside ``optimizer_step`` (the
    # closure): "training step 2 > training_step > backward"; under manual optimization, the other way round.
    def _label(self, name: str) -> str:
        return name if LOG.phases else f"training step {self._step_number()} ({name})"

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        with phase(f"training step {self._step_number()}" if not LOG.phases else "optimizer step"):
            return super().optimizer_step(*args, **kwargs)  # type: ignore[misc]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with phase(self._label("training_step")):
            return super().training_step(*args, **kwargs)  # type: ignore[misc]

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        with phase(self._label("backward")):
            return super().backward(*args, **kwargs)  # type: ignore[misc]

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with phase("validation step"):
            return super().validation_step(*args, **kwargs)  # type: ignore[misc]

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with phase("test step"):
            return super().test_step(*args, **kwargs)  # type: ignore[misc]

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with phase("predict step"):
            return super().predict_step(*args, **kwargs)  # type: ignore[misc]

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is None or threading.current_thread() is not threading.main_thread():
            return
        module = getattr(self, "lightning_module", None)
        connector = getattr(getattr(module, "_trainer", None), "_signal_connector", None)
        if connector is None or signal.getsignal(signal.SIGTERM) in (signal.SIG_IGN, signal.SIG_DFL, None):
            return

        def mark() -> None:
            connector.received_sigterm = True

        signal.signal(signal.SIGTERM, lightning_handler(mark))  # Lightning's teardown restores the earlier one
