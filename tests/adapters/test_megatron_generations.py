"""The production API-generation table (:mod:`adapters.megatron.generations`): each generation is recognised by its
probe alone, a tree no probe recognises is refused up front (exit 2, the missing symbol and the nearest drivable
revision: tested on synthetic checkouts), the recorders' layout conversions of the older generations, and where an
exception counts as production's own."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from adapters.megatron import generations as gens
from adapters.megatron import recorders
from tests.adapters.synthetic_megatron import write_tree

ROOT = Path(__file__).resolve().parents[2]


def fake_modules(needs) -> dict:
    """Module objects holding exactly ``needs`` (the probe's view of an imported tree)."""
    import dataclasses

    out: dict = {}
    for need in needs:
        module = out.setdefault(need.full_module, types.ModuleType(need.full_module))
        if need.kind == "field":
            old = getattr(module, "MLATransformerConfig", None)
            names = [f.name for f in dataclasses.fields(old)] if dataclasses.is_dataclass(old) else []
            module.MLATransformerConfig = dataclasses.make_dataclass("MLATransformerConfig",
                                                                     [(n, object, None) for n in names + [need.name]])
        elif need.kind in ("attr", "kwarg"):
            head, _, tail = need.name.partition(".")
            if not tail:
                if not hasattr(module, head):
                    setattr(module, head, lambda *a, **k: None)
                continue
            cls = getattr(module, head, None)
            if not isinstance(cls, type):
                cls = type(head, (), {})
                setattr(module, head, cls)
            kwargs = set(getattr(getattr(cls, tail, None), "_kw", ())) | ({need.detail} if need.kind == "kwarg" else set())
            fn = eval(f"lambda self{''.join(f', {k}=None' for k in sorted(kwargs))}: None")  # noqa: S307 — test
            fn._kw = kwargs
            setattr(cls, tail, fn)
    return out


def test_the_table_is_newest_first_with_distinct_switches_modules_and_probes():
    names = [g.name for g in gens.GENERATIONS]
    assert names == ["csa-utils", "csa-kernels", "dsa-kernels"]
    assert gens.OLDEST.switch == "apply_dsa_kernel_fusion" and gens.NEWEST.switch == "dsa_kernel_backend"
    assert len({g.fused_module for g in gens.GENERATIONS}) == 3
    assert gens.OLDEST.switch_kwargs(True) == {"apply_dsa_kernel_fusion": True}
    assert gens.NEWEST.switch_kwargs(False) == {"dsa_kernel_backend": "none"}
    rows = gens.table()
    assert [r["generation"] for r in rows] == names and all(r["probe"] for r in rows)


@pytest.mark.parametrize("generation", gens.GENERATIONS, ids=lambda g: g.name)
def test_each_generation_is_recognised_by_its_probe_alone(generation):
    modules = fake_modules(gens.COMMON + generation.needs)
    assert gens.detect(modules) is generation
    # negative control: without its fused module's LSE function no generation's probe matches this tree
    broken = fake_modules([n for n in gens.COMMON + generation.needs if n.name != generation.flash_forward])
    assert gens.detect(broken) is None
    assert generation.flash_forward in gens.refusal(broken, "T")


def test_a_tree_before_the_thd_support_is_refused_naming_the_symbol_and_the_first_thd_revision():
    thd = next(n for n in gens.COMMON if n.name == "CompressedSparseAttention._forward_thd")
    modules = fake_modules([n for n in gens.COMMON + gens.OLDEST.needs if n is not thd])
    message = gens.refusal(modules, "/x (abc)")
    assert "csa.CompressedSparseAttention._forward_thd" in message
    assert f"nearest revision it drives is {gens.OLDEST.first}" in message
    # a newer tree that renamed one of the newest generation's functions: the nearest is the newest known revision
    renamed = fake_modules([n for n in gens.COMMON + gens.NEWEST.needs if n.name != "_compressed_thd_topk_to_local"])
    assert f"nearest revision it drives is {gens.NEWEST.last}" in gens.refusal(renamed, "/x")


def test_a_missing_keyword_is_a_changed_symbol():
    need = gens.Need("kwarg", "csa", "CompressedSparseAttention.forward", "packed_seq_params")
    good = fake_modules([need])
    assert need.present(good)
    assert not need.present(fake_modules([gens.Need("attr", "csa", "CompressedSparseAttention.forward")]))
    assert "forward(packed_seq_params=...)" in str(need)


def test_the_wrapper_calls_are_read_from_the_fused_modules_source(tmp_path):
    path = tmp_path / "fusedmod.py"
    path.write_text("def f():\n    _DSA.indexer_forward_wrapper(1)\n    _DSA.new_thing_wrapper(2)\n    _DSA.x = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import fusedmod  # noqa: PLC0415
    finally:
        sys.path.remove(str(tmp_path))
    assert gens.wrapper_calls(fusedmod) == ("indexer_forward_wrapper", "new_thing_wrapper")
    from adapters.megatron import kernel_calls  # noqa: PLC0415

    assert "new_thing_wrapper" not in kernel_calls.WRAPPERS  # what providers.emulated_reason refuses


def _run_on(tree: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DSV4_MEGATRON", None)
    return subprocess.run([sys.executable, "-m", "cli", "run", "--impl", "megatron", "--megatron", str(tree),
                           "--suite", "smoke", "--case-id", "c63c8c6d34a6", "--out", str(tree.parent / "out"),
                           "--force", "--quiet", *extra], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def test_run_on_a_synthetic_checkout_older_than_the_oldest_drivable_revision_is_a_usage_error(tmp_path):
    """The whole CLI in a fresh process: exit 2 before any case, one line with the symbol and the nearest revision
    (the tree imports: the line names the one symbol left out, nothing else; the probe of the complete set passes in
    ``test_each_generation_is_recognised_by_its_probe_alone``)."""
    needs = [n for n in gens.COMMON + gens.OLDEST.needs if n.name != "CompressedSparseAttention._forward_thd"]
    old = write_tree(tmp_path / "old", needs)
    done = _run_on(old)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: Megatron-LM at ")
    assert "CompressedSparseAttention._forward_thd" in lines[0] and gens.OLDEST.first in lines[0]
    assert "it lacks csa.CompressedSparseAttention._forward_thd (closest" in lines[0]  # that symbol alone
    assert not (tmp_path / "out" / "results.jsonl").exists()  # refused up front: no case ran


# ---- recorders of the older generations: layout conversions ---------------------------------------------------------
def test_picks_of_masked_keys_read_minus_one():
    scores = torch.tensor([[[0.5, float("-inf"), 0.2]]])
    ids = torch.tensor([[[0, 1, 2]]])
    assert recorders.drop_masked(ids, scores).tolist() == [[[0, -1, 2]]]
    assert recorders.drop_masked(ids, None) is ids  # control: nothing recorded, nothing changed


def test_thd_kv_full_ids_become_segment_local_compressed_ids():
    # two segments, KV lengths 4 and 8; row 5 is in segment 1: window ids < 8, compressed ids 8 + j
    cu_q, cu_kv = torch.tensor([0, 4, 12]), torch.tensor([0, 4, 12])
    ids = torch.full((12, 3), -1)
    ids[1] = torch.tensor([0, 1, 4])  # segment 0: window 0, 1; compressed 0
    ids[5] = torch.tensor([1, 9, 8])  # segment 1: window 1; compressed 1, 0
    local = recorders.thd_kv_full_to_local(ids, cu_q, cu_kv)
    assert local[1].tolist() == [-1, -1, 0] and local[5].tolist() == [-1, 1, 0]
    assert recorders.contract_topk(local, 2)[5].tolist() == [0, 1]
    assert (local[0] == -1).all()  # control: a row without picks has none


def test_per_segment_scores_land_at_their_rows_and_a_changed_loop_is_refused():
    cu_q, cu_k = torch.tensor([0, 2, 2, 5]), torch.tensor([0, 1, 1, 3])  # segment 1 is empty: skipped by the loop
    calls = [torch.tensor([[[1.0], [2.0]]]), torch.tensor([[[3.0, 4.0], [5.0, 6.0], [7.0, float("-inf")]]])]
    out = recorders.thd_segment_scores_to_local((calls, cu_q, cu_k, 6), width=3)
    assert out[0].tolist() == [1.0, float("-inf"), float("-inf")] and out[4, :2].tolist() == [7.0, float("-inf")]
    assert torch.isneginf(out[5]).all()  # a row of no segment
    with pytest.raises(RuntimeError, match="2 top-k calls for 1 segments"):
        recorders.thd_segment_scores_to_local((calls, torch.tensor([0, 2]), torch.tensor([0, 1]), 2), width=3)


# ---- production's own exceptions ------------------------------------------------------------------------------------
def test_an_exception_is_productions_own_only_when_raised_in_its_tree(tmp_path, monkeypatch):
    from adapters import megatron
    from adapters.megatron import loader, source

    tree = tmp_path / "mg"
    (tree / "megatron").mkdir(parents=True)
    code = tree / "megatron" / "boom.py"
    code.write_text("def boom():\n    raise AssertionError('Mask dtype must match')\n")
    namespace: dict = {}
    exec(compile(code.read_text(), str(code), "exec"), namespace)  # noqa: S102 — a test file
    handle = loader.Megatron(source.MegatronSource(tree, "rev", "--megatron"), {}, gens.NEWEST)
    monkeypatch.setattr(loader, "_LOADED", handle)
    try:
        namespace["boom"]()
    except AssertionError as exc:
        assert megatron.raised_in_own_code(exc) == "megatron/boom.py:2"
    try:  # control: raised here (the adapter's or the harness's side) it is not production's
        raise AssertionError("adapter")
    except AssertionError as exc:
        assert megatron.raised_in_own_code(exc) is None
