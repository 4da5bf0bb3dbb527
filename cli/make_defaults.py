"""What ``make parity`` runs on this machine when ``SUITE`` / ``PROVIDER`` / ``CPU_ORACLES`` are not given: one line,
``<suite> <provider> <oracle>...`` (``-`` for no oracle), read once by the Makefile.

* a usable CUDA device (``torch.cuda.is_available()``): the ``gate`` suite, no CPU oracle, and provider ``cudnn`` when
  cudnn-frontend and FlashMLA are installed (the production kernels, each then required for every stage it supports),
  else ``auto``;
* otherwise: the ``smoke`` suite, provider ``auto`` (the torch kernels), the CPU oracle ``padding-dout``.

A CPU build of torch (its ``torch/version.py`` names no CUDA and no HIP) cannot see a GPU, so that is decided from the
file without importing torch; only a GPU build is asked, with one import. (The Makefile used to start an interpreter
that imported torch for each of the three variables: about 8–9 s of ``make parity`` on a 2-core CPU.) The kernel
libraries are looked up, not imported: an installed library that fails to import then fails the gate loudly (the
provider is unavailable, with the import error) instead of sending it to the torch kernels and another baseline.

    python -m cli.make_defaults      # e.g. "smoke auto padding-dout" or "gate cudnn -"
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Optional

#: the CPU oracles ``make parity`` adds on a machine without a GPU (``gate --with-oracle``)
CPU_ORACLES = ("padding-dout",)
#: the kernel libraries of the ``cudnn`` provider selection (import names)
KERNEL_LIBRARIES = ("cudnn", "flash_mla")


def installed(module: str) -> bool:
    """Whether ``module`` can be found on the path (not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def torch_build_has_gpu(version_py: Optional[str]) -> Optional[bool]:
    """From the text of ``torch/version.py``: False when it names neither CUDA nor HIP (a CPU build), True when it
    names either, None when the text says neither (unreadable, another layout: ask torch)."""
    if version_py is None:
        return None
    found = dict(re.findall(r"^(cuda|hip)\s*(?::[^=]*)?=\s*(.+?)\s*$", version_py, re.M))
    if set(found) != {"cuda", "hip"}:
        return None
    return any(value != "None" for value in found.values())


def _torch_version_py() -> Optional[str]:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch where the build cannot have a GPU (or torch is
    missing: then the gate itself says so)."""
    if not installed("torch"):
        return False
    if torch_build_has_gpu(_torch_version_py()) is False:
        return False
    import torch  # noqa: PLC0415 — a GPU build: only torch can say whether a device is usable

    return bool(torch.cuda.is_available())


def defaults(gpu: bool, libraries_installed: bool) -> tuple[str, str, tuple[str, ...]]:
    """``(suite, provider, oracles)`` for a machine with / without a usable GPU and the kernel libraries."""
    if gpu:
        return "gate", ("cudnn" if libraries_installed else "auto"), ()
    return "smoke", "auto", CPU_ORACLES


def line(suite: str, provider: str, oracles: tuple[str, ...]) -> str:
    return " ".join((suite, provider, *(oracles or ("-",))))


def main() -> int:
    gpu = cuda_available()
    print(line(*defaults(gpu, gpu and all(installed(m) for m in KERNEL_LIBRARIES))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
