"""``make test`` may install a browser (``tests/setup_browser.py``: ``apt-get install chromium`` as root): the README
says so where the two commands are, with the opt-out ``DSV4_NO_BROWSER_INSTALL``, and the opt-out works
(issue 32, item 4). ``apt-get`` is never run here: ``subprocess.run`` is replaced by a recorder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import setup_browser

ROOT = Path(__file__).resolve().parents[1]


def two_commands_section(readme: str) -> str:
    return readme.split("## The two commands", 1)[1].split("\n## ", 1)[0]


def documents_the_install(section: str) -> list[str]:
    """What the section fails to say about the install (empty: all of it)."""
    needed = {"make test": r"make test", "the script": r"tests/setup_browser\.py", "apt-get": r"apt-get install",
              "chromium": r"chromium", "root": r"\broot\b", "the opt-out": r"DSV4_NO_BROWSER_INSTALL"}
    return [what for what, pattern in needed.items() if not re.search(pattern, section)]


def test_the_readme_says_make_test_may_install_chromium_and_how_to_opt_out():
    section = two_commands_section((ROOT / "README.md").read_text())
    assert documents_the_install(section) == []
    # negative control: the section as it was (no word of the install) fails the check
    before = section.split("`make test` also installs a browser", 1)[0]
    assert set(documents_the_install(before)) >= {"apt-get", "the opt-out", "the script"}


@pytest.fixture
def as_root_without_chromium(monkeypatch):
    calls = []
    monkeypatch.setattr(setup_browser.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)
    monkeypatch.setattr(setup_browser.os, "geteuid", lambda: 0)
    monkeypatch.setattr(setup_browser.subprocess, "run", lambda argv, **_: calls.append(argv))
    monkeypatch.delenv("DSV4_NO_BROWSER_INSTALL", raising=False)
    return calls


def test_the_opt_out_installs_nothing(as_root_without_chromium, monkeypatch, capsys):
    monkeypatch.setenv("DSV4_NO_BROWSER_INSTALL", "1")
    assert setup_browser.main() == 0
    assert as_root_without_chromium == [] and "browser tests will skip" in capsys.readouterr().err


def test_without_the_opt_out_root_installs_chromium(as_root_without_chromium):
    """Negative control of the opt-out: the same machine without it runs apt-get."""
    assert setup_browser.main() == 0
    assert [argv[:2] for argv in as_root_without_chromium] == [["apt-get", "update"], ["apt-get", "install"]]
    assert "chromium" in as_root_without_chromium[1]
