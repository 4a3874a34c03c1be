"""SIGTERM noticed within a second, even while the main thread waits in a collective.

[Note: SIGTERM while a collective waits]
SLURM, ``timeout`` and ``kill`` send SIGTERM. Python runs its handlers only between the main thread's
bytecodes, so a rank blocked in a gloo collective runs none (for up to the group's 30-minute timeout),
and ``sigwait`` in another thread does not work once torch has started threads of its own (they do not
block the signal). What does work: the C-level handler that Python installs for any signal with a
Python handler writes the signal's number to the file descriptor given to ``signal.set_wakeup_fd``,
whatever the main thread is doing. A daemon thread reads that pipe and hands SIGTERM to the watchdog,
which tells the other ranks (the abort key), removes swap files and ends the process with status 143
(128 + SIGTERM), as a shell reports a process ended by SIGTERM. A checkpoint being written is left as
the previous one ([Note: atomic checkpoint directories] in checkpoint/atomic.py).

One wakeup descriptor exists per process: one already set (an event loop's) keeps receiving every
byte, forwarded. A SIGTERM that is ignored (``SIG_IGN``) stays ignored. Lightning's own SIGTERM handler
runs a ``dist.broadcast`` inside the handler, which would pair with whatever collective the other ranks
run: the strategy replaces it (``frontends/trainer/strategy.py``, ``on_train_start``) with ``lightning_handler``.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from typing import Any, Callable, Optional

TERMINATED_EXIT_CODE = 128 + signal.SIGTERM


class TerminationWatch:
    """Calls ``on_sigterm()`` from a daemon thread within ``poll`` seconds of a SIGTERM to this process."""

    def __init__(self, on_sigterm: Callable[[], None], poll: float = 0.5) -> None:
        self._on_sigterm = on_sigterm
        self._poll = poll
        self._pipe: Optional[tuple[int, int]] = None
        self._previous_fd = -1
        self._previous_handler: Any = None
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> bool:
        """Install the wakeup pipe and the thread (from the main thread only; False where it cannot)."""
        if threading.current_thread() is not threading.main_thread() or self._pipe is not None:
            return False
        handler = signal.getsignal(signal.SIGTERM)
        if handler == signal.SIG_IGN:
            return False
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read)
            os.close(write)
            return False
        self._pipe = (read, write)
        self._previous_handler = handler
        if handler in (signal.SIG_DFL, None):  # the C handler (and the wakeup write) needs a Python handler
            signal.signal(signal.SIGTERM, self.python_handler)
        self._thread = threading.Thread(target=self._run, name="zero3-sigterm", daemon=True)
        self._thread.start()
        return True

    def python_handler(self, signum: int, frame: Any) -> None:
        """What the main thread runs on SIGTERM when it gets to: nothing while the thread watches (it ends
        the process), else the default action."""
        if self._thread is None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def stop(self) -> None:
        """Give the wakeup descriptor and the handler back (main thread; elsewhere the thread just stops)."""
        if self._pipe is None:
            return
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._poll + 1)
            self._thread = None
        if threading.current_thread() is threading.main_thread():
            try:
                signal.set_wakeup_fd(self._previous_fd)
                if signal.getsignal(signal.SIGTERM) == self.python_handler:
                    signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
            except (ValueError, OSError):
                pass
            for fd in self._pipe:
                os.close(fd)
        self._pipe = None

    def _run(self) -> None:
        assert self._pipe is not None
        read = self._pipe[0]
        while not self._stopping.is_set():
            ready, _, _ = select.select([read], [], [], self._poll)
            if not ready:
                continue
            try:
                data = os.read(read, 512)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            if self._previous_fd >= 0:
                try:
                    os.write(self._previous_fd, data)
                except OSError:
                    pass
            if signal.SIGTERM in data and not self._stopping.is_set():
                self._on_sigterm()


def lightning_handler(mark: Callable[[], None]) -> Callable[[int, Any], None]:
    """A SIGTERM handler for the Trainer in place of Lightning's (see the note): ``mark()`` records it, as
    ``trainer.received_sigterm`` reads it; the watch thread ends the process."""

    def handler(signum: int, frame: Any) -> None:
        mark()

    return handler
