"""Where Megatron-LM comes from: a user's checkout or the pinned snapshot, extracted once into a cache.

Resolution order (the first that is set wins):

1. an explicit path (``--megatron PATH``, passed to :func:`locate`);
2. the ``DSV4_MEGATRON`` environment variable;
3. the pinned snapshot ``../shared/megatron/megatron-lm-dev-<id>.tar.gz`` beside this project's checkout (or
   ``DSV4_MEGATRON_SNAPSHOT``), extracted atomically (temporary directory + rename, so concurrent workers never see a
   half-written tree) into ``$DSV4_PARITY_CACHE_DIR/megatron/<id>`` (default ``~/.cache/dsv4-parity``).

A checkout is a directory holding ``megatron/core/transformer/experimental_attention_variant/`` with the DSv4 files
(:data:`REQUIRED_FILES`). Anything else raises :class:`MegatronSourceError`, one line naming where it looked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ENV_PATH = "DSV4_MEGATRON"
#: how ``DSV4_MEGATRON`` was set, for messages: ``--megatron`` when the command line set it from that option
ENV_ORIGIN = "DSV4_MEGATRON_ORIGIN"
ENV_SNAPSHOT = "DSV4_MEGATRON_SNAPSHOT"
ENV_CACHE = "DSV4_PARITY_CACHE_DIR"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT_GLOB = "megatron-lm-dev-*.tar.gz"
VARIANT_DIR = Path("megatron/core/transformer/experimental_attention_variant")
#: the DSv4 files the adapter drives; a checkout without them has no DSv4 code
REQUIRED_FILES = ("deepseek_v4_hybrid_attention.py", "csa.py", "dsa.py")


class MegatronSourceError(ValueError):
    """No usable Megatron-LM: a missing path, a checkout without DSv4 code, an incompatible revision."""


@dataclass(frozen=True)
class MegatronSource:
    """A usable Megatron-LM tree: ``root`` goes on ``sys.path``; ``revision`` is the commit or the snapshot id;
    ``origin`` says how it was found (``--megatron``, ``DSV4_MEGATRON``, ``snapshot``)."""

    root: Path
    revision: str
    origin: str


def _snapshot_dirs() -> list[Path]:
    return [PROJECT_ROOT.parent / "shared" / "megatron", PROJECT_ROOT / "shared" / "megatron"]


def find_snapshot() -> Optional[Path]:
    """The pinned snapshot archive, or None when this machine has none."""
    explicit = os.environ.get(ENV_SNAPSHOT)
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    for folder in _snapshot_dirs():
        found = sorted(folder.glob(SNAPSHOT_GLOB)) if folder.is_dir() else []
        if found:
            return found[-1]
    return None


def snapshot_id(archive: Path) -> str:
    """``megatron-lm-dev-d48bd6be0a.tar.gz`` -> ``megatron-lm-dev-d48bd6be0a``."""
    return archive.name[: -len(".tar.gz")] if archive.name.endswith(".tar.gz") else archive.stem


def cache_dir() -> Path:
    base = os.environ.get(ENV_CACHE)
    return Path(base) if base else Path.home() / ".cache" / "dsv4-parity"


def extract(archive: Path, into: Optional[Path] = None) -> Path:
    """Extract ``archive`` once into ``<cache>/megatron/<id>`` and return the tree root (holding ``megatron/``)."""
    ident = snapshot_id(archive)
    target = (into or cache_dir() / "megatron") / ident
    root = target / ident
    if (root / VARIANT_DIR).is_dir():
        return root
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{ident}-", dir=target.parent))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(tmp, filter="data")
        try:
            os.rename(tmp, target)  # atomic; a concurrent worker that won the race leaves its tree in place
        except OSError:
            if not (root / VARIANT_DIR).is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not (root / VARIANT_DIR).is_dir():
        raise MegatronSourceError(f"snapshot {archive} does not hold {ident}/{VARIANT_DIR}")
    return root


def git_revision(root: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", text) else None


#: the trailer a commit of the offline history bundle carries: the upstream Megatron-LM commit it reproduces
UPSTREAM_TRAILER = "Upstream-Commit"
#: what a copy of a tree records of the tree it was copied from (``{"revision", "upstream"}``): the real-code
#: mutants' scratch copies are that revision plus one planted bug
REVISION_FILE = ".dsv4-parity-revision.json"


def _recorded(root: Path) -> Optional[dict]:
    try:
        data = json.loads((root / REVISION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("revision"), str) else None


def _snapshot_revision(root: Path) -> Optional[str]:
    """``snapshot <id>`` for a tree extracted from the pinned snapshot (``<cache>/<id>/<id>``)."""
    if root.name.startswith("megatron-lm-") and root.parent.name == root.name:
        return f"snapshot {root.name}"
    return None


def tree_revision(root: Path) -> Optional[str]:
    """The revision of the tree at ``root``: a copy's recorded revision, its git HEAD, or the snapshot it was
    extracted from (None when none is known)."""
    root = Path(root)
    return (_recorded(root) or {}).get("revision") or git_revision(root) or _snapshot_revision(root)


def record_revision(copy: Path, original: Path) -> None:
    """Write into ``copy`` the revision (and upstream commit) of the tree ``original`` it was copied from."""
    revision = tree_revision(Path(original))
    if revision is None:
        return
    upstream = upstream_revision(MegatronSource(Path(original), revision, "copy"))
    (Path(copy) / REVISION_FILE).write_text(json.dumps({"revision": revision, "upstream": upstream}),
                                            encoding="utf-8")


def upstream_revision(source: MegatronSource) -> Optional[str]:
    """The upstream Megatron-LM commit of ``source`` (hex; what the known-deviation registry records, see
    ``parity/deviations/known.py``): the id in a snapshot's name (``snapshot megatron-lm-dev-d48bd6be0a`` -> ``d48bd6be0a``);
    for a git checkout the ``Upstream-Commit:`` trailer of its HEAD (a commit of the offline history bundle), else
    HEAD itself (an upstream clone); a copy's recorded one; None for a tree that is none of these."""
    recorded = _recorded(Path(source.root))
    if recorded is not None and recorded.get("revision") == source.revision:
        return recorded.get("upstream")
    snap = re.fullmatch(r"snapshot .*-([0-9a-f]{7,40})", source.revision)
    if snap:
        return snap.group(1)
    if not re.fullmatch(r"[0-9a-f]{40}", source.revision):
        return None
    try:
        out = subprocess.run(["git", "-C", str(source.root), "log", "-1",
                              f"--format=%(trailers:key={UPSTREAM_TRAILER},valueonly)"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return source.revision
    found = re.findall(r"[0-9a-f]{40}", out.stdout) if out.returncode == 0 else []
    return found[0] if found else source.revision


def check_checkout(root: Path, origin: str) -> Path:
    """``root`` (or its ``Megatron-LM`` parent layout) as a tree holding the DSv4 files; else a clear error."""
    root = root.expanduser()
    if not root.exists():
        raise MegatronSourceError(f"Megatron-LM path {root} ({origin}) does not exist")
    if not root.is_dir():
        raise MegatronSourceError(f"Megatron-LM path {root} ({origin}) is not a directory")
    if (root / "core" / "transformer").is_dir() and root.name == "megatron":
        root = root.parent  # pointed at the package itself
    variant = root / VARIANT_DIR
    if not (root / "megatron" / "core").is_dir():
        raise MegatronSourceError(f"{root} ({origin}) is not a Megatron-LM checkout: no megatron/core/ in it")
    missing = [name for name in REQUIRED_FILES if not (variant / name).is_file()]
    if missing:
        raise MegatronSourceError(f"{root} ({origin}) has no DSv4 code: {VARIANT_DIR}/{missing[0]} is missing "
                                  "(DSv4 lives on Megatron-LM's `dev` branch)")
    return root.resolve()


def locate(path: Optional[str] = None) -> MegatronSource:
    """The Megatron-LM tree to test (see the module docstring for the order)."""
    if path:
        root = check_checkout(Path(path), "--megatron")
        return MegatronSource(root, tree_revision(root) or f"checkout {root} (not a git work tree)", "--megatron")
    env = os.environ.get(ENV_PATH)
    if env:
        origin = os.environ.get(ENV_ORIGIN) or ENV_PATH
        if origin not in ("--megatron", ENV_PATH):
            origin = ENV_PATH
        root = check_checkout(Path(env), origin)
        return MegatronSource(root, tree_revision(root) or f"checkout {root} (not a git work tree)", origin)
    archive = find_snapshot()
    if archive is None:
        looked = ", ".join(str(d / SNAPSHOT_GLOB) for d in _snapshot_dirs())
        raise MegatronSourceError(f"no Megatron-LM found: pass --megatron PATH or set {ENV_PATH}=PATH (a checkout of "
                                  f"Megatron-LM dev); the pinned snapshot was not found at {looked}")
    root = extract(archive)
    return MegatronSource(root, f"snapshot {snapshot_id(archive)}", "snapshot")
