"""Padding invariance (spec §6.4, §6.5 invariant 3; ARCHITECTURE.md "Padding rows").

A THD batch with alignment padding inside segments, a dummy tail segment, zero-length segments, slack rows and a
compressed capacity above the true count is run twice: once as materialised, once with every non-real input row
multiplied by a huge factor (``materialize(..., padding_scale=)``) and the unused compressed capacity slots filled
with huge random values. Real-row outputs, the loss and every gradient must be bit-identical, and the gradients of
padding rows exactly zero.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from reference import attention_layer, core_attention

from .helpers import case_of, materialized, run_with_grads, thd_layout, tiny_config

POISON = 1e6
thd = importlib.import_module("reference.thd")

LAYOUTS = {
    # real / padded lengths: tail padding, a zero-length segment, a dummy (all-padding) segment, slack and capacity
    4: dict(real=[6, 0, 13, 3, 0, 0], padded=[8, 0, 16, 4, 8, 0], slack=3, capacity=12),
    0: dict(real=[6, 0, 13, 3, 0, 0], padded=[8, 0, 16, 4, 8, 0], slack=3, capacity=None),
    128: dict(real=[130, 5, 0], padded=[256, 8, 128], slack=2, capacity=5),
}
CONFIGS = {"r0": tiny_config(0), "r4_sparse": tiny_config(4), "r4_dense": tiny_config(4, sparse=False),
           "r128": tiny_config(128)}


def huge_capacity_fill(rows, like):
    g = torch.Generator().manual_seed(7)
    return (POISON * torch.randn((rows,) + tuple(like.shape[1:]), generator=g, dtype=torch.float64)).to(like)


def run(case, scale, monkeypatch):
    impl = attention_layer if case.scope == "layer" else core_attention
    with monkeypatch.context() as m:
        if scale != 1.0:
            m.setattr(thd, "capacity_fill", huge_capacity_fill)
        tensors = materialized(case, padding_scale=scale)
        return run_with_grads(impl, case, tensors), tensors


def violations(clean, poisoned, tensors):
    """Differences between the clean and the poisoned run on real rows, and nonzero padding-row gradients."""
    real = tensors.real_rows
    bad = []
    for key in ("out", "lse"):
        if not torch.equal(clean[key][real], poisoned[key][real]):
            bad.append(f"{key} differs on real rows")
    if "loss" in clean and not torch.equal(clean["loss"], poisoned["loss"]):
        bad.append("loss differs")
    for key in clean:
        if not key.startswith("grad/"):
            continue
        name = key.split("/", 1)[1]
        if name in tensors.inputs:
            if not torch.equal(clean[key][real], poisoned[key][real]):
                bad.append(f"{key} differs on real rows")
            for label, run_ in (("clean", clean), ("poisoned", poisoned)):
                if bool((run_[key][~real] != 0).any()):
                    bad.append(f"{key} nonzero on padding rows ({label})")
        elif not torch.equal(clean[key], poisoned[key]):
            bad.append(f"{key} differs")
    return bad


@pytest.mark.parametrize("scope", ["layer", "core"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_padding_rows_and_capacity_slots_change_nothing_real(name, scope, monkeypatch):
    config = CONFIGS[name]
    case = case_of(config, thd_layout(**LAYOUTS[config.compress_ratio]), scope=scope)
    clean, tensors = run(case, 1.0, monkeypatch)
    poisoned, _ = run(case, POISON, monkeypatch)
    assert not violations(clean, poisoned, tensors)
    assert bool(torch.isfinite(poisoned["out"]).all())
    if "loss" in clean:  # the mean divides by the real rows only
        assert case.layout.num_real_rows < case.layout.num_tokens


@pytest.mark.parametrize("name", ["r4_sparse", "r128"])
def test_negative_control_poisoned_real_row_is_detected(name, monkeypatch):
    config = CONFIGS[name]
    case = case_of(config, thd_layout(**LAYOUTS[config.compress_ratio]), scope="core")
    clean, tensors = run(case, 1.0, monkeypatch)
    poisoned, _ = run(case, POISON, monkeypatch)
    bad_case_tensors = materialized(case, padding_scale=POISON)
    row = case.layout.cu_seqlens[1] - 1  # the last real token of segment 0, followed by padding
    assert bool(tensors.real_rows[row]) and not bool(tensors.real_rows[row + 1])
    with torch.no_grad():  # the same poison, but also on that real row
        for v in bad_case_tensors.inputs.values():
            v[row] *= 3.0
    with monkeypatch.context() as m:
        m.setattr(thd, "capacity_fill", huge_capacity_fill)
        poisoned_real = run_with_grads(core_attention, case, bad_case_tensors)
    assert not violations(clean, poisoned, tensors)
    assert violations(clean, poisoned_real, tensors)


def test_negative_control_unmasked_padding_rows_get_gradients(monkeypatch):
    """Declaring the padding rows real (cu_seqlens = cu_seqlens_padded) lets their dO reach the inputs: the
    zero-gradient check must then fail, showing it is not vacuous."""
    config = CONFIGS["r4_sparse"]
    spec = LAYOUTS[4]
    case = case_of(config, thd_layout(**spec), scope="core")
    tensors = materialized(case)
    as_real = case_of(config, thd_layout(spec["padded"], spec["padded"], slack=spec["slack"],
                                         capacity=spec["capacity"]), scope="core")
    leaked = run_with_grads(core_attention, as_real, materialized(as_real))
    padding = ~tensors.real_rows
    padding[case.layout.cu_seqlens_padded[-1]:] = False  # slack rows stay slack in both layouts
    assert bool((leaked["grad/query"][padding] != 0).any())
