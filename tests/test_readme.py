"""The README's two commands: CI runs exactly them, and the main job's config is the one the README describes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN_CONFIG = "examples/configs/gpt_zero3.yaml"
MAIN_JOB = f" && lightning-zero3 fit --config {MAIN_CONFIG}"


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_install_and_test_commands():
    install, tests = readme_commands()[:2]
    assert install.endswith(MAIN_JOB)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install[: -len(MAIN_JOB)] in ci
    assert ci[-1] == tests


def test_main_job_config_is_what_the_readme_says():
    """The config trains (tests/test_cli.py runs every example config); here: it is the README's job."""
    import yaml

    config = yaml.safe_load((ROOT / MAIN_CONFIG).read_text())
    readme = (ROOT / "README.md").read_text()
    trainer = config["trainer"]
    assert trainer["strategy"] == "zero3" and trainer["devices"] == 2 and trainer["accelerator"] == "cpu"
    logger = trainer["logger"]["init_args"]
    assert f"tensorboard --logdir {logger['save_dir']}" in readme
    assert f"`{logger['save_dir']}/{logger['name']}/`" in readme
    monitors = {c["class_path"] for c in trainer["callbacks"]}
    assert monitors == {"lightning_zero3.callbacks.MemoryMonitor", "lightning_zero3.callbacks.CommMonitor"}
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '[project.scripts]\nlightning-zero3 = "lightning_zero3.cli:main"' in pyproject
