"""The machine and library versions a run used (the ``env`` field of the results ``run`` row).

Keys: ``python torch cuda cudnn cudnn_frontend flash_mla gpu driver git_rev host device generator`` (``generator``: the
draw the case tensors start from, :data:`cases.draws.GENERATOR`); a value is ``None`` when not
available. Package versions come from the installed distributions' metadata, so nothing heavy is imported.
"""

from __future__ import annotations

import hashlib
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


def _run(cmd: list[str], cwd: Optional[Path] = None, strip: bool = True) -> Optional[str]:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return out.stdout.strip() if strip else out.stdout


#: what changes no case's result, left out of an uncommitted tree's hash (:func:`git_rev`): the baselines the drift
#: gate reads (a GPU run records and restores them mid-gate, ``.ci/h200-pr-gate.sh``) and prose
NOT_CODE = (":(exclude)reports/baselines", ":(exclude)*.md")


def git_rev(repo: Path = REPO) -> Optional[str]:
    """``HEAD`` commit; with ``-dirty.<hash>`` when the code differs from it: the first 8 hex digits of a SHA-256
    over the tracked files' diff against ``HEAD`` and the untracked, not ignored files (path and bytes), both
    without :data:`NOT_CODE`. Two runs of one revision with other uncommitted code then differ here too (a resume
    compares it: ``environment_changes``)."""
    rev = _run(["git", "rev-parse", "--short=12", "HEAD"], repo)
    if rev is None:
        return None
    diff = _run(["git", "diff", "HEAD", "--no-ext-diff", "--no-color", "--binary", "--", ".", *NOT_CODE], repo,
                strip=False) or ""
    untracked = (_run(["git", "ls-files", "--others", "--exclude-standard", "-z", "--", ".", *NOT_CODE], repo,
                      strip=False) or "")
    names = sorted(n for n in untracked.split("\0") if n)
    if not diff and not names:
        return rev
    digest = hashlib.sha256(diff.encode("utf-8", "surrogateescape"))
    for name in names:
        digest.update(b"\0" + name.encode("utf-8", "surrogateescape") + b"\0")
        try:
            digest.update((repo / name).read_bytes())
        except OSError:
            digest.update(b"<unreadable>")
    return f"{rev}-dirty.{digest.hexdigest()[:8]}"


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
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "cudnn_frontend": _dist_version("nvidia-cudnn-frontend", "cudnn-frontend", "cudnn"),
        "flash_mla": _dist_version("sgl-flash-mla", "flash-mla", "flash_mla"),
        "gpu": gpu,
        "driver": driver,
        "git_rev": git_rev(),
        "host": platform.node(),
        "device": device,
        "generator": GENERATOR,
    }


#: the environment keys that can change a case's result: code, libraries, GPU architecture, draws (``host``,
#: ``driver``, ``python``'s patch level and the GPU's model within one architecture do not: a resume on a larger card
#: of the same architecture re-runs the cases that did not fit, README "Testing Megatron-LM")
RESULT_KEYS = ("git_rev", "torch", "cuda", "cudnn", "cudnn_frontend", "flash_mla", "gpu", "device", "generator")
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
    this process's (a resume under other code or libraries; empty when none differs or nothing is recorded). The GPU
    counts by its architecture; the kernel libraries not for a ``provider`` that runs none of them."""
    if not isinstance(recorded, dict):
        return {}
    def comparable(key: str, value):
        return _architecture(value) if key == "gpu" else value

    keys = [k for k in RESULT_KEYS if k in recorded and not (k in KERNEL_LIBRARIES and provider in NO_KERNEL_LIBRARIES)]
    return {k: [recorded.get(k), now.get(k)] for k in keys
            if comparable(k, recorded.get(k)) != comparable(k, now.get(k))}
