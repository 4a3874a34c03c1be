"""The README's two commands: CI runs exactly them, and the main job's config is the one the README describes.
Its other blocks run in tests/docs_examples/test_docs_blocks.py."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    """The config trains (tests/cli/test_cli.py runs every example config); here: it is the README's job."""
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


def test_readme_is_short_and_speaks_of_the_product():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    assert not [line for line in lines if "session" in line.lower()]
    dated = [line for line in lines if re.search(r"\d{4}-\d{2}-\d{2}", line) and not line.startswith("|")]
    assert not dated  # dates only in the benchmark tables' rows


def test_readme_yaml_block_is_the_main_job_abridged():
    """Every setting the README's YAML block shows is the main job's own (the block only leaves settings out)."""
    import yaml

    (block,) = re.findall(r"```yaml\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    shown, config = yaml.safe_load(block), yaml.safe_load((ROOT / MAIN_CONFIG).read_text())

    def assert_within(part, whole, where):
        if isinstance(part, dict):
            for key, value in part.items():
                assert key in whole, f"README yaml shows {where}{key}, which {MAIN_CONFIG} does not set"
                assert_within(value, whole[key], f"{where}{key}.")
        else:
            assert part == whole, f"README yaml shows {where[:-1]}: {part!r}, {MAIN_CONFIG} has {whole!r}"

    assert_within(shown, config, "")
    assert "data" in shown and "model" in shown  # a job that can train: a model and its data
