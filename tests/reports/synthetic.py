"""Synthetic ``results.jsonl`` streams (and ``mutants.jsonl``) for the report tests (a test fixture, not a view).

The rows follow the schema of ``ARCHITECTURE.md`` and look like a real layer-scope parity run: case JSON objects in
:class:`cases.Case` form (built here as plain dicts so the report layer stays free of torch), the tensors a case of
that ratio / scope / mode produces, and the metric set of the layered verdict.

Every number is a deterministic function of ``(case_id, tensor)``, so two streams generated with the same arguments
are identical and ``scale`` plants an exact error growth: ``scale={"grad_param": 3.0}`` multiplies every error
metric (``max_abs``, ``max_rel``, ``rmse``, ``rel_l2``, ``noise_floor_ratio``) of that tensor class (or tensor name)
by 3 while the reference's own ``ref_error`` stays put. The thresholds are wide enough that a 3x growth still passes
its absolute tolerance: only the drift gate can see it.

    python -m tests.reports.synthetic OUT_DIR --cases 1000 [--scale grad_param=3] [--mutants]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

from reports.schema import DTYPE_EPS

#: A few production parameter names per ratio (spec §1.2) — enough to give grad_param a realistic spread.
LAYER_PARAMS = ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
                "linear_kv_proj.weight", "kv_layernorm.weight", "linear_o_group_proj", "linear_proj.weight")
COMPRESSOR_PARAMS = ("core_attention.compressor.linear_wkv.weight", "core_attention.compressor.linear_wgate.weight",
                     "core_attention.compressor.ape", "core_attention.compressor.norm.weight")
INDEXER_PARAMS = ("core_attention.indexer.linear_wq_b.weight", "core_attention.indexer.linear_weights_proj.weight",
                  "core_attention.indexer.compressor.linear_wkv.weight", "core_attention.indexer.compressor.ape")
ENV = {"python": "3.11.7", "torch": "2.13.0+cpu", "cuda": None, "cudnn": None, "cudnn_frontend": None,
       "flash_mla": None, "gpu": None, "driver": None, "git_rev": "0000000", "host": "synthetic"}
NFR_THRESHOLD = 6.0
MAX_REL_ULPS = 256.0
SIM_FLOOR = 0.99
MUTANTS = ("cu_seqlens_off_by_one", "global_rope", "sink_dropped", "teacher_without_window", "scatter_minus_one",
           "unzeroed_padding", "topk_tie_upper_index", "lse_base2")


def _unit(*key: object) -> float:
    """A deterministic uniform number in [0, 1) from a key."""
    digest = hashlib.sha256("/".join(str(k) for k in key).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0 ** 64


def _case(index: int, seed: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}/{index}")
    ratio = rng.choice((0, 4, 4, 128))
    dtype = rng.choice(("float64", "float32", "bfloat16", "bfloat16"))
    config = {"hidden_size": 64, "num_attention_heads": 4, "v_head_dim": 64, "qk_pos_emb_head_dim": 16,
              "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "compress_ratio": ratio,
              "csa_window_size": rng.choice((4, 8, 16)), "dsa_indexer_n_heads": 4, "dsa_indexer_head_dim": 32,
              "dsa_indexer_topk": rng.choice((2, 4, 8)), "dsa_indexer_use_sparse_loss": rng.random() < 0.6,
              "calculate_per_token_loss": rng.random() < 0.3}
    if rng.random() < 0.5:
        layout = {"kind": "bshd", "batch": rng.choice((1, 2)), "seq_len": rng.choice((16, 32, 64))}
    else:
        lengths = [rng.choice((0, 3, 16, 17, 40)) for _ in range(rng.randint(1, 5))]
        pads = [rng.choice((0, 0, 4)) for _ in lengths]
        real, padded = [0], [0]
        for length, pad in zip(lengths, pads):
            real.append(real[-1] + length)
            padded.append(padded[-1] + length + pad)
        layout = {"kind": "thd", "cu_seqlens": real, "cu_seqlens_padded": padded,
                  "total_tokens": padded[-1] + rng.choice((0, 0, 8)) or 8, "compressed_capacity": None}
    return {"config": config, "layout": layout, "dtype": dtype, "training": rng.random() < 0.75,
            "scope": rng.choice(("layer", "layer", "core")), "seed": index, "device": "any", "profile": "tiny",
            "tags": ["synthetic"]}


def case_id(case: Mapping[str, Any]) -> str:
    """Same rule as ``cases.Case.id``: sha256 of the canonical JSON without ``tags``, 12 hex digits."""
    data = {k: v for k, v in case.items() if k != "tags"}
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


def _features(case: Mapping[str, Any]) -> dict[str, Any]:
    layout, config = case["layout"], case["config"]
    has_loss = case["training"] and config["compress_ratio"] == 4
    features = {"layout": layout["kind"], "ratio": config["compress_ratio"], "dtype": case["dtype"],
                "scope": case["scope"], "training": case["training"],
                "loss": ("sparse" if config["dsa_indexer_use_sparse_loss"] else "dense") if has_loss else "none"}
    if layout["kind"] == "thd":
        real = [b - a for a, b in zip(layout["cu_seqlens"], layout["cu_seqlens"][1:])]
        padded = [b - a for a, b in zip(layout["cu_seqlens_padded"], layout["cu_seqlens_padded"][1:])]
        features.update(segments=len(real), zero_length=0 in real,
                        alignment_padding=real != padded, slack=layout["total_tokens"] > layout["cu_seqlens_padded"][-1])
    return features


def _tensors(case: Mapping[str, Any]) -> list[tuple[str, str, str, list[int]]]:
    """``(name, class, dtype, shape)`` of every tensor the case compares."""
    ratio, dtype = case["config"]["compress_ratio"], case["dtype"]
    wide = "float32" if dtype == "bfloat16" else dtype
    rows = 32 if case["layout"]["kind"] == "bshd" else case["layout"]["total_tokens"]
    found = [("out", "out", dtype, [rows, 4, 64]), ("lse", "lse", wide, [rows, 4])]
    if ratio == 4:
        found += [("index_scores", "index_scores", wide, [rows, rows // 4]),
                  ("topk_indices", "topk", "int32", [rows, case["config"]["dsa_indexer_topk"]])]
        if case["training"]:
            found.append(("indexer_loss", "loss", wide, []))
    if not case["training"]:
        return found
    inputs = ("hidden",) if case["scope"] == "layer" else ("query", "kv", "hidden", "q_latent")
    found += [(f"grad/{name}", "grad_input", dtype, [rows, 64]) for name in inputs]
    params = ["core_attention.attn_sink"] + (list(LAYER_PARAMS) if case["scope"] == "layer" else [])
    params += list(COMPRESSOR_PARAMS) if ratio > 1 else []
    params += list(INDEXER_PARAMS) if ratio == 4 else []
    for name in params:
        keep32 = name.endswith(("attn_sink", ".ape"))
        found.append((f"grad/{name}", "grad_param", "float32" if keep32 and dtype == "bfloat16" else dtype, [64]))
    return found


def _metric_rows(cid: str, tensor: str, klass: str, dtype: str, growth: float, fail: bool) -> list[dict[str, Any]]:
    if dtype.startswith("int"):
        mismatch = 1.0 if fail else 0.0
        return [_metric(cid, tensor, klass, "set_mismatch", mismatch, 0.0),
                _metric(cid, tensor, klass, "tied_rows", float(int(8 * _unit(cid, tensor, "tied"))), None)]
    eps = DTYPE_EPS[dtype]
    err = eps * 2.0 ** (4.0 * _unit(cid, tensor, "err"))           # 1..16 ulp of the tensor's dtype
    ref = err * (1.0 + _unit(cid, tensor, "ref"))                 # the reference's own low-precision error
    err *= growth
    if fail:
        err = ref * NFR_THRESHOLD * (1.5 + 8.0 * _unit(cid, tensor, "fail"))
    rel_l2 = 0.1 * err
    values = {"max_abs": err * (1.0 + 3.0 * _unit(cid, tensor, "abs")), "max_rel": err, "rmse": 0.15 * err,
              "rel_l2": rel_l2, "cosine": 1.0 - rel_l2 ** 2 / 2.0, "tensor_sim": 1.0 - rel_l2 ** 2,
              "nan": 0.0, "inf": 0.0, "frac_outside": 0.02 if fail else 0.0, "noise_floor_ratio": err / ref,
              "ref_error": ref}
    thresholds = {"max_rel": MAX_REL_ULPS * eps, "cosine": SIM_FLOOR, "tensor_sim": SIM_FLOOR, "nan": 0.0,
                  "inf": 0.0, "noise_floor_ratio": NFR_THRESHOLD}
    return [_metric(cid, tensor, klass, name, value, thresholds.get(name)) for name, value in values.items()]


def _metric(cid: str, tensor: str, klass: str, name: str, value: float, threshold: float | None) -> dict[str, Any]:
    if threshold is None:
        passed = None
    elif name in ("cosine", "tensor_sim"):
        passed = value >= threshold
    else:
        passed = value <= threshold
    return {"type": "metric", "case_id": cid, "tensor": tensor, "tensor_class": klass, "metric": name,
            "value": value, "threshold": threshold, "passed": passed}


def synthetic_rows(n_cases: int = 40, *, seed: int = 0, run_id: str = "synthetic", scale: Mapping[str, float] = {},
                   fail_every: int = 13, error_every: int = 29, unsupported_every: int = 31,
                   complete: bool = True, suite: str = "smoke") -> Iterator[dict[str, Any]]:
    """The rows of one synthetic run, in stream order (``run``, per case tensors / metrics then ``case``, ``end``).

    Case ``i`` fails when ``i % fail_every == fail_every - 1`` (one tensor far outside its noise-floor ratio), errors
    when ``i % error_every == error_every - 1``, is unsupported when ``i % unsupported_every == ...``; 0 disables.
    """
    yield {"type": "run", "run_id": run_id, "suite": suite, "impl": "fused", "against": "reference",
           "provider": "auto", "started": "2025-01-01T00:00:00+00:00", "argv": ["dsv4-parity", "run"], "env": ENV}
    counts = {"pass": 0, "fail": 0, "error": 0, "unsupported": 0}

    def hit(i: int, every: int) -> bool:
        return every > 0 and i % every == every - 1

    for i in range(n_cases):
        case = _case(i, seed)
        cid = case_id(case)
        canonical = json.dumps(case, sort_keys=True, separators=(",", ":"))
        row = {"type": "case", "case_id": cid, "case": case, "duration_s": 0.05 + _unit(cid, "t"),
               "repro": f"dsv4-parity run --case {shlex.quote(canonical)}", "features": _features(case),
               "plan": {"attention": "reference", "indexer": "reference", "compressor": "reference"},
               "topk": None, "first_failure": None, "message": "", "decided_by": "noise_floor_ratio"}
        if case["config"]["compress_ratio"] == 4:
            tied = int(4 * _unit(cid, "tied"))
            row["topk"] = {"clear": 32 - tied, "tied": tied, "rows": 32}
        if hit(i, error_every):
            row.update(outcome="error", decided_by="exception", message="RuntimeError: CUDA error: an illegal "
                       "memory access was encountered (synthetic)")
        elif hit(i, unsupported_every):
            row.update(outcome="unsupported", decided_by="provider", message="no provider for this case on cpu")
        else:
            tensors = _tensors(case)
            failing = tensors[int(_unit(cid, "which") * len(tensors))][0] if hit(i, fail_every) else None
            for name, klass, dtype, shape in tensors:
                growth = scale.get(name, scale.get(klass, 1.0))
                fail = name == failing
                rule = "exact" if dtype.startswith("int") else "noise_floor_ratio"
                yield {"type": "tensor", "case_id": cid, "tensor": name, "tensor_class": klass, "dtype": dtype,
                       "shape": shape, "verdict": "fail" if fail else "pass", "rule": rule}
                yield from _metric_rows(cid, name, klass, dtype, growth, fail)
            if failing is None:
                row["outcome"] = "pass"
            else:
                rule = "exact" if failing == "topk_indices" else "noise_floor_ratio"
                row.update(outcome="fail", decided_by=rule, first_failure={
                    "tensor": failing, "rule": rule, "message": f"{failing}: {rule} outside tolerance (synthetic)"},
                    message=f"{failing} failed {rule}")
        counts[row["outcome"]] += 1
        yield row
    if complete:
        yield {"type": "end", "counts": counts, "duration_s": float(n_cases) * 0.5}


def mutant_rows(seed: int = 0) -> Iterator[dict[str, Any]]:
    """A ``mutants.jsonl`` body: most mutants killed (several times), one survivor, one unreachable."""
    checks = [("out", "noise_floor_ratio"), ("lse", "max_rel"), ("grad/hidden", "noise_floor_ratio"),
              ("grad/core_attention.attn_sink", "ulp"), ("topk_indices", "exact"), ("indexer_loss", "max_rel")]
    for k, mutant in enumerate(MUTANTS):
        if mutant == "lse_base2":
            yield {"mutant": mutant, "status": "survived", "case_id": None, "tensor": None, "check": None}
            continue
        if mutant == "topk_tie_upper_index":
            yield {"mutant": mutant, "status": "unreachable", "case_id": None, "tensor": None, "check": None}
            continue
        for j in range(1 + k % 3):
            tensor, check = checks[(k + j) % len(checks)]
            cid = hashlib.sha256(f"{seed}/{mutant}/{j}".encode()).hexdigest()[:12]
            yield {"mutant": mutant, "status": "killed", "case_id": cid, "tensor": tensor, "check": check}


def write_jsonl(rows: Iterator[Mapping[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, separators=(",", ":")) + "\n")
    return path


def write_synthetic_run(directory: str | Path, n_cases: int = 40, *, mutants: bool = False, **kwargs: Any) -> Path:
    """Write ``results.jsonl`` (and ``mutants.jsonl`` if asked) into ``directory``; returns the directory."""
    directory = Path(directory)
    write_jsonl(synthetic_rows(n_cases, **kwargs), directory / "results.jsonl")
    if mutants:
        write_jsonl(mutant_rows(kwargs.get("seed", 0)), directory / "mutants.jsonl")
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reports.synthetic", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="run directory to write")
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--scale", action="append", default=[], metavar="CLASS=FACTOR",
                        help="plant an error growth in a tensor class or tensor (repeatable)")
    parser.add_argument("--mutants", action="store_true", help="also write mutants.jsonl")
    args = parser.parse_args(argv)
    scale = {}
    for item in args.scale:
        name, _, factor = item.partition("=")
        try:
            scale[name] = float(factor)
        except ValueError:
            parser.error(f"--scale {item!r}: expected CLASS=FACTOR, e.g. grad_param=3")
    run_id = args.run_id or Path(args.out).name
    write_synthetic_run(args.out, args.cases, seed=args.seed, run_id=run_id, scale=scale, mutants=args.mutants)
    print(Path(args.out) / "results.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
