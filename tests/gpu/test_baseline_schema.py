"""The committed H200 baseline (``reports/baselines/h200/``) has the documented shape — its schema, never its numbers.

``gate/`` is a parity run's baseline (``metrics.csv`` + ``env.json``, read by ``reports.baselines``); ``kernels/``
holds the kernel-level parity table, the per-stage timings and the environment of ``python -m parity.kernel_checks``
(formerly ``fused.gpu_checks``), and the CUDA-graph replay report of the former ``fused.graph_replay`` (now the
``graph-replay`` oracle, whose results are ordinary oracle rows; the committed report stays as the measured basis of
policy ``kernels.graph_replay``).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from reports.baselines import BASELINES_ROOT, load_baseline
from cases.vocabulary import OUTCOMES
from reports.schema import CSV_COLUMNS

H200 = BASELINES_ROOT / "h200"
ENV_KEYS = ("gpu", "driver", "torch", "cuda", "cudnn", "cudnn_frontend", "flash_mla")
PARITY_COLUMNS = ("stage", "call", "provider", "tensor", "outcome", "message", "n", "max_abs", "max_rel", "rel_l2",
                  "cosine", "mixed", "nan")
TIMING_COLUMNS = ("stage", "call", "provider", "first_call_s", "kernel_ms", "torch_ms", "capture")
STAGES = ("indexer_forward", "indexer_top_k", "compactify", "sparse_attn_fwd", "sparse_attn_bwd",
          "sparse_attn_score_recompute", "sparse_indexer_score_recompute", "dense_attn_score_recompute",
          "dense_indexer_score_recompute", "indexer_backward", "dense_indexer_backward")


def kernel_baseline_problems(root: Path) -> list[str]:
    """Schema problems of a ``kernels/`` baseline directory (empty list: valid)."""
    problems = []
    for name, columns in (("kernel_parity.csv", PARITY_COLUMNS), ("kernel_timings.csv", TIMING_COLUMNS)):
        path = root / name
        if not path.is_file():
            problems.append(f"{name} missing")
            continue
        with path.open() as fh:
            rows = list(csv.DictReader(fh))
        missing = [c for c in columns if not rows or c not in rows[0]]
        if missing:
            problems.append(f"{name} lacks columns {missing}")
            continue
        unknown = sorted({r["stage"] for r in rows} - set(STAGES))
        if unknown:
            problems.append(f"{name} has unknown stages {unknown}")
        if name == "kernel_parity.csv":
            bad = sorted({r["outcome"] for r in rows} - set(OUTCOMES))
            if bad:
                problems.append(f"{name} has unknown outcomes {bad}")
            absent = sorted(set(STAGES) - {r["stage"] for r in rows})
            if absent:
                problems.append(f"{name} covers no call of {absent}")
    env = json.loads((root / "kernel_env.json").read_text()) if (root / "kernel_env.json").is_file() else {}
    for key in ENV_KEYS + ("cudnn_backend",):
        if key not in env:
            problems.append(f"kernel_env.json lacks {key!r}")
    graph = json.loads((root / "graph_replay.json").read_text()) if (root / "graph_replay.json").is_file() else None
    if not isinstance(graph, list) or not graph:
        problems.append("graph_replay.json must be a non-empty list of reports")
    else:
        for rep in graph:
            for key in ("ratio", "scope", "capture", "plan", "packings", "passed"):
                if key not in rep:
                    problems.append(f"graph_replay.json report lacks {key!r}")
            packings = rep.get("packings", [])
            if len(packings) < 4:
                problems.append("graph_replay.json needs the capture packing and at least 3 re-packings")
            for p in packings:
                if not {"cu_seqlens", "cu_seqlens_padded", "matches_eager", "tensors"} <= set(p):
                    problems.append(f"graph_replay.json packing entry lacks fields: {sorted(p)}")
    return problems


def test_gate_baseline_loads_with_the_csv_schema():
    base = load_baseline("h200/gate")
    assert tuple(base.table.columns[: len(CSV_COLUMNS)]) == CSV_COLUMNS
    assert set(base.table["outcome"]) <= set(OUTCOMES)
    assert base.env["arch"] == "h200" and set(OUTCOMES) - {"known"} <= set(base.env["counts"]) <= set(OUTCOMES)
    for key in ENV_KEYS:
        assert key in base.env["env"], key
    assert base.env["suite"] == "gate" and isinstance(base.env["complete"], bool)


def test_kernel_baseline_schema():
    assert kernel_baseline_problems(H200 / "kernels") == []


@pytest.mark.parametrize("corrupt", ["drop_column", "drop_env_key", "short_replay"])
def test_kernel_baseline_schema_check_catches_corruption(tmp_path, corrupt):
    root = tmp_path / "kernels"
    shutil.copytree(H200 / "kernels", root)
    if corrupt == "drop_column":
        lines = (root / "kernel_parity.csv").read_text().splitlines()
        (root / "kernel_parity.csv").write_text("\n".join(line.replace("rel_l2", "relL2", 1) if i == 0 else line
                                                          for i, line in enumerate(lines)) + "\n")
    elif corrupt == "drop_env_key":
        env = json.loads((root / "kernel_env.json").read_text())
        env.pop("flash_mla")
        (root / "kernel_env.json").write_text(json.dumps(env))
    else:
        reps = json.loads((root / "graph_replay.json").read_text())
        reps[0]["packings"] = reps[0]["packings"][:2]
        (root / "graph_replay.json").write_text(json.dumps(reps))
    assert kernel_baseline_problems(root)
