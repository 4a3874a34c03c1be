"""The runtime's own memory: what a rank holds before any model (see [Note: the runtime baseline]).

[Note: the runtime baseline]
A small model's peak is mostly the runtime itself. On the development machine (2 CPU cores, torch 2.13,
lightning 2.6.6) a process that imported torch, lightning and lightning_zero3 resided at 351 MiB, and a
whole ``fit`` of the main job shrunk to a 2-thousand-parameter GPT at batch 1 peaked at 440 MiB per rank:
the running Trainer (process group and its threads, the data loader, the logger, the heap's arenas) adds
about 90 MiB to the imports. So on this machine the baseline is the imports' resident set, measured in
a fresh subprocess when the estimate runs, plus ``RUNNING_FIT`` (stated, from that measurement). On a GPU
the device baseline is ``CUDA_CONTEXT`` (the CUDA context and the allocator's first blocks; stated, not
measured here: no GPU on the development machine).
"""

from __future__ import annotations

import subprocess
import sys

RUNNING_FIT = 90 * 2**20  # what a running fit adds to the imports, per rank (measured as above)
CUDA_CONTEXT = 1 << 30  # device bytes a CUDA rank holds before any tensor of the model (stated default)


def imports_rss(modules: tuple[str, ...] = ("torch", "lightning.pytorch", "lightning_zero3")) -> int:
    """Resident bytes of a fresh Python process that imported ``modules`` (measured now, on this machine)."""
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n" \
           "print(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=300)
        return int(done.stdout.split()[-1]) * 1024
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return 350 * 2**20  # what the development machine measured


def host_baseline() -> int:
    """Host bytes per rank of a running fit on this machine, before any model."""
    return imports_rss() + RUNNING_FIT
