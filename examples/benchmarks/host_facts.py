"""The facts of the machine a benchmark ran on, written beside its figures.

Question: On what machine was a figure measured (CPU model, cores, memory, kernel, library versions)?

A ratio measured on one host is one sample: the same code has run at 0.99x and at 1.17x DDP's step on
two 2-core hosts. So every table says which host it came from: the processor, the cores this process
may use, memory, the kernel and its transparent-huge-page mode (host buffers are laid out for huge
pages), and the versions of Python and torch. Read from ``/proc`` and ``/sys`` where they exist (Linux);
a fact that cannot be read is left out rather than guessed.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def _first(path: str, key: str) -> str | None:
    """The value of the first ``key: value`` line of ``path``."""
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def _bracketed(path: str) -> str | None:
    """The chosen mode of a sysfs switch such as ``always [madvise] never``."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def host_facts() -> dict:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory_kb = _first("/proc/meminfo", "MemTotal")
    facts = {
        "cpu": _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cpu_model_number": _first("/proc/cpuinfo", "model"),
        "cores": cores,
        "memory_gib": round(int(memory_kb.split()[0]) / 2**20, 1) if memory_kb else None,
        "kernel": platform.release(),
        "transparent_hugepages": _bracketed("/sys/kernel/mm/transparent_hugepage/enabled"),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    return {key: value for key, value in facts.items() if value is not None}


def describe_host(facts: dict) -> str:
    """One line: ``host: <cpu> (model N), 2 cores, 23.4 GiB, Linux 6.1, THP madvise, Python 3.11, torch 2.13``."""
    parts = [facts.get("cpu", "unknown processor") + (f" (model {facts['cpu_model_number']})" if "cpu_model_number" in facts else "")]
    parts += [f"{facts['cores']} cores"] if "cores" in facts else []
    parts += [f"{facts['memory_gib']} GiB"] if "memory_gib" in facts else []
    parts += [f"{platform.system()} {facts['kernel']}"]
    parts += [f"THP {facts['transparent_hugepages']}"] if "transparent_hugepages" in facts else []
    parts += [f"GPU {facts['gpu']}"] if "gpu" in facts else []
    parts += [f"Python {facts['python']}", f"torch {facts['torch']}"]
    return "host: " + ", ".join(parts)
