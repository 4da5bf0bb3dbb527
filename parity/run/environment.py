"""The machine and library versions a run used (the ``env`` field of the results ``run`` row).

Keys: ``python torch cuda cudnn cudnn_frontend flash_mla gpu driver git_rev code host device generator`` (``code``:
:func:`code_rev`; ``generator``: the
draw the case tensors start from, :data:`cases.draws.GENERATOR`); a value is ``None`` when not
available. Package versions come from the installed distributions' metadata, so nothing heavy is imported.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch

from cases.draws import GENERATOR

REPO = Path(__file__).resolve().parents[2]


def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _run(cmd: list[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, errors="replace", timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _git_paths(args: list[str], repo: Path) -> Optional[list[bytes]]:
    """The NUL-separated paths a git command prints, as bytes (any name git can hold), in its order; None if it
    failed."""
    try:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return [p for p in out.stdout.split(b"\0") if p] if out.returncode == 0 else None


#: what changes no case's result, left out of the code's hashes (:func:`code_rev`, the ``-dirty`` suffix): the
#: baselines the drift gate reads (a GPU run records and restores them mid-gate, ``.ci/h200-pr-gate.sh``) and prose
NOT_CODE_DIRS = ("reports/baselines",)
NOT_CODE_SUFFIXES = (".md",)
#: the same as git exclude pathspecs
NOT_CODE = tuple(f":(exclude){d}" for d in NOT_CODE_DIRS) + tuple(f":(exclude)*{s}" for s in NOT_CODE_SUFFIXES)


def _is_not_code(path: bytes) -> bool:
    """:data:`NOT_CODE` for one repository path (``git ls-tree`` takes no exclude pathspecs)."""
    return (path.startswith(tuple(os.fsencode(d) + b"/" for d in NOT_CODE_DIRS))
            or path.endswith(tuple(os.fsencode(s) for s in NOT_CODE_SUFFIXES)))


#: untracked files that count as code: Python modules (a run's own outputs, logs and a ``.venv`` link do not)
UNTRACKED_CODE = ("*.py",)


def _content(path: Path) -> bytes:
    """What a changed path holds now: a link's target, a regular file's bytes, else a marker (deleted, other)."""
    try:
        if path.is_symlink():
            return b"link:" + os.fsencode(os.readlink(path))
        if path.is_file():
            return b"file:" + path.read_bytes()
        return b"deleted" if not path.exists() else b"other"
    except OSError:
        return b"unreadable"


def _uncommitted_code(repo: Path) -> str:
    """``""`` when the code equals ``HEAD``'s; else ``-dirty.<hash>``: the first 8 hex digits of a SHA-256 over the
    path and current content of every tracked file that differs from ``HEAD`` (staged or not) and every untracked,
    not ignored :data:`UNTRACKED_CODE` file, :data:`NOT_CODE` left out; ``-dirty.unknown`` where git could not list
    the changes. It depends only on the files' state (not on diff settings or on what is staged)."""
    changed = _git_paths(["diff", "HEAD", "--name-only", "--no-renames", "-z", "--", ".", *NOT_CODE], repo)
    untracked = _git_paths(["ls-files", "--others", "--exclude-standard", "-z", "--", *UNTRACKED_CODE, *NOT_CODE],
                           repo)
    if changed is None or untracked is None:
        return "-dirty.unknown"
    paths = sorted(set(changed) | set(untracked))
    if not paths:
        return ""
    digest = hashlib.sha256()
    for name in paths:
        digest.update(name + b"\0" + _content(repo / os.fsdecode(name)) + b"\0")
    return f"-dirty.{digest.hexdigest()[:8]}"


def git_rev(repo: Path = REPO, uncommitted: Optional[str] = None) -> Optional[str]:
    """``HEAD`` commit, with :func:`_uncommitted_code`'s ``-dirty.<hash>`` when the code differs from it (computed
    here unless the caller hands it over): what a reader looks up (reports name it). Two runs of one commit with other
    uncommitted code differ here."""
    rev = _run(["git", "rev-parse", "--short=12", "HEAD"], repo)
    if rev is None:
        return None
    return rev + (_uncommitted_code(repo) if uncommitted is None else uncommitted)


def code_rev(repo: Path = REPO, uncommitted: Optional[str] = None) -> Optional[str]:
    """The code a run ran, whatever commit holds it: the first 12 hex digits of a SHA-256 over ``HEAD``'s tracked
    files outside :data:`NOT_CODE` (mode, blob id, path each), with :func:`_uncommitted_code`'s suffix. A commit
    that changes only baselines or prose keeps it, so a gate started before such a commit is continued after it as
    the same code (a resume compares this, not ``git_rev``: :func:`environment_changes`); any code change, committed
    or not, changes it."""
    listing = _git_paths(["ls-tree", "-r", "-z", "--full-tree", "HEAD"], repo)
    if listing is None:
        return None
    code = [entry for entry in listing if not _is_not_code(entry.split(b"\t", 1)[-1])]
    digest = hashlib.sha256(b"\0".join(code)).hexdigest()[:12]
    return digest + (_uncommitted_code(repo) if uncommitted is None else uncommitted)


def environment(device: str = "cpu") -> dict:
    cuda = torch.cuda.is_available()
    gpu = driver = None
    if cuda:
        gpu = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        gpu = f"{gpu} (sm{major}{minor})"
        driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        driver = driver.splitlines()[0] if driver else None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    uncommitted = _uncommitted_code(REPO)  # read and hashed once for both names of the code
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "cudnn_frontend": _dist_version("nvidia-cudnn-frontend", "cudnn-frontend", "cudnn"),
        "flash_mla": _dist_version("sgl-flash-mla", "flash-mla", "flash_mla"),
        "gpu": gpu,
        "driver": driver,
        "git_rev": git_rev(uncommitted=uncommitted),
        "code": code_rev(uncommitted=uncommitted),
        "host": platform.node(),
        "device": device,
        "generator": GENERATOR,
    }


#: the environment keys that can change a case's result: code (:func:`code_rev`), libraries, GPU architecture, draws (``host``,
#: ``driver``, ``python``'s patch level and the GPU's model within one architecture do not: a resume on a larger card
#: of the same architecture re-runs the cases that did not fit, README "Testing Megatron-LM")
RESULT_KEYS = ("code", "torch", "cuda", "cudnn", "cudnn_frontend", "flash_mla", "gpu", "device", "generator")
#: the kernel libraries: they change no result of a provider that runs none of them
KERNEL_LIBRARIES = ("cudnn_frontend", "flash_mla")
#: providers that run none of :data:`KERNEL_LIBRARIES` (the torch kernels; production's unfused path; its fused path
#: over the torch kernels)
NO_KERNEL_LIBRARIES = ("torch", "unfused", "emulated")


def _architecture(gpu) -> Optional[str]:
    """``sm90`` of ``NVIDIA H200 (sm90)``; the string itself when it names none (None stays None)."""
    if gpu is None:
        return None
    match = re.search(r"\((sm\d+)\)", str(gpu))
    return match.group(1) if match else str(gpu)


def environment_changes(recorded: Optional[dict], now: dict, provider: Optional[str] = None) -> dict:
    """``{key: [recorded, now]}`` for each :data:`RESULT_KEYS` entry that differs between a run row's ``env`` and
    this process's (a resume under other code or libraries; empty when none differs or nothing is recorded). Code
    counts by :func:`code_rev` (``git_rev`` for a run recorded without it), so a commit of baselines or prose alone
    is the same code; the GPU by its architecture; the kernel libraries not for a ``provider`` that runs none of
    them."""
    if not isinstance(recorded, dict):
        return {}
    def comparable(key: str, value):
        return _architecture(value) if key == "gpu" else value

    keys = [k for k in RESULT_KEYS if k in recorded and not (k in KERNEL_LIBRARIES and provider in NO_KERNEL_LIBRARIES)]
    if "code" not in recorded and "git_rev" in recorded:  # a run recorded before ``code``: its commit names its code
        keys.insert(0, "git_rev")
    return {k: [recorded.get(k), now.get(k)] for k in keys
            if comparable(k, recorded.get(k)) != comparable(k, now.get(k))}
