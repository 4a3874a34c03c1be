"""The NVMe tier's directory and files: private, checked before training, removed at the end.

Layout: ``<nvme_path>/lightning_zero3-<uid>/<host>-<pid>-r<rank>/<file>.swp``. The per-user folder and
the per-process folder are 0700, every file 0600 (created with ``O_EXCL``: never a file someone else
placed there). Each process removes its own folder at ``close`` and at interpreter exit.

[Note: stale swap folders]
A crashed run (SIGKILL, out of memory, power loss) cannot clean up after itself. The folder name
carries the host and the pid of the process that owned it: at the next start, every folder of this
host whose pid is no longer alive is removed before anything new is written. Folders of other hosts
(a shared file system) are left alone, since their pids mean nothing here.

[Note: space is reserved, not hoped for]
Before training, the bytes each rank will write are compared with the free space, and every swap file
is allocated to its full size with ``posix_fallocate``: the disk cannot fill under a running step
because of zero3's own files. Should a write fail anyway (``ENOSPC``, quota), ``SwapDiskFullError``
names the directory and the bytes, and nothing else (no checkpoint) is touched.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import socket
from pathlib import Path
from typing import Optional

MARKER = "lightning_zero3"


class NvmePathError(OSError):
    """``nvme_path`` cannot hold the swap files (missing, not writable, too small)."""


class SwapDiskFullError(OSError):
    """The NVMe tier ran out of space while training."""


def disk_full(path: Path, nbytes: int, cause: BaseException) -> SwapDiskFullError:
    return SwapDiskFullError(
        errno.ENOSPC,
        f"zero3: the NVMe swap directory {path} ran out of space writing {nbytes} bytes ({cause}). Free at least "
        f"that much there (or point `nvme_path` at a larger disk) and resume from the last checkpoint; zero3 "
        f"has not touched any checkpoint.",
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class SwapDirectory:
    """This process's private folder of swap files under ``nvme_path``."""

    def __init__(self, nvme_path: str, rank: int) -> None:
        root = Path(nvme_path).expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise NvmePathError(
                error.errno, f"zero3: `nvme_path={str(root)!r}` does not exist and cannot be created ({error}); "
                "point `nvme_path` at a writable directory on a fast local disk."
            ) from error
        if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
            raise NvmePathError(
                errno.EACCES, f"zero3: `nvme_path={str(root)!r}` is not a writable directory; point `nvme_path` at "
                "a directory this user can write to."
            )
        self.base = root / f"{MARKER}-{os.getuid()}"
        self.base.mkdir(mode=0o700, exist_ok=True)
        if self.base.stat().st_uid != os.getuid():
            raise NvmePathError(
                errno.EPERM, f"zero3: {self.base} belongs to another user; swap files must live in a folder of "
                "their own. Choose another `nvme_path`."
            )
        os.chmod(self.base, 0o700)
        self.host = socket.gethostname()
        self.removed_stale = self._remove_stale()
        self.path = self.base / f"{self.host}-{os.getpid()}-r{rank}"
        if self.path.exists():  # a pid reused after a crash of an earlier run with the same pid
            shutil.rmtree(self.path)
        self.path.mkdir(mode=0o700)
        self.files: list["SwapFile"] = []
        self.reserved = 0
        atexit.register(self.remove)

    def _remove_stale(self) -> list[str]:
        removed = []
        for entry in self.base.iterdir():
            parts = entry.name.rsplit("-", 2)
            if len(parts) != 3 or not parts[1].isdigit() or parts[0] != self.host or not parts[2].startswith("r"):
                continue
            if not _alive(int(parts[1])):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        return removed

    def check_room(self, nbytes: int, what: str) -> None:
        """Refuse (before training) when the disk has less than ``nbytes`` free."""
        free = shutil.disk_usage(self.path).free
        if nbytes > free:
            raise NvmePathError(
                errno.ENOSPC, f"zero3: `nvme_path={str(self.base.parent)!r}` has {free} bytes free, but {what} "
                f"needs {nbytes} bytes on this rank. Free space there or choose a larger disk for `nvme_path`."
            )

    def create(self, name: str, nbytes: int) -> "SwapFile":
        """A new private swap file of ``nbytes``, its blocks allocated now."""
        path = self.path / f"{name}.swp"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # whole-file transfers: read ahead further
        except OSError as error:
            os.close(fd)
            path.unlink(missing_ok=True)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full(self.path, nbytes, error) from error
            raise
        swap = SwapFile(path, fd, nbytes, _open_direct(path))
        self.files.append(swap)
        self.reserved += nbytes
        return swap

    def remove(self) -> None:
        for swap in self.files:
            swap.close()
        self.files = []
        shutil.rmtree(self.path, ignore_errors=True)


def _open_direct(path: Path) -> Optional[int]:
    """A second, read-only descriptor of ``path`` that bypasses the page cache (``O_DIRECT``), or None where
    the file system refuses it (tmpfs, some network file systems): see [Note: direct reads] in aio.py."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None


class SwapFile:
    def __init__(self, path: Path, fd: int, nbytes: int, direct_fd: Optional[int] = None) -> None:
        self.path, self.fd, self.nbytes = path, fd, nbytes
        self.direct_fd = direct_fd  # reads of whole aligned blocks (None: buffered reads only)
        self._direct_opened = direct_fd  # closed with the file, never earlier: another thread may read through it

    def no_direct(self) -> None:
        """The file system accepted ``O_DIRECT`` at open but refuses it on reads: read through the cache."""
        self.direct_fd = None

    def close(self) -> None:
        self.direct_fd = None
        for fd in (self._direct_opened, self.fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._direct_opened, self.fd = None, -1
