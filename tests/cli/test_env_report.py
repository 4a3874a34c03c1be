"""``lightning-zero3 env``: the machine's report names the versions and probes the NVMe path, as a table and as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import lightning
import torch

from lightning_zero3.cli import main
from lightning_zero3.cli.env import collect, format_report


def test_env_reports_versions_devices_and_the_nvme_path(tmp_path):
    facts = collect(str(tmp_path))
    assert facts["versions"]["torch"] == torch.__version__ and facts["versions"]["lightning"] == lightning.__version__
    assert facts["accelerators"]["gloo_available"] is True
    assert facts["accelerators"]["cuda_available"] == torch.cuda.is_available()
    nvme = facts["nvme"]
    assert nvme["path"] == str(tmp_path) and nvme["writable"] and nvme["posix_fadvise"]
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone
    table = format_report(facts)
    assert f"torch " in table and torch.__version__ in table and lightning.__version__ in table
    assert "O_DIRECT reads" in table and "CPU cores" in table


def test_env_subcommand_prints_json_and_exits_0(tmp_path, capsys):
    assert main(["env", "--json", "--nvme-path", str(tmp_path)]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["versions"]["torch"] == torch.__version__ and facts["host"]["cpu_cores_usable"] >= 1


def test_env_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "lightning_zero3.cli", "env"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert torch.__version__ in done.stdout and lightning.__version__ in done.stdout
