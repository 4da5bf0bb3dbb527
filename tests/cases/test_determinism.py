"""Tensors and suites are pure functions of the case / recipe: identical across processes and hash seeds."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from cases import Case, materialize
from cases.suites import build_suite, load_suite, render_suite

ROOT = Path(__file__).resolve().parents[2]

# Prints the sha256 of every tensor of the given cases, then the sha256 of the regenerated smoke suite file.
CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from tests.cases.test_determinism import tensor_digest, suite_digest
print(tensor_digest(json.loads(sys.stdin.read())))
print(suite_digest())
"""


def tensor_digest(case_texts) -> str:
    h = hashlib.sha256()
    for text in case_texts:
        t = materialize(Case.from_json(text))
        for name, x in sorted(t.params.items()) + sorted(t.inputs.items()) + [("dO", t.grad_output)]:
            h.update(name.encode())
            h.update(x.detach().to(torch.float64).numpy().tobytes())
    return h.hexdigest()


def suite_digest() -> str:
    return hashlib.sha256(render_suite("smoke", build_suite("smoke")).encode()).hexdigest()


def child(payload: str, hash_seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT))], input=payload, capture_output=True,
                         text=True, env=env, cwd=ROOT, check=True)
    return out.stdout.split()


def sample_cases() -> list[str]:
    smoke = load_suite("smoke")
    picked = [c for c in smoke if c.is_thd][:3] + [c for c in smoke if not c.is_thd][:2]
    return [c.to_json() for c in picked]


def test_tensors_and_suites_identical_across_processes():
    # a fresh interpreter with a fixed hash seed (this one's is random unless PYTHONHASHSEED is set)
    first = child(json.dumps(sample_cases()), "12345")
    assert first == [tensor_digest(sample_cases()), suite_digest()]
    # negative control: another seed gives other tensors, so the digest does see the values
    reseeded = [Case.from_json(t) for t in sample_cases()]
    assert tensor_digest([c.replace(seed=c.seed + 1).to_json() for c in reseeded]) != first[0]


def test_each_tensor_has_its_own_stream():
    case = load_suite("smoke")[1]
    a, b = materialize(case), materialize(case)
    for name in a.params:
        assert a.params[name].equal(b.params[name])
    names = sorted(a.params)
    assert not a.params[names[0]].flatten()[:4].equal(a.params[names[1]].flatten()[:4])


def test_threaded_draws_equal_sequential_draws():
    """Drawing a case's tensors on several threads (``cases.tensors._draw_all``, above 1 M numbers) gives the values
    of drawing them one after the other; a different seed gives different values (the check can fail)."""
    from cases.tensors import _draw_all, _randn

    shapes = {"big": (1 << 19, 2), "other": (1 << 18, 3), "input/x": (7, 5)}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        threaded = _draw_all(11, shapes)
    finally:
        torch.set_num_threads(before)
    for name, shape in shapes.items():
        assert torch.equal(threaded[name], _randn(11, name, shape)), name
    assert not torch.equal(_draw_all(12, shapes)["big"], threaded["big"])
