"""A run directory's guard rails, checked before the first case: writable, one writer at a time, never clobbered.

* :func:`prepare` creates ``--out`` (a usage error naming the path when it cannot: under a file, no permission),
  takes an exclusive lock (``.lock``, ``flock``; a second concurrent run on the same directory is refused with the
  holder's pid) and refuses a directory that already holds files unless the run resumes it (``--resume``) or
  replaces it (``--force``, which clears it whole). The lock lives as long as the returned :class:`RunDir`.
* :func:`check_writable_file` — a ``--junit`` target that cannot be written is a usage error before the run, not a
  traceback after it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cases.errors import CaseError

LOCK_NAME = ".lock"


@dataclass
class RunDir:
    """An open, locked run directory (``close`` releases the lock)."""

    path: Path
    lock_fd: int

    def close(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = -1


def _mkdir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CaseError("out", f"{path} exists and is not a directory") from None
    except NotADirectoryError:
        raise CaseError("out", f"{path} cannot be created: a parent of it is a file") from None
    except OSError as exc:
        raise CaseError("out", f"cannot create {path}: {exc.strerror}") from None
    if not path.is_dir():
        raise CaseError("out", f"{path} is not a directory")


def _lock(path: Path) -> int:
    lock = path / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CaseError("out", f"cannot write in {path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise CaseError("out", f"another dsv4-parity run (pid {holder}) is writing {path}; wait for it to "
                                   "finish or choose another --out") from None
        raise CaseError("out", f"cannot lock {lock}: {exc.strerror}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise CaseError("out", f"cannot write in {path}: {exc.strerror}") from None
    return fd


def _contents(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name != LOCK_NAME)


def prepare(path: Path, *, resume: bool, force: bool = False) -> RunDir:
    """Create and lock ``path`` for a run (see the module docstring); usage errors raise :class:`CaseError`."""
    _mkdir(path)
    fd = _lock(path)
    try:
        held = _contents(path)
        if held and not resume:
            if not force:
                names = ", ".join(p.name for p in held[:4]) + (", ..." if len(held) > 4 else "")
                raise CaseError("out", f"{path} already holds a run ({names}); continue it with "
                                       f"`dsv4-parity run --out {path} --resume`, replace it with --force, "
                                       "or choose another --out")
            for item in held:
                if item.is_dir() and not item.is_symlink():
                    shutil.rmtree(item)
                else:
                    item.unlink()
    except BaseException:
        os.close(fd)
        raise
    return RunDir(path, fd)


def check_writable_file(target: Optional[Path], field: str) -> None:
    """Usage error unless ``target`` can be created (or appended to); leaves no new file behind."""
    if target is None:
        return
    target = Path(target)
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise CaseError(field, f"cannot write {target}: {exc.strerror or exc}") from None
    if not existed:
        target.unlink(missing_ok=True)
