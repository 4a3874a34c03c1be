"""A copy engine that completes device <-> host copies late, on a thread, for tests on CPU.

On a CUDA device the offload code copies on a side stream: a copy returns at once and its target is
valid only after the copy's event (see [Note: device-to-host copies are events] in
lightning_zero3/engine/offload/store.py). On a CPU device the real copy engine copies synchronously, so a
missing wait cannot show. ``LateCopies`` restores the asynchrony: each copy runs on its own thread after
``DELAY`` seconds, and waiting on its ticket joins that thread. Code that reads (or rewrites) a copy's
target or source without waiting then reads stale values, and parity tests fail.

``install()`` puts it in place for engines created afterwards in this process (the test scripts call it
when ``ZERO3_TEST_LATE_COPIES=1`` is set).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

import torch

from lightning_zero3.engine.offload import copies, tiers

DELAY = 0.005  # seconds: far longer than the Python between a copy and a careless read


class LateTicket:
    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        def run() -> None:
            time.sleep(DELAY)
            with torch.no_grad():
                dst.copy_(src)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait_host(self) -> None:
        self.thread.join()

    def wait_device(self, device: torch.device) -> None:
        self.thread.join()  # the "device" is this host's CPU: compute waits like the host


class LateCopies(copies.DeviceHostCopies):
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[LateTicket]:
        return LateTicket(dst, src)


def install() -> None:
    tiers.COPY_ENGINE = LateCopies


def install_if_asked() -> None:
    if os.environ.get("ZERO3_TEST_LATE_COPIES") == "1":
        install()
