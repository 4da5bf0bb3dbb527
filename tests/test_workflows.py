"""The GitHub Actions workflows under .github/workflows: linted by actionlint, audited by zizmor (offline), every
action pinned by commit, and the Makefile hooks they call.

actionlint and zizmor come with the test extra (pyproject.toml); each tool's tests skip, naming the tool, only when
it is not installed. Each tool also gets a negative control: a broken workflow it must reject.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
USES = re.compile(r"^\s*(?:-\s+)?uses:\s*(\S+)(.*)$")
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
TAG_COMMENT = re.compile(r"#\s*v\d+\.\d+\.\d+\b")

# A workflow with the mistakes each tool exists to catch (the negative controls).
BROKEN = """\
name: broken
on:
  pull_request_target:
permissions: write-all
jobs:
  job:
    runs-on: ubuntu-24.04
    steps:
      - uses: actions/checkout@v7
        with:
          ref: ${{ github.event.pull_request.head.sha }}
      - run: echo "${{ github.event.pull_request.title }}" ${{ inputs.nonexistent }}
"""


def tool(name: str) -> str:
    """The tool's executable: next to this interpreter (the venv's bin) or on PATH; skip when absent."""
    search = os.pathsep.join([sysconfig.get_path("scripts"), str(Path(sys.executable).parent),
                              os.environ.get("PATH", "")])
    found = shutil.which(name, path=search)
    if found is None:
        pytest.skip(f"{name} is not installed (it comes with the test extra: pip install -e '.[test]')")
    return found


def run_tool(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "ZIZMOR_OFFLINE": "1"}
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_the_workflows_exist():
    names = {path.name for path in WORKFLOWS}
    assert {"parity-gpu.yml", "parity-megatron.yml", "ci.yml"} <= names


def test_actionlint_accepts_the_workflows():
    result = run_tool([tool("actionlint"), "-no-color", *map(str, WORKFLOWS)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_rejects_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(BROKEN)
    result = run_tool([tool("actionlint"), "-no-color", str(broken)])
    assert result.returncode == 1 and "nonexistent" in result.stdout


def test_zizmor_offline_finds_nothing():
    result = run_tool([tool("zizmor"), "--offline", "--persona", "pedantic", "--no-progress",
                       str(ROOT / ".github" / "workflows")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor_offline_rejects_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(BROKEN)
    result = run_tool([tool("zizmor"), "--offline", "--persona", "pedantic", "--no-progress", str(broken)])
    assert result.returncode != 0
    for audit in ("dangerous-triggers", "template-injection", "unpinned-uses", "artipacked"):
        assert audit in result.stdout, audit


def pin_problems(text: str, name: str) -> list[str]:
    """Every remote ``uses:`` must name a 40-hex commit with its release tag in a comment; local ones are fine."""
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        match = USES.match(line)
        if not match or match.group(1).startswith("./"):
            continue
        ref, rest = match.groups()
        if not PINNED.match(ref):
            problems.append(f"{name}:{lineno}: {ref} is not pinned by commit")
        elif not TAG_COMMENT.search(rest):
            problems.append(f"{name}:{lineno}: {ref} lacks its '# vX.Y.Z' tag comment")
    return problems


def test_every_action_is_pinned_by_commit_with_its_tag():
    problems = [p for path in WORKFLOWS for p in pin_problems(path.read_text(), path.name)]
    assert not problems, "\n".join(problems)
    assert pin_problems(BROKEN, "broken") == ["broken:9: actions/checkout@v7 is not pinned by commit"]
    assert pin_problems("- uses: a/b@" + "0" * 40, "x") == ["x:1: a/b@" + "0" * 40 + " lacks its '# vX.Y.Z' tag comment"]


def privilege_problems(text: str, name: str) -> list[str]:
    """No ``pull_request_target``, no inherited secrets, ``permissions: {}`` at the top (each job asks for what it
    needs), and no checkout that leaves its token in .git/config."""
    problems = []
    if "pull_request_target" in text:
        problems.append(f"{name}: pull_request_target runs with the base repository's privileges")
    if "secrets: inherit" in text:
        problems.append(f"{name}: secrets: inherit")
    if not re.search(r"^permissions: \{\}$", text, re.M):
        problems.append(f"{name}: top-level permissions must be {{}}")
    if text.count("uses: actions/checkout@") != text.count("persist-credentials: false"):
        problems.append(f"{name}: a checkout without persist-credentials: false")
    return problems


def test_no_workflow_runs_untrusted_code_with_privileges():
    problems = [p for path in WORKFLOWS for p in privilege_problems(path.read_text(), path.name)]
    assert not problems, "\n".join(problems)
    assert len(privilege_problems(BROKEN, "broken")) == 3  # negative control: all but inherited secrets


def make_variables() -> set[str]:
    return set(re.findall(r"^([A-Z_]+)\s*[?:]?=", (ROOT / "Makefile").read_text(), re.M))


def shadowed_make_variables(text: str, names: set[str]) -> list[str]:
    """Keys of a workflow's ``env:`` maps named like a Makefile variable: exported, an empty one would defeat the
    Makefile's ``?=`` default (``SUITE=`` in the environment runs ``--suite`` with nothing)."""
    return [key for key in re.findall(r"^\s+([A-Z_]+):", text, re.M) if key in names]


def test_no_workflow_env_shadows_a_makefile_variable():
    names = make_variables()
    assert {"SUITE", "PROVIDER", "OUT", "JUNIT", "RUN_ARGS", "BASELINE"} <= names
    for path in WORKFLOWS:
        assert not shadowed_make_variables(path.read_text(), names), path.name
    assert shadowed_make_variables("    env:\n      SUITE: ${{ inputs.suite }}\n", names) == ["SUITE"]


def make_dry_run(*args: str, fixed: tuple = ("PYTHON=python3", "SUITE=smoke", "PROVIDER=auto"), timeout: int = 60) -> str:
    """``make -n`` of ``args`` with the ``fixed`` variables, its commands on one line each (continuations joined)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT), *fixed, *args],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.replace("\\\n", " ").split())


def test_make_parity_is_one_gate_command_and_passes_the_ci_hooks_on():
    """`make parity` is one `dsv4-parity gate` (every production path, each against its baseline, the CPU oracles,
    one closing summary); the CI hooks only add options to it."""
    gate = ("python3 -m cli gate --suite smoke --provider auto --workers auto --out reports/out/latest --make-default "
            "--baseline auto")
    oracles = " --with-oracle padding-dout"  # the CPU-only metamorphic oracles (CPU_ORACLES)
    plain = make_dry_run("parity", "CPU_ORACLES=padding-dout")
    assert plain == gate + oracles
    hooked = make_dry_run("parity", "CPU_ORACLES=padding-dout", "JUNIT=out/junit.xml", "BASELINE=none",
                          "RUN_ARGS=--impl megatron --megatron /src/Megatron-LM")
    assert hooked == (gate.replace("--baseline auto", "--baseline none") + " --junit out/junit.xml" + oracles
                      + " --impl megatron --megatron /src/Megatron-LM")
    assert make_dry_run("parity", "CPU_ORACLES=") == gate  # a GPU runner: no oracle
    assert make_dry_run("drift", "OUT=out") == "python3 -m cli compare out --baseline auto"
    assert make_dry_run("summary", "OUT=out", "BASELINE=production") == (
        "python3 -m cli report out --format markdown --no-html --no-csv --baseline production")


# ---- the H200 session scripts (.ci/*.sh: run on the device machine, never in CI) -----------------------------------
CI_SCRIPTS = sorted((Path(__file__).resolve().parents[1] / ".ci").glob("*.sh"))


@pytest.mark.parametrize("script", CI_SCRIPTS, ids=lambda p: p.name)
def test_the_device_scripts_parse(script):
    """A script that only runs on the lent GPU must not first fail there on a typo (bash -n: syntax only)."""
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_bash_n_catches_a_broken_script(tmp_path):
    broken = tmp_path / "broken.sh"
    broken.write_text("case x in\n  a) echo a ;;\n")  # no esac
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True).returncode != 0


def test_the_session_script_names_its_stages_when_called_without_one():
    script = next(p for p in CI_SCRIPTS if p.name == "h200-session.sh")
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={**os.environ, "OUT": "/tmp"})
    assert done.returncode == 2 and "fused|megatron|extras" in done.stderr


# ---- the GPU job's Python and the Megatron gate's exact revision (issue 32, item 11) -------------------------------
def installs_into_the_runners_python(text: str) -> list[str]:
    """Lines that pip-install into the runner's shared Python (``$PARITY_PYTHON -m pip``) instead of a job venv."""
    return [line.strip() for line in text.splitlines() if re.search(r'"?\$PARITY_PYTHON"? -m pip', line)]


def test_the_gpu_job_installs_only_into_its_own_virtual_environment():
    text = (ROOT / ".github" / "workflows" / "parity-gpu.yml").read_text()
    assert installs_into_the_runners_python(text) == []
    assert '-m venv --system-site-packages "$venv"' in text and '"$venv/bin/python" -m pip install' in text
    assert "PYTHON=\"$VENV_PYTHON\"" in text  # make runs in the venv
    # negative control: the former install step is caught
    assert installs_into_the_runners_python("""          "$PARITY_PYTHON" -m pip install -e '.[gpu]'""")


def megatron_sha_problems(text: str) -> list[str]:
    """The Megatron PR gate must take the head SHA as a required input, refuse anything but 40 hex digits, and
    gate exactly that commit."""
    problems = []
    if not re.search(r"head-sha:\n\s+description: .*\n\s+type: string\n\s+required: true", text):
        problems.append("no required head-sha input")
    if "^[0-9a-f]{40}$" not in text:
        problems.append("head-sha is not checked to be a full SHA")
    if "megatron-ref: ${{ inputs.head-sha }}" not in text:
        problems.append("the gated ref is not the head SHA")
    if "refs/pull/" in text.split("jobs:", 1)[1]:
        problems.append("gates the pull request's moving head ref")
    return problems


def test_the_megatron_gate_checks_out_and_reports_the_exact_head_sha():
    megatron = (ROOT / ".github" / "workflows" / "parity-megatron.yml").read_text()
    assert megatron_sha_problems(megatron) == []
    gpu = (ROOT / ".github" / "workflows" / "parity-gpu.yml").read_text()
    assert "gated=$(git -C megatron-lm rev-parse HEAD)" in gpu and '>> "$GITHUB_STEP_SUMMARY"' in gpu
    assert 'not the requested $MEGATRON_REF' in gpu
    # negative control: the former dispatch (a pull request number, its moving head ref)
    old = ("on:\n  workflow_dispatch:\n    inputs:\n      pull-request:\n        type: number\njobs:\n  megatron:\n"
           "    with:\n      megatron-ref: refs/pull/${{ inputs.pull-request }}/head\n")
    assert len(megatron_sha_problems(old)) == 4
