"""What ``make parity`` runs when not told (``cli/make_defaults.py``, read once by the Makefile's ``PARITY_DEFAULTS``): the
suite, provider and CPU oracles from whether a GPU is usable, deciding from ``torch/version.py`` without importing a
CPU build of torch. Checked by what is deterministic (the line printed, ``'torch' in sys.modules``, ``make -n``),
never by timing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli import make_defaults
from tests.test_workflows import make_dry_run

ROOT = Path(__file__).resolve().parents[1]

CPU_BUILD = """__version__ = '2.13.0+cpu'
debug = False
cuda: Optional[str] = None
git_version = 'cf30153c'
hip: Optional[str] = None
"""


def test_a_cpu_build_is_read_from_its_version_file():
    assert make_defaults.torch_build_has_gpu(CPU_BUILD) is False
    # controls: a CUDA or a HIP build must be asked; text without both fields is not guessed at
    assert make_defaults.torch_build_has_gpu(CPU_BUILD.replace("cuda: Optional[str] = None",
                                                               "cuda: Optional[str] = '13.0'")) is True
    assert make_defaults.torch_build_has_gpu(CPU_BUILD.replace("hip: Optional[str] = None", "hip = '6.2'")) is True
    assert make_defaults.torch_build_has_gpu("__version__ = '9.9'\ncuda = None\n") is None
    assert make_defaults.torch_build_has_gpu(None) is None


def test_the_defaults_follow_the_gpu_and_the_kernel_libraries():
    assert make_defaults.defaults(False, False) == ("smoke", "auto", ("padding-dout",))
    assert make_defaults.defaults(True, True) == ("gate", "cudnn", ())
    assert make_defaults.defaults(True, False) == ("gate", "auto", ())
    assert make_defaults.line("gate", "cudnn", ()) == "gate cudnn -"
    assert make_defaults.line("smoke", "auto", ("padding-dout",)) == "smoke auto padding-dout"


PROBE = ("import sys\nimport cli.make_defaults as m\n{patch}m.main()\n"
         "print('torch_loaded=' + str('torch' in sys.modules))\n")
#: pretends the installed torch is a CUDA build (its version file read as one)
AS_CUDA_BUILD = "m._torch_version_py = lambda: \"cuda: Optional[str] = '13.0'\\nhip: Optional[str] = None\\n\"\n"


def _probe(patch: str = "") -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE.format(patch=patch)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.skipif(make_defaults.torch_build_has_gpu(make_defaults._torch_version_py()) is not False,
                    reason="this torch is a GPU build: the probe must import it")
def test_on_a_cpu_build_the_probe_prints_the_cpu_defaults_without_importing_torch():
    assert _probe() == ["smoke", "auto", "padding-dout", "torch_loaded=False"]
    # control: a build that names CUDA is asked (torch imported), and a CPU machine still gets the CPU defaults
    assert _probe(AS_CUDA_BUILD) == ["smoke", "auto", "padding-dout", "torch_loaded=True"]


def _make_dry_run(*args: str) -> str:
    """``make -n`` in this interpreter, the suite, provider and oracles left to the probe."""
    return make_dry_run(*args, fixed=(f"PYTHON={sys.executable}",), timeout=300)


def test_make_parity_takes_suite_provider_and_oracles_from_the_one_probe():
    """The Makefile's three variables are the probe's three fields; ``-`` is no oracle (``PARITY_DEFAULTS`` given on the
    command line stands for what the probe would print on a GPU runner)."""
    gpu = _make_dry_run("parity", "PARITY_DEFAULTS=gate cudnn -")
    assert "--suite gate --provider cudnn " in gpu and "--with-oracle" not in gpu
    cpu = _make_dry_run("parity", "PARITY_DEFAULTS=smoke auto padding-dout")
    assert "--suite smoke --provider auto " in cpu and cpu.endswith("--with-oracle padding-dout")
    if make_defaults.cuda_available():
        pytest.skip("this machine has a GPU: the probe prints the GPU line here")
    plain = _make_dry_run("parity")  # the probe itself, on this CPU machine
    assert "--suite smoke --provider auto " in plain and plain.endswith("--with-oracle padding-dout")
