"""The README's two commands: CI runs exactly them, and the main job trains and logs to TensorBoard."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = " && python examples/train_gpt.py"


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_install_and_test_commands():
    install, tests = readme_commands()[:2]
    assert install.endswith(MAIN_JOB)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install[: -len(MAIN_JOB)] in ci
    assert ci[-1] == tests


def test_main_job_trains_gpt_on_two_processes_with_tensorboard(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--max-steps", "10", "--n-layer", "2"]
    cmd += ["--n-embd", "64", "--block-size", "32", "--corpus-bytes", "100000", "--logdir", str(tmp_path)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "strategy='zero3' on 2 processes for 10 steps" in done.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "gpt-zero3" / "version_0")).Reload()
    losses = [e.value for e in events.Scalars("train_loss")]
    assert losses and all(0 < value < 10 for value in losses)
