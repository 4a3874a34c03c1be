"""glibc's heap policy on CPU runs without offload: freed temporaries keep their pages for the next ones
([Note: the heap keeps its top between steps] in engine/memory/buffers.py). The setting is process-wide, so each
case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Three 8 MiB temporaries alive at once, as a layer's activations are, then freed: counts the page faults
# of doing it again (glibc's adapted trim threshold is twice the largest block freed, 16 MiB here, below
# the 24 MiB freed at the top of the heap).
CASE = r"""
import json, resource, sys
import torch
from torch import nn
how = sys.argv[1]
if how == "engine":
    from lightning_zero3 import Zero3Config, Zero3Engine
    Zero3Engine(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), Zero3Config(tune_collectives=False))
def faults_of_temporaries():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    temporaries = [torch.ones(2 << 20) for _ in range(3)]  # 8 MiB of float32 each
    del temporaries
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_temporaries()
print(json.dumps(min(faults_of_temporaries() for _ in range(3))))
"""

PAGES = (24 << 20) // 4096  # what the temporaries fault in from fresh memory


def _faults(how: str, **env: str) -> int:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", CASE, how], capture_output=True, text=True, timeout=120,
                          env={**environment, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_cpu_engine_lets_freed_temporaries_keep_their_pages_unless_the_user_set_the_heap_policy():
    assert _faults("nothing") >= PAGES // 2  # glibc left alone: the heap's top is trimmed, fresh pages each time
    assert _faults("engine") < PAGES // 20  # an engine on the host: the next temporaries reuse the pages
    # a policy the user set is theirs (MALLOC_TOP_PAD_ alone turns glibc's adaptation off: fresh pages again)
    assert _faults("engine", MALLOC_TOP_PAD_="0") >= PAGES // 2
