"""A user's git clone, read-only: revisions, the first-parent path between two of them, commit subjects and
``Upstream-Commit:`` trailers, and a throwaway worktree to check revisions out in.

Nothing here writes the clone's working tree or refs: :class:`ThrowawayWorktree` adds one detached worktree (git's
own bookkeeping under ``.git/worktrees/``) in a temporary directory and removes it again (``git worktree remove``,
then ``prune``), also when the block fails.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cases.errors import CaseError

TRAILER = "Upstream-Commit"


def git(repo: Path, *args: str, check: bool = True, timeout: float = 120) -> str:
    """``git -C repo args...`` stdout (stripped); a failure raises :class:`CaseError` naming the command."""
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise CaseError("megatron", "git is not installed (bisect reads the Megatron-LM clone with git)") from None
    except subprocess.TimeoutExpired:
        raise CaseError("megatron", f"git {' '.join(args)} timed out in {repo}") from None
    if check and out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["failed"])[-1]
        raise CaseError("megatron", f"git {' '.join(args)} in {repo}: {why}")
    return out.stdout.strip()


@dataclass(frozen=True)
class Commit:
    """One commit: full ``sha``, its ``subject`` and the ``Upstream-Commit:`` trailer (``upstream``, or None)."""

    sha: str
    subject: str
    upstream: Optional[str] = None

    @property
    def short(self) -> str:
        return self.sha[:10]

    def label(self) -> str:
        """``<sha10>`` plus ``(upstream <sha10>)`` when the commit carries the trailer."""
        return self.short + (f" (upstream {self.upstream[:10]})" if self.upstream else "")


def check_repo(repo: Path) -> Path:
    """``repo`` as a git work tree or bare clone; else a clear error."""
    repo = repo.expanduser()
    if not repo.is_dir():
        raise CaseError("megatron", f"{repo} is not a directory (bisect needs a Megatron-LM git clone)")
    if git(repo, "rev-parse", "--git-dir", check=False) == "":
        raise CaseError("megatron", f"{repo} is not a git repository (bisect needs a Megatron-LM git clone)")
    return repo.resolve()


def resolve(repo: Path, rev: str, option: str) -> str:
    """The full sha of ``rev`` (a sha prefix, branch, tag, ``X^``, or an upstream sha found in a trailer)."""
    out = git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if re.fullmatch(r"[0-9a-f]{40}", out):
        return out
    if re.fullmatch(r"[0-9a-f]{7,40}\^?", rev):  # an upstream id, as the history bundle's trailers name them
        base, parent = rev.rstrip("^"), rev.endswith("^")
        found = git(repo, "log", "--all", "--format=%H", f"--grep={TRAILER}: {base}", check=False).split()
        if len(found) == 1:
            return git(repo, "rev-parse", f"{found[0]}^") if parent else found[0]
    raise CaseError(option, f"{rev!r} names no commit of {repo}")


def commit(repo: Path, sha: str) -> Commit:
    text = git(repo, "log", "-1", f"--format=%H%x00%s%x00%(trailers:key={TRAILER},valueonly)", sha)
    full, subject, trailer = (text.split("\x00") + ["", ""])[:3]
    found = re.search(r"\b[0-9a-f]{40}\b", trailer)
    return Commit(full, subject, found.group(0) if found else None)


def first_parent_path(repo: Path, good: str, bad: str) -> list[str]:
    """The first-parent chain after ``good`` up to ``bad`` (oldest first, ``bad`` last); ``good`` must lie on it."""
    if good == bad:
        raise CaseError("good", "good and bad name the same commit")
    chain = git(repo, "rev-list", "--first-parent", "--reverse", f"{good}..{bad}").split()
    if not chain:
        raise CaseError("good", f"{good[:10]} is not an ancestor of {bad[:10]}")
    parent = git(repo, "rev-parse", f"{chain[0]}^1", check=False)
    if parent != good:
        raise CaseError("good", f"{good[:10]} is not on the first-parent history of {bad[:10]} (bisect walks "
                                "first parents only)")
    return chain


class ThrowawayWorktree:
    """``with ThrowawayWorktree(repo) as tree: tree.checkout(sha)`` — one detached worktree of ``repo`` in a
    temporary directory, removed with its directory when the block ends."""

    def __init__(self, repo: Path, parent: Optional[Path] = None):
        self.repo = repo
        self._tmp = Path(tempfile.mkdtemp(prefix="dsv4-parity-bisect-", dir=parent))
        self.path = self._tmp / "megatron"
        self._added = False

    def __enter__(self) -> "ThrowawayWorktree":
        return self

    def checkout(self, sha: str) -> Path:
        if not self._added:
            git(self.repo, "worktree", "add", "--detach", "--quiet", str(self.path), sha, timeout=600)
            self._added = True
        else:
            git(self.path, "checkout", "--detach", "--quiet", "--force", sha, timeout=600)
            git(self.path, "clean", "-fdxq", timeout=120)  # no stray files (bytecode) of the previous revision
        return self.path

    def __exit__(self, *exc) -> None:
        if self._added:
            git(self.repo, "worktree", "remove", "--force", str(self.path), check=False)
            git(self.repo, "worktree", "prune", check=False)
        shutil.rmtree(self._tmp, ignore_errors=True)

