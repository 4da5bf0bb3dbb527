"""GPU only: the persistent compiled-kernel cache on the real cuDNN DSA kernels. Three fresh processes run the same
kernel calls: without persistence (the wrappers' in-process objects), cold (compiles, exports, runs the reloaded
objects) and warm (loads every kernel, compiles none). All three must give the same outputs: bit-identical, except
where a kernel accumulates with atomics (sm90 sparse backward dkv, indexer backward dk: run-to-run fp32 rounding)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fused.kernels import compile_cache
from fused.plan import load_provider

REASON = load_provider("cudnn")[1]
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "cudnn available")
CHILD = Path(__file__).with_name("compile_cache_child.py")
REPO = Path(__file__).resolve().parents[2]


def _run(out: Path, cache: Path, persist: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUTE_DSL_CACHE", "CUDNN_FRONTEND_COMPILED"))}
    env.update({compile_cache.ENV_DIR: str(cache), compile_cache.ENV_SWITCH: "1" if persist else "0",
                "PYTHONPATH": str(REPO)})
    proc = subprocess.run([sys.executable, str(CHILD), str(out)], env=env, cwd=str(REPO), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "stats.json").read_text())
    doc["outputs"] = torch.load(out / "outputs.pt")
    return doc


def _totals(doc: dict) -> dict:
    total: dict = {}
    for row in doc["stats"].values():
        for k, v in row.items():
            total[k] = total.get(k, 0) + v
    return total


def test_reloaded_kernels_are_bit_identical_and_warm_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    plain = _run(tmp_path / "plain", tmp_path / "unused", persist=False)
    cold = _run(tmp_path / "cold", cache, persist=True)
    warm = _run(tmp_path / "warm", cache, persist=True)
    assert plain["calls"] and plain["calls"] == cold["calls"] == warm["calls"]
    c, w = _totals(cold), _totals(warm)
    assert c.get("compiled", 0) > 0 and c.get("not_persisted", 0) == 0, cold["stats"]
    assert w.get("compiled", 0) == 0 and w.get("loaded", 0) == c["compiled"] and w.get("rejected", 0) == 0, warm["stats"]
    exact = 0
    for name, t in plain["outputs"].items():
        for doc in (cold, warm):
            u = doc["outputs"][name]
            assert t.dtype == u.dtype and t.shape == u.shape, name
            if torch.equal(t, u) or (t.is_floating_point() and torch.equal(t.isnan(), u.isnan())
                                     and torch.equal(t.nan_to_num(), u.nan_to_num())):
                exact += 1
                continue
            assert t.is_floating_point() and torch.allclose(t.float(), u.float(), rtol=1e-4, atol=1e-5,
                                                            equal_nan=True), name
    assert exact >= len(plain["outputs"])  # most outputs are bit-identical (atomics aside)
    assert not list((tmp_path / "unused").rglob(compile_cache.RECORD))  # persistence off wrote nothing
