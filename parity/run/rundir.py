"""A run directory's guard rails, checked before the first case: writable, one writer at a time, never clobbered.

* :func:`prepare` creates ``--out`` (a usage error naming the path when it cannot: under a file, no permission),
  takes an exclusive lock (``.lock``, ``flock``; a second concurrent run on the same directory is refused with the
  holder's pid) and refuses a directory that is not empty unless the run resumes it (``--resume``) or replaces the
  run it holds (``--force``). ``--force`` deletes only what a run writes (:data:`RUN_FILES`) and only in a
  directory that holds a run (:func:`holds_run`: a readable ``run`` row); any other non-empty directory is refused,
  the message listing what is there. The lock lives as long as the returned :class:`RunDir`; closing it (and a
  refusal after it was taken) deletes ``.lock``, so no finished or refused run leaves one behind.
* :func:`check_writable_file` — a ``--junit`` target that cannot be written is a usage error before the run, not a
  traceback after it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cases.errors import CaseError

LOCK_NAME = ".lock"
RESULTS_NAME = "results.jsonl"
#: Everything a run (and the views rendered from it) writes in its directory: the stream and its resume temporary,
#: ``results.csv`` / ``index.html`` (``dsv4-parity report``), the mutation suite's kill matrix, a ``--junit`` file
#: by its usual name, the lock. ``--force`` deletes these and nothing else.
RUN_FILES = (RESULTS_NAME, RESULTS_NAME + ".tmp", "results.csv", "index.html", "mutants.jsonl", "junit.xml",
             LOCK_NAME)


@dataclass
class RunDir:
    """An open, locked run directory (``close`` releases the lock and deletes ``.lock``)."""

    path: Path
    lock_fd: int

    def close(self) -> None:
        if self.lock_fd >= 0:
            _unlock(self.path, self.lock_fd)
            self.lock_fd = -1


def _unlock(path: Path, fd: int) -> None:
    """Delete ``.lock`` while still holding it, then release it. A run that opened the same file meanwhile finds,
    once it gets the lock, that the file is gone and takes a new one (:func:`_lock`): never two writers."""
    try:
        (path / LOCK_NAME).unlink()
    except OSError:
        pass  # already gone, or the directory is read-only now: the lock is released all the same
    os.close(fd)  # releases the flock


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
    while True:
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
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder deleted the file we locked (its run ended): lock the current one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise CaseError("out", f"cannot write in {path}: {exc.strerror}") from None
    return fd


#: what a run killed while starting leaves (:func:`parity.run.results.create_stream`): deleted, never counted as content
STALE = RESULTS_NAME + ".tmp"


def _contents(path: Path) -> list[Path]:
    """The directory's entries but the lock and a start-up temporary."""
    return sorted(p for p in path.iterdir() if p.name not in (LOCK_NAME, STALE))


def holds_run(path: Path) -> bool:
    """Whether ``path`` holds a dsv4-parity run: a ``results.jsonl`` whose first line is a readable ``run`` row."""
    try:
        with (Path(path) / RESULTS_NAME).open("rb") as handle:
            row = json.loads(handle.readline())
    except (OSError, ValueError):  # missing, unreadable, binary or torn (JSONDecodeError, UnicodeDecodeError)
        return False
    return isinstance(row, dict) and row.get("type") == "run"


def _names(items: list[Path], most: int = 4) -> str:
    shown = [p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in items[:most]]
    return ", ".join(shown) + (f", ... ({len(items)} entries)" if len(items) > most else "")


def _is_run_file(item: Path) -> bool:
    return item.name in RUN_FILES and (item.is_symlink() or item.is_file())


def _clear_run(path: Path, held: list[Path]) -> None:
    """``--force``: delete the run's own files in ``path``; say what was kept (written by something else)."""
    kept = [item for item in held if not _is_run_file(item)]
    for item in held:
        if _is_run_file(item):
            item.unlink()
    if kept:
        print(f"note: --force replaced the run in {path} and kept what no run writes: {_names(kept)}",
              file=sys.stderr)


def _refusal(path: Path, held: list[Path], force: bool) -> CaseError:
    if holds_run(path):
        return CaseError("out", f"{path} already holds a run ({_names(held)}); continue it with "
                                f"`dsv4-parity run --out {path} --resume`, replace it with --force, "
                                "or choose another --out")
    why = " (--force replaces only a run, in a directory holding one)" if force else ""
    return CaseError("out", f"{path} is not empty and holds no dsv4-parity run: {_names(held)}; choose an empty or "
                            f"new --out{why}")


def prepare(path: Path, *, resume: bool, force: bool = False) -> RunDir:
    """Create and lock ``path`` for a run (see the module docstring); usage errors raise :class:`CaseError`."""
    _mkdir(path)
    fd = _lock(path)
    try:
        if not resume and (path / STALE).is_file() and not (path / RESULTS_NAME).exists():
            (path / STALE).unlink()  # the debris of a run killed while it created its stream
        held = _contents(path)
        if held and not resume:
            if not (force and holds_run(path)):
                raise _refusal(path, held, force)
            _clear_run(path, held)
    except BaseException:
        _unlock(path, fd)  # a refused run leaves no .lock behind
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
