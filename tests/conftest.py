import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
#: The tests, by concern (one folder each), and what they share: ``helpers/`` (ranks forked from a server,
#: scripts, peak memory, checkpoint files, ...) and ``scripts/`` (the multi-rank programs tests run). Test
#: modules import helpers and one another by module name, whatever folder they are in.
TEST_FOLDERS = sorted(p for p in HERE.iterdir() if p.is_dir() and p.name not in ("scripts", "__pycache__"))
for path in (ROOT / "examples", ROOT / "examples" / "benchmarks", HERE, *TEST_FOLDERS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_outlives_its_module():
    """A test module that runs a Trainer in this process (``devices=1``) leaves what Lightning leaves: a
    process group whose store listens on ``MASTER_PORT``, and that port in ``os.environ``. Every later script
    would inherit the port and fail to listen on it (EADDRINUSE), so each module's group and port end with it."""
    environ = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        if key in environ:
            os.environ[key] = environ[key]
        else:
            os.environ.pop(key, None)
