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
from cases.tensors import (CHUNK, _draw_all, _Draw, _randn, _row_mask, initial_value, input_shapes,
                           output_shape, parameter_shapes)

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


# ---- chunked, threaded draws (cases.tensors: CHUNK, _draw_all) ---------------------------------------
def seeded(key: str) -> torch.Generator:
    """The generator of seed key ``key`` as the module docstring of :mod:`cases.tensors` defines it."""
    digest = hashlib.sha256(key.encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))


def single_draw(seed: int, name: str, shape: tuple) -> torch.Tensor:
    """How every tensor was drawn before chunking: one float64 draw from the generator of ``"{seed}/{name}"``."""
    return torch.randn(shape, generator=seeded(f"{seed}/{name}"), dtype=torch.float64)


@contextlib.contextmanager
def num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def big_thd_case(scope: str, dtype: str) -> Case:
    """A tiny-profile case whose inputs and dO are chunked (17003 rows), with padding and slack rows."""
    base = next(c for c in load_suite("smoke") if c.is_thd and c.scope == scope)
    return base.replace(layout=ThdLayout(cu_seqlens=(0, 9000, 16000), cu_seqlens_padded=(0, 9013, 16040),
                                         total_tokens=17003), dtype=dtype)


def gate_case() -> Case:
    """A kernel-profile case: layer scope, bfloat16, parameters of up to 16 M elements."""
    return Case.from_dict(json.loads((ROOT / "cases" / "suites" / "gate.json").read_text())["cases"][0])


def all_tensors(t) -> list:
    return sorted(t.params.items()) + sorted(t.inputs.items()) + [("dO", t.grad_output)]


def test_small_tensors_keep_the_single_generator_draw():
    """Tensors of at most CHUNK elements (all of the CPU suites') are still the single float64 draw of
    ``"{seed}/{name}"``, bit for bit; a tensor of CHUNK + 1 elements is not (the chunking is real)."""
    for shape in [(1,), (7,), (3, 5), (2, 3, 4), (CHUNK,), (2, CHUNK // 2)]:
        assert torch.equal(_randn(5, "w", shape), single_draw(5, "w", shape)), shape
    for case in [c for c in load_suite("smoke") if c.is_thd][:4] + [c for c in load_suite("smoke") if not c.is_thd][:2]:
        t = materialize(case, padding_scale=3.0)
        for name, shape in parameter_shapes(case.config, case.scope).items():
            old = initial_value(case.seed, name, shape, single_draw(case.seed, name, shape))
            assert torch.equal(t.params[name], old.to(t.params[name].dtype)), (case.id, name)
        mask = t.real_rows
        for name, shape in input_shapes(case).items():
            x = single_draw(case.seed, f"input/{name}", shape)
            m = mask.reshape(mask.shape + (1,) * (x.dim() - mask.dim()))
            assert torch.equal(t.inputs[name], torch.where(m, x, x * 3.0).to(case.torch_dtype)), (case.id, name)
    big = (CHUNK + 1,)
    assert not torch.equal(_randn(5, "w", big), single_draw(5, "w", big))
    assert torch.equal(_randn(5, "w", big)[:CHUNK], single_draw(5, "w#0", (CHUNK,)))


def test_chunk_boundaries_follow_the_flattened_tensor():
    """Chunk ``i`` is elements ``[i*CHUNK, (i+1)*CHUNK)`` of the flattened tensor, drawn by ``"{seed}/{name}#{i}"``."""
    x = _randn(3, "w", (CHUNK + 1,))
    assert torch.equal(x[:CHUNK], torch.randn(CHUNK, generator=seeded("3/w#0"), dtype=torch.float64))
    assert torch.equal(x[CHUNK:], torch.randn(1, generator=seeded("3/w#1"), dtype=torch.float64))
    # negative control: the last element is not chunk 0's stream carried on
    assert not torch.equal(x[CHUNK:], torch.randn(CHUNK + 1, generator=seeded("3/w#0"), dtype=torch.float64)[CHUNK:])
    flat = _randn(3, "w", (5, CHUNK // 2 + 1)).view(-1)  # 3 chunks, rows straddling them
    assert flat.numel() == 2 * CHUNK + CHUNK // 2 + 5
    assert torch.equal(flat[:CHUNK], x[:CHUNK])
    assert torch.equal(flat[CHUNK:2 * CHUNK], torch.randn(CHUNK, generator=seeded("3/w#1"), dtype=torch.float64))
    assert torch.equal(flat[2 * CHUNK:],
                       torch.randn(CHUNK // 2 + 5, generator=seeded("3/w#2"), dtype=torch.float64))
    z = _randn(3, "w", (CHUNK + 1,), torch.float32)
    assert z.dtype == torch.float32
    assert torch.equal(z[:CHUNK], torch.randn(CHUNK, generator=seeded("3/w#0"), dtype=torch.float32))


def test_row_mask_of_a_chunk():
    real = torch.tensor([True, False, True, True, False, False, True])
    full = real.reshape(7, 1, 1).expand(7, 3, 5).reshape(-1)
    for a, b in [(0, 105), (0, 1), (14, 16), (15, 31), (44, 46), (29, 91), (104, 105)]:
        assert torch.equal(_row_mask(real, (7, 3, 5), a, b), full[a:b]), (a, b)
    real2 = torch.tensor([[True, False, True], [False, True, True]])
    full2 = real2.reshape(2, 3, 1).expand(2, 3, 4).reshape(-1)
    assert torch.equal(_row_mask(real2, (2, 3, 4), 3, 21), full2[3:21])


def test_large_tensors_are_drawn_in_float64_whatever_the_case_dtype():
    """float64 draws for every case dtype (float32 normals differ between AVX2 and scalar/Arm hosts); the check
    can fail: a float32 draw of the same generators gives other values."""
    for dtype in ("bfloat16", "float32", "float64"):
        case = big_thd_case("core", dtype)
        q = materialize(case).inputs["query"]
        shape = tuple(q.shape)
        assert math.prod(shape) > CHUNK
        assert torch.equal(q, _randn(case.seed, "input/query", shape).to(q.dtype)), dtype
        assert not torch.equal(q, _randn(case.seed, "input/query", shape, torch.float32).to(q.dtype)), dtype


def test_materialize_equals_whole_tensor_values():
    """Per-chunk scaling, padding-row scaling / zeroing and casts inside the pool give the values of doing them on
    the whole tensor: parameters are ``initial_value(...)`` cast (what bench/workloads.py uses)."""
    case = gate_case()
    t = materialize(case)
    for name, shape in parameter_shapes(case.config, case.scope).items():
        p = t.params[name]
        assert torch.equal(p, initial_value(case.seed, name, shape).to(p.dtype)), name
    assert any(math.prod(s) > CHUNK for s in parameter_shapes(case.config, case.scope).values())
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


def test_chunked_draws_do_not_depend_on_the_thread_count():
    """All chunks of all tensors on 1 thread (no pool) or 4 (pool): the same values, equal to the whole-tensor draws
    one after the other; a different seed gives different values (the check can fail)."""
    draws = [_Draw("big", (2 * CHUNK + 5,), torch.bfloat16, lambda x, a, b: x * 3.0),
             _Draw("rows", (3, CHUNK // 2 + 7), torch.float32), _Draw("input/x", (7, 5), torch.bfloat16)]
    with num_threads(1):
        one = _draw_all(11, draws)
    with num_threads(4):
        four = _draw_all(11, draws)
    for d in draws:
        assert torch.equal(one[d.name], four[d.name]), d.name
        x = _randn(11, d.name, d.shape)
        assert torch.equal(four[d.name], (x if d.finish is None else x * 3.0).to(d.dtype)), d.name
    with num_threads(4):
        assert not torch.equal(_draw_all(12, draws)["big"], four["big"])

    case = big_thd_case("core", "bfloat16")
    with num_threads(1):
        a = materialize(case, padding_scale=7.0)
    with num_threads(4):
        b = materialize(case, padding_scale=7.0)
    for (name, x), (_, y) in zip(all_tensors(a), all_tensors(b)):
        assert torch.equal(x, y), name


def test_draw_threads_setting_changes_the_pool_not_the_values(monkeypatch):
    """``DSV4_PARITY_DRAW_THREADS`` sizes the drawing pool (the pool really gets that many workers) and the values
    stay bit-identical to the one-thread draws."""
    from cases import tensors

    draws = [_Draw("big", (3 * CHUNK + 1,), torch.bfloat16, lambda x, a, b: x * 0.5)]
    with num_threads(1):
        one = _draw_all(5, draws)
    sizes = []
    real_pool = tensors.ThreadPoolExecutor

    def recording_pool(n):
        sizes.append(n)
        return real_pool(n)

    monkeypatch.setattr(tensors, "ThreadPoolExecutor", recording_pool)
    monkeypatch.setenv(tensors.DRAW_THREADS_ENV, "3")
    with num_threads(1):
        three = _draw_all(5, draws)
    assert sizes == [3] and torch.equal(one["big"], three["big"])
    monkeypatch.setenv(tensors.DRAW_THREADS_ENV, "junk")  # ignored: the run's threads (1, no pool)
    with num_threads(1):
        assert torch.equal(_draw_all(5, draws)["big"], one["big"]) and sizes == [3]


def test_materialize_twice_is_bit_identical():
    case = gate_case()
    a, b = materialize(case), materialize(case)
    for (name, x), (_, y) in zip(all_tensors(a), all_tensors(b)):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    # negative control: another seed changes the large parameters
    c = materialize(case.replace(seed=case.seed + 1))
    assert not torch.equal(a.params["linear_q_up_proj.weight"], c.params["linear_q_up_proj.weight"])
