"""The runtime's own memory: what a rank holds before any model (see [Note: the runtime baseline]).

[Note: the runtime baseline]
A small model's peak is mostly the runtime itself: the imports (torch, lightning, lightning_zero3), and
what a running Trainer adds to them (process group and its threads, the data loader, the logger, the
heap's arenas). So the host baseline is the imports' resident set, measured in a fresh subprocess when
the estimate runs, plus ``RUNNING_FIT``, a stated figure: a ``fit`` of a GPT of a few thousand
parameters peaks at about that much above its imports (examples/benchmarks/RESULTS.md, Figures behind
the Notes). On a GPU the device baseline is ``CUDA_CONTEXT`` (the CUDA context and the allocator's first
blocks; a stated default, not measured: no GPU was at hand).
"""

from __future__ import annotations

import subprocess
import sys

RUNNING_FIT = 90 * 2**20  # what a running fit adds to the imports, per rank (see the note above)
CUDA_CONTEXT = 1 << 30  # device bytes a CUDA rank holds before any tensor of the model (stated default)


def imports_rss(modules: tuple[str, ...] = ("torch", "lightning.pytorch", "lightning_zero3")) -> int:
    """Resident bytes of a fresh Python process that imported ``modules`` (measured now, on this machine)."""
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n" \
           "print(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=300)
        return int(done.stdout.split()[-1]) * 1024
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return 350 * 2**20  # a stated fallback: about what the imports take on a CPU-only install


def host_baseline() -> int:
    """Host bytes per rank of a running fit on this machine, before any model."""
    return imports_rss() + RUNNING_FIT
