"""``lightning-zero3 env``: what this machine offers zero3, in one table (DeepSpeed's ``ds_report`` for zero3).

    lightning-zero3 env                          # a table
    lightning-zero3 env --json                   # the same facts as JSON, for scripts and bug reports
    lightning-zero3 env --nvme-path /local_nvme  # where NVMe offload would put its swap files

It reports the versions of Python and of the libraries zero3 works with (those not installed say so),
CUDA / NCCL and each GPU with its memory, gloo, whether direct I/O (``O_DIRECT``) and
``os.posix_fadvise`` work on the NVMe path (a small file is written, read back and removed), the CPU
cores this process may use, and the machine's memory. Nothing here starts a process group.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import mmap
import os
import platform
import sys
import tempfile
from typing import Any, Optional

LIBRARIES = ("torch", "lightning", "transformers", "peft", "litgpt", "deepspeed", "safetensors", "tensorboard")


def _version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _accelerators() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    facts: dict[str, Any] = {
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "distributed_available": dist.is_available(),
        "gloo_available": dist.is_available() and dist.is_gloo_available(),
        "nccl_available": dist.is_available() and dist.is_nccl_available(),
        "nccl_version": None,
        "devices": [],
    }
    if facts["nccl_available"] and torch.cuda.is_available():
        try:
            facts["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001  (a build without NCCL's library: the report says unknown)
            pass
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            facts["devices"].append({
                "index": index,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
                "bf16": bool(torch.cuda.is_bf16_supported()),
            })
    return facts


def probe_path(path: str) -> dict[str, Any]:
    """Whether NVMe offload's file I/O works under ``path``: writable, ``O_DIRECT`` reads, ``posix_fadvise``."""
    facts: dict[str, Any] = {"path": path, "writable": False, "o_direct": False, "posix_fadvise": False, "free_gib": None}
    try:
        os.makedirs(path, exist_ok=True)
        usage = os.statvfs(path)
        facts["free_gib"] = round(usage.f_bavail * usage.f_frsize / 2**30, 1)
    except OSError as error:
        facts["error"] = f"{type(error).__name__}: {error}"
        return facts
    size = 1 << 20
    fd, name = tempfile.mkstemp(prefix="lightning_zero3-env-", dir=path)
    try:
        os.write(fd, b"\0" * size)
        os.fsync(fd)
        facts["writable"] = True
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
                facts["posix_fadvise"] = True
            except OSError as error:
                facts["posix_fadvise_error"] = str(error)
        flag = getattr(os, "O_DIRECT", None)
        if flag is not None:
            try:
                direct = os.open(name, os.O_RDONLY | flag)
                try:
                    buffer = mmap.mmap(-1, size)  # page-aligned, as direct I/O needs
                    try:
                        facts["o_direct"] = os.readv(direct, [buffer]) == size
                    finally:
                        buffer.close()
                finally:
                    os.close(direct)
            except OSError as error:
                facts["o_direct_error"] = str(error)
    except OSError as error:
        facts["error"] = f"{type(error).__name__}: {error}"
    finally:
        os.close(fd)
        try:
            os.unlink(name)
        except OSError:
            pass
    return facts


def _host() -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = None
    try:
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "os": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores_usable": cores,
        "cpu_cores_total": os.cpu_count(),
        "memory_gib": memory,
    }


def collect(nvme_path: Optional[str] = None) -> dict[str, Any]:
    """Every fact of the report, as a dict (what ``--json`` prints)."""
    versions = {"python": platform.python_version(), "lightning_zero3": _version("lightning-zero3")}
    versions.update({name: _version(name) for name in LIBRARIES})
    return {
        "versions": versions,
        "accelerators": _accelerators(),
        "nvme": probe_path(nvme_path or tempfile.gettempdir()),
        "host": _host(),
    }


def _yes(value: Any) -> str:
    return "yes" if value is True else "no" if value is False else "-" if value is None else str(value)


def format_report(facts: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    for name, version in facts["versions"].items():
        rows.append((name, version or "not installed"))
    acc = facts["accelerators"]
    rows.append(("CUDA available", _yes(acc["cuda_available"]) + (f" (CUDA {acc['cuda_version']})" if acc["cuda_version"] else "")))
    rows.append(("NCCL", _yes(acc["nccl_available"]) + (f" ({acc['nccl_version']})" if acc["nccl_version"] else "")))
    rows.append(("gloo", _yes(acc["gloo_available"])))
    for device in acc["devices"]:
        rows.append((
            f"GPU {device['index']}",
            f"{device['name']}, {device['memory_gib']} GiB, compute capability {device['capability']}, bf16 {_yes(device['bf16'])}",
        ))
    nvme = facts["nvme"]
    rows.append(("NVMe path", f"{nvme['path']} ({nvme['free_gib']} GiB free)" if nvme["free_gib"] is not None else nvme["path"]))
    rows.append(("  writable", _yes(nvme["writable"]) + (f" ({nvme['error']})" if "error" in nvme else "")))
    rows.append(("  O_DIRECT reads", _yes(nvme["o_direct"])))
    rows.append(("  posix_fadvise", _yes(nvme["posix_fadvise"])))
    host = facts["host"]
    rows.append(("OS", host["os"]))
    rows.append(("CPU cores", f"{host['cpu_cores_usable']} usable of {host['cpu_cores_total']}"))
    rows.append(("memory", f"{host['memory_gib']} GiB" if host["memory_gib"] is not None else "unknown"))
    width = max(len(name) for name, _ in rows)
    lines = [f"{'what'.ljust(width)} | value", f"{'-' * width}-+------"]
    lines += [f"{name.ljust(width)} | {value}" for name, value in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-zero3 env", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    parser.add_argument("--nvme-path", default=None, help="directory to probe for NVMe offload (default: the temp directory)")
    args = parser.parse_args(argv)
    facts = collect(args.nvme_path)
    print(json.dumps(facts, indent=2) if args.json else format_report(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
