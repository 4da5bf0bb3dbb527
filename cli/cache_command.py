"""``dsv4-parity cache``: where the compiled-kernel cache lives, what it holds, and clearing it.

The cache (:mod:`fused.kernels.compile_cache`) keeps the cuDNN DSA wrappers' compiled CuTe-DSL kernels across
processes and runs under ``$DSV4_PARITY_CACHE_DIR`` (default ``~/.cache/dsv4-parity``). Entries are keyed by the
library versions, the installed ``cudnn`` package source and this project's cache code, so a stale entry is never
used; clearing is only ever needed to reclaim disk space or to measure a cold run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def cmd_cache(args: argparse.Namespace) -> int:
    from fused.kernels import compile_cache

    root = compile_cache.cache_root()
    if args.clear:
        removed = compile_cache.clear(root)
        print(f"cleared {root}" + (f" ({', '.join(p.name for p in removed)})" if removed else " (nothing cached)"))
        return 0
    kernels = root / "dsa-kernels"
    entries = [p for p in kernels.glob(f"v{compile_cache.SCHEMA}/*/*") if (p / compile_cache.RECORD).is_file()]
    environments = {p.parent for p in entries}
    print(f"cache: {root}" + ("" if os.environ.get(compile_cache.ENV_DIR) else
                              f"  (set {compile_cache.ENV_DIR} to move it)"))
    print(f"compiled DSA kernels: {len(entries)} in {len(environments)} environment(s), "
          f"{_size(root) / 2**20:.1f} MiB in all" if root.exists() else "compiled DSA kernels: none")
    print("persistence: " + ("on" if compile_cache.persistence_enabled()
                             else f"off ({compile_cache.ENV_SWITCH}=0)") + "; clear with: dsv4-parity cache --clear")
    return 0


def add_parsers(subparsers: argparse._SubParsersAction) -> dict:
    """Register ``cache`` on the ``dsv4-parity`` subparsers."""
    p = subparsers.add_parser("cache", help="show or clear the compiled-kernel cache",
                              description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1])
    p.add_argument("--clear", action="store_true", help="delete every cached compiled kernel")
    p.set_defaults(func=cmd_cache)
    return {"cache": p}
