"""Tensors and suites are pure functions of the case / recipe: identical across processes and hash seeds."""

import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from cases import Case, materialize
from cases.layout import ThdLayout
from cases.suites import build_suite, load_suite, render_suite
from cases.draws import BLOCK, standard_normal
from cases.rng import Rng
from cases.tensors import _randn, _row_mask, initial_value, input_shapes, output_shape, parameter_shapes

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


# ---- the counter-based draw (cases.draws) and its blocks ------------------------------------------------------
def formula(seed: int, name: str, count: int, start: int = 0) -> list:
    """Elements ``[start, start + count)`` as :mod:`cases.draws` defines them, from the pure-Python SplitMix64 stream
    of :class:`cases.rng.Rng` (outputs ``2i+1`` and ``2i+2`` of the stream give element ``i``)."""
    rng = Rng(seed, name)
    for _ in range(2 * start):
        rng.next64()
    out = []
    for _ in range(count):
        a, b = rng.next64(), rng.next64()
        total = (a & 0xFFFFFFFF) + (a >> 32) + (b & 0xFFFFFFFF) + (b >> 32)
        out.append(math.sqrt(3.0) * ((total + 2) / 2 ** 32 - 2))
    return out


@contextlib.contextmanager
def num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def big_thd_case(scope: str, dtype: str) -> Case:
    """A tiny-profile case of 17003 rows (several draw blocks per tensor), with padding and slack rows."""
    base = next(c for c in load_suite("smoke") if c.is_thd and c.scope == scope)
    return base.replace(layout=ThdLayout(cu_seqlens=(0, 9000, 16000), cu_seqlens_padded=(0, 9013, 16040),
                                         total_tokens=17003), dtype=dtype)


def gate_case() -> Case:
    """A kernel-profile case: layer scope, bfloat16, parameters of up to 16 M elements."""
    return Case.from_dict(json.loads((ROOT / "cases" / "suites" / "gate.json").read_text())["cases"][0])


def all_tensors(t) -> list:
    return sorted(t.params.items()) + sorted(t.inputs.items()) + [("dO", t.grad_output)]


def test_the_draw_is_the_splitmix64_stream_of_the_tensor_name():
    """Each element is the documented function of ``Rng(seed, name)``'s stream, at any offset; a different name or
    seed is another stream (the check can fail)."""
    assert standard_normal(5, "w", 9).tolist() == formula(5, "w", 9)
    assert standard_normal(5, "w", 4, start=1000).tolist() == formula(5, "w", 4, start=1000)
    assert standard_normal(5, "w", 9).tolist() != formula(5, "v", 9)
    assert standard_normal(6, "w", 9).tolist() != formula(5, "w", 9)


def test_blocks_and_threads_do_not_change_the_values(monkeypatch):
    from cases import draws

    whole = standard_normal(3, "w", 1000)
    monkeypatch.setitem(draws.BLOCK, "cpu", 7)
    assert torch.equal(standard_normal(3, "w", 1000), whole)
    assert torch.equal(standard_normal(3, "w", 990, start=10), whole[10:])
    with num_threads(1):
        one = standard_normal(3, "w", 1000)
    assert torch.equal(one, whole)


def test_the_draw_has_zero_mean_unit_variance_and_bounded_tails():
    x = standard_normal(1, "stats", 1 << 20)
    assert abs(float(x.mean())) < 5e-3 and abs(float(x.std()) - 1.0) < 5e-3
    assert float(x.abs().max()) <= 2 * math.sqrt(3.0)
    assert float(x.abs().max()) > 3.0  # the tails are drawn, not clipped early
    assert len(set(x[:100000].tolist())) > 99000  # 32-bit uniforms: next to no repeated values


def test_row_mask_of_a_chunk():
    real = torch.tensor([True, False, True, True, False, False, True])
    full = real.reshape(7, 1, 1).expand(7, 3, 5).reshape(-1)
    for a, b in [(0, 105), (0, 1), (14, 16), (15, 31), (44, 46), (29, 91), (104, 105)]:
        assert torch.equal(_row_mask(real, (7, 3, 5), a, b), full[a:b]), (a, b)
    real2 = torch.tensor([[True, False, True], [False, True, True]])
    full2 = real2.reshape(2, 3, 1).expand(2, 3, 4).reshape(-1)
    assert torch.equal(_row_mask(real2, (2, 3, 4), 3, 21), full2[3:21])


def test_tensors_are_the_float64_draw_cast_to_the_case_dtype():
    """The draw is made in float64 and then cast (bf16 / fp32 / fp64 cases alike)."""
    for dtype in ("bfloat16", "float32", "float64"):
        case = big_thd_case("core", dtype)
        q = materialize(case).inputs["query"]
        shape = tuple(q.shape)
        assert torch.equal(q, _randn(case.seed, "input/query", shape).to(q.dtype)), dtype
        assert not torch.equal(q, _randn(case.seed, "input/kv", shape[:1] + shape[2:]).to(q.dtype)
                               .unsqueeze(1).expand(shape)), dtype


def test_materialize_equals_whole_tensor_values():
    """Per-block scaling, padding-row scaling / zeroing and casts give the values of doing them on
    the whole tensor: parameters are ``initial_value(...)`` cast (what bench/workloads.py uses)."""
    case = gate_case()
    t = materialize(case)
    for name, shape in parameter_shapes(case.config, case.scope).items():
        p = t.params[name]
        assert torch.equal(p, initial_value(case.seed, name, shape).to(p.dtype)), name
    assert any(math.prod(s) > 16 * BLOCK["cpu"] for s in parameter_shapes(case.config, case.scope).values())
    for scope in ("layer", "core"):
        case = big_thd_case(scope, "bfloat16")
        t = materialize(case, padding_scale=1e3)
        real = t.real_rows
        assert not bool(real.all())
        for name, shape in input_shapes(case).items():
            x = _randn(case.seed, f"input/{name}", shape)
            m = real.reshape(real.shape + (1,) * (x.dim() - 1))
            assert torch.equal(t.inputs[name], torch.where(m, x, x * 1e3).to(torch.bfloat16)), (scope, name)
        shape = output_shape(case)
        x = _randn(case.seed, "grad_output", shape)
        m = real.reshape(real.shape + (1,) * (x.dim() - 1))
        want = x * m.to(x.dtype) if scope == "layer" else torch.where(m, x, x * 1e3)
        assert torch.equal(t.grad_output, want.to(torch.bfloat16)), scope
        if scope == "layer":
            assert not t.grad_output[~real].any() and t.grad_output[real].abs().min() >= 0


def test_materialize_does_not_depend_on_the_thread_count_or_the_block_size(monkeypatch):
    from cases import draws

    case = big_thd_case("core", "bfloat16")
    with num_threads(1):
        a = materialize(case, padding_scale=7.0)
    with num_threads(4):
        monkeypatch.setitem(draws.BLOCK, "cpu", 1000)
        b = materialize(case, padding_scale=7.0)
    for (name, x), (_, y) in zip(all_tensors(a), all_tensors(b)):
        assert torch.equal(x, y), name
    # negative control: another seed changes every tensor
    c = materialize(case.replace(seed=case.seed + 1), padding_scale=7.0)
    assert not any(torch.equal(x, y) for (_, x), (_, y) in zip(all_tensors(a), all_tensors(c)))


def test_materialize_twice_is_bit_identical():
    case = gate_case()
    a, b = materialize(case), materialize(case)
    for (name, x), (_, y) in zip(all_tensors(a), all_tensors(b)):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    # negative control: another seed changes the large parameters
    c = materialize(case.replace(seed=case.seed + 1))
    assert not torch.equal(a.params["linear_q_up_proj.weight"], c.params["linear_q_up_proj.weight"])
