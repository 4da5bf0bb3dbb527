"""``dsv4-parity cache``: where the compiled-kernel cache lives, what it holds, and clearing it.

The cache (:mod:`fused.kernels.compile_cache`) keeps the cuDNN DSA wrappers' compiled CuTe-DSL kernels across
processes and runs under ``$DSV4_PARITY_CACHE_DIR`` (default ``~/.cache/dsv4-parity``). Entries are keyed by the
library versions, the installed ``cudnn`` package source and this project's cache code, so a stale entry is never
used; clearing is only ever needed to reclaim disk space or to measure a cold run.

The command runs without torch: importing ``fused.kernels.compile_cache`` as a package member would run
``fused/__init__.py`` (the whole composition, torch included), so :func:`compile_cache` loads that module's file on
its own — its top level imports only the standard library (``tests/test_startup.py`` checks both).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

#: ``--help`` text: the module docstring without reStructuredText markup
DESCRIPTION = """\
Show where the compiled-kernel cache lives and what it holds, or clear it.

The cache keeps the cuDNN DSA wrappers' compiled CuTe-DSL kernels across processes and runs, under
$DSV4_PARITY_CACHE_DIR (default ~/.cache/dsv4-parity). Entries are keyed by the library versions, the installed
cudnn package source and this project's cache code, so a stale entry is never used; clearing is only needed to
reclaim disk space or to measure a cold run. DSV4_PARITY_KERNEL_CACHE=0 switches persistence off."""

SOURCE = Path(__file__).resolve().parents[1] / "fused" / "kernels" / "compile_cache.py"


def compile_cache() -> ModuleType:
    """:mod:`fused.kernels.compile_cache` — the imported module when the process has it, else its file loaded alone
    (module docstring); the functions used here read only paths and environment variables."""
    loaded = sys.modules.get("fused.kernels.compile_cache")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("_dsv4_compile_cache_paths", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def cmd_cache(args: argparse.Namespace) -> int:
    cache = compile_cache()
    root = cache.cache_root()
    if args.clear:
        removed = cache.clear(root)
        print(f"cleared {root}" + (f" ({', '.join(p.name for p in removed)})" if removed else " (nothing cached)"))
        return 0
    kernels = root / "dsa-kernels"
    entries = [p for p in kernels.glob(f"v{cache.SCHEMA}/*/*") if (p / cache.RECORD).is_file()]
    environments = {p.parent for p in entries}
    print(f"cache: {root}" + ("" if os.environ.get(cache.ENV_DIR) else f"  (set {cache.ENV_DIR} to move it)"))
    print(f"compiled DSA kernels: {len(entries)} in {len(environments)} environment(s), "
          f"{_size(root) / 2**20:.1f} MiB in all" if root.exists() else "compiled DSA kernels: none")
    print("persistence: " + ("on" if cache.persistence_enabled()
                             else f"off ({cache.ENV_SWITCH}=0)") + "; clear with: dsv4-parity cache --clear")
    return 0


def add_parsers(subparsers: argparse._SubParsersAction) -> dict:
    """Register ``cache`` on the ``dsv4-parity`` subparsers."""
    p = subparsers.add_parser("cache", help="show or clear the compiled-kernel cache", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clear", action="store_true", help="delete every cached compiled kernel")
    p.set_defaults(func=cmd_cache, torch_free=True)
    return {"cache": p}
