"""Production's THD context-parallel branch (``--cp N``) as the implementation under test, judged on the whole pack.

Production trains DSv4 with context parallelism over packed THD sequences: the layer (``deepseek_v4_hybrid_attention
.py``) exchanges each rank's left-boundary hidden rows (``cp_utils.exchange_cp_boundary_hidden``, ``batch_isend_
irecv``) and its core attention takes ``CompressedSparseAttention._forward_thd_cp`` (fixed-capacity compressor
input, all-gathered compressed K / KV, CP-local top-k and index lowering, the CP indexer loss, reduce-scatters in
the backward). Here that code runs with ``N`` ranks as ``N`` processes (:mod:`adapters.megatron.cp_rank`) in one
``gloo`` process group on the CPU, for the ``unfused`` and ``emulated`` providers.

**Partition** (:func:`partition`): production's CP path requires ``cp_partition_mode="contiguous"`` (its packing
scheduler's layout): the packed buffer is cut into ``N`` equal row slices, rank ``r`` holding global rows
``[r·l, (r+1)·l)``; every rank gets the *same* ``PackedSeqParams`` with the pack's global boundaries, so a ragged
segment simply straddles the ranks it crosses. Capacity padding: the buffer is padded past the case's rows to
``N·l`` rows, ``l = max(ceil(T / N), D_window)`` (production's boundary exchange needs ``l >= D_window =
max(W, 8 at r = 4, r at r = 128)``); the added rows lie past the last boundary (production's rows outside every
sequence: zero inputs, zero ``dO``) and are dropped again.

**Gathering**: each rank's output, top-k (production's per-sequence ids from ``cp_utils.compute_cp_indexer_topk``),
index scores and LSE where production has them, are concatenated back into the case's row space; the indexer loss
is the sum of the ranks' losses (each divided by the global count, as production's loss tracker all-reduces it
over the CP group); input gradients are concatenated, parameter gradients all-reduced (``SUM``) over the group as
data-parallel training reduces them. The harness then judges them against the reference on the whole pack, with
the normal rules — never against a per-rank re-implementation. The harness's leaves get the gradients through one
autograd function (:class:`_Bridge`) whose backward sends ``dO`` to the ranks.

Where: the CPU over ``gloo`` (every rank's tensors on the CPU; the CuTeDSL layout kernels' stand-ins), or CUDA over
``nccl`` with rank ``r`` alone on the ``r``-th visible GPU and the real kernels (not run on this project's machines
yet: issue 34). A BSHD case (production: "DSv4 Hybrid with CP requires qkv_format='thd'"), or a CUDA case with fewer
GPUs than ranks, is ``unsupported``: NCCL refuses two ranks of one communicator on one GPU, and gloo moves no CUDA
tensor point to point (``send`` / ``recv`` / ``all_gather`` are CPU-only for gloo, torch.distributed's backend
table), so production's unchanged collectives cannot run N ranks on one GPU.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Iterator, Mapping, Optional

import torch

from cases.config import ModelConfig
from cases.layout import PackedSeqParams
from cases.vocabulary import Unsupported

from . import recorders
from .cp_rank import AUTHKEY_ENV, recv, send
from .cp_standins import STANDINS, TE_VERSION

SIZES = (1, 2, 4, 8)
_SIZE: contextvars.ContextVar[int] = contextvars.ContextVar("megatron_cp", default=1)
#: seconds a rank may wait in a collective before gloo gives up (a peer that died), and per request
COLLECTIVE_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 900.0
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class CPUnavailable(Unsupported):
    """Production's CP branch cannot run this case here (BSHD, a CUDA case)."""


class RankError(RuntimeError):
    """A rank raised: ``RankError("rank 1: RuntimeError: ... [csa.py:2568]")``. ``remote_raised``: the rank's
    exception type (and its classes) and raising frame (``file``, ``function``, ``line``), which
    :func:`parity.deviations.known.raised` and :func:`adapters.megatron.raised_in_own_code` read instead of this process's
    traceback (None when the rank died without one)."""

    def __init__(self, message: str, remote_raised: Optional[dict] = None):
        super().__init__(message)
        self.remote_raised = remote_raised


def size() -> int:
    """The CP size of the calls in this context (1: production's normal 1-rank path)."""
    return _SIZE.get()


@contextlib.contextmanager
def use_context_parallel(n: int) -> Iterator[None]:
    """Run ``--impl megatron`` calls inside the block with ``n`` CP ranks (1: off)."""
    n = int(n)
    if n not in SIZES:
        raise ValueError(f"--cp {n}: megatron runs context parallelism with {', '.join(map(str, SIZES))} ranks")
    token = _SIZE.set(n)
    try:
        yield
    finally:
        _SIZE.reset(token)


def describe(n: int) -> dict:
    """For the run row: the CP size, backend and the CP stand-ins (names as the ranks record them)."""
    from .providers import megatron

    used = list(STANDINS)
    if not megatron().has_te:
        used.append(TE_VERSION)
    return {"size": n, "backend": "gloo", "partition": "contiguous (sequence_packing_scheduler=dp_balanced)",
            "standins": used}


# ---- the partition ----------------------------------------------------------------------------------------------------
def d_window(config: ModelConfig) -> int:
    """Production's boundary width (``exchange_cp_boundary_hidden``): ``max(W, d_comp)``, ``d_comp`` 8 at r = 4,
    r at r = 128, 0 without compression."""
    r = config.compress_ratio
    d_comp = 8 if r == 4 else (r if r > 1 else 0)
    return max(int(config.csa_window_size), d_comp)


@dataclass(frozen=True)
class Partition:
    """``size`` ranks of ``local`` rows each over a buffer of ``size·local >= rows`` (the case's ``rows``)."""

    size: int
    rows: int
    local: int

    @property
    def total(self) -> int:
        return self.size * self.local

    def span(self, rank: int) -> tuple[int, int]:
        """Global rows ``[start, stop)`` of ``rank``."""
        return rank * self.local, (rank + 1) * self.local


def layout(case) -> Optional[dict]:
    """The harness hook ``context_parallel_layout``: the partition of ``case`` at the current CP size (``size``,
    ``local`` rows per rank, the key buffer's ``d_window`` boundary rows), None at one rank."""
    n = size()
    if n == 1:
        return None
    part = partition(case.layout.total_tokens, n, case.config)
    return {"size": n, "local": part.local, "d_window": d_window(case.config)}


def partition(rows: int, n: int, config: ModelConfig) -> Partition:
    """The contiguous partition of a ``rows``-row pack over ``n`` ranks (module docstring)."""
    return Partition(n, rows, max(math.ceil(rows / n), d_window(config)))


def _slices(t: torch.Tensor, part: Partition) -> list[torch.Tensor]:
    """``t`` (``[rows, ...]``) padded with zero rows to ``part.total``, cut into the ranks' slices."""
    pad = part.total - t.shape[0]
    if pad:
        t = torch.cat((t, t.new_zeros((pad,) + tuple(t.shape[1:]))), dim=0)
    return [t[a:b].contiguous() for a, b in (part.span(r) for r in range(part.size))]


# ---- the rank pool ----------------------------------------------------------------------------------------------------
class Pool:
    """``n`` rank processes over one process group, started once per process (and CP size, device) and reused:
    ``gloo`` on the CPU, ``nccl`` on CUDA with rank ``r`` on the ``r``-th visible GPU."""

    def __init__(self, n: int, device: str = "cpu"):
        self.n, self.device = n, device
        backend = "nccl" if device == "cuda" else "gloo"
        self.dir = tempfile.mkdtemp(prefix="dsv4-cp-")
        address = os.path.join(self.dir, "socket")
        key = secrets.token_bytes(16)
        self.listener = Listener(address, family="AF_UNIX", authkey=key)
        env = dict(os.environ, **{AUTHKEY_ENV: key.hex(), "OMP_NUM_THREADS": os.environ.get("DSV4_CP_THREADS", "1")})
        env["PYTHONPATH"] = str(PROJECT_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        gpus = visible_gpus() if device == "cuda" else []
        self.logs = [os.path.join(self.dir, f"rank{r}.log") for r in range(n)]
        self.procs = []
        for r in range(n):
            rank_env = dict(env, CUDA_VISIBLE_DEVICES=gpus[r] if gpus else "")
            with open(self.logs[r], "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "adapters.megatron.cp_rank", address, str(r), str(n),
                     os.path.join(self.dir, "store"), str(COLLECTIVE_TIMEOUT_S), backend],
                    env=rank_env, cwd=str(PROJECT_ROOT), stdout=subprocess.DEVNULL, stderr=log))
        self.conns: dict[int, object] = {}
        self.standins: list[str] = []
        try:
            conns = [self.listener.accept() for _ in range(n)]
            for conn in conns:
                kind, rank, payload = self._recv(conn)
                self.conns[rank] = conn
                if kind != "ready":
                    raise RankError(f"rank {rank} did not start: {_message(payload)}")
                self.standins = payload
        except BaseException:
            self.close()
            raise

    def _recv(self, conn, timeout: float = REQUEST_TIMEOUT_S):
        if not conn.poll(timeout):
            raise RankError(f"a rank did not answer within {timeout:.0f} s")
        return recv(conn)

    def request(self, kind: str, payloads: list) -> list:
        """Send ``(kind, payload[r])`` to every rank, then collect the answers in rank order; any rank's error is
        raised (an ``Unsupported`` one as :class:`CPUnavailable`) after every rank answered or timed out."""
        for r in range(self.n):
            send(self.conns[r], (kind, payloads[r]))
        answers, errors = [None] * self.n, []
        for r in range(self.n):
            try:
                status, rank, payload = self._recv(self.conns[r])
            except (EOFError, OSError, RankError) as exc:
                errors.append((r, {"type": type(exc).__name__,
                                   "message": (str(exc) or "the rank died") + self._log_tail(r),
                                   "where": "", "unsupported": False}))
                continue
            if status == "ok":
                answers[rank] = payload
            else:
                errors.append((rank, payload))
        if errors:
            rank, info = errors[0]
            message = f"rank {rank} of {self.n}: {_message(info)}"
            if any(not e[1].get("unsupported") for e in errors) and not all(a is None for a in answers):
                self.close()  # the others may be stuck in a collective: start afresh next time
            if info.get("unsupported"):
                raise CPUnavailable(message)
            raise RankError(message, info.get("raised") if isinstance(info, dict) else None)
        return answers

    def _log_tail(self, rank: int) -> str:
        try:
            lines = Path(self.logs[rank]).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f" (its last stderr line: {lines[-1][:300]})" if lines else ""

    def alive(self) -> bool:
        return bool(self.conns) and all(p.poll() is None for p in self.procs)

    def close(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(Exception):
                send(conn, ("stop", None))
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
            if proc.poll() is None:
                proc.kill()
        for conn in self.conns.values():
            with contextlib.suppress(Exception):
                conn.close()
        self.conns = {}
        with contextlib.suppress(Exception):
            self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _message(info) -> str:
    if not isinstance(info, dict):
        return str(info)
    where = f" [{info['where']}]" if info.get("where") else ""
    return f"{info.get('type', 'Error')}: {info.get('message', '')}{where}"


_POOLS: dict[tuple, Pool] = {}


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (one per CP rank on CUDA)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def pool(n: int, device: str = "cpu") -> Pool:
    """The live pool of ``n`` ranks on ``device`` (started on first use, restarted after a broken run)."""
    found = _POOLS.get((n, device))
    if found is None or not found.alive():
        if found is not None:
            found.close()
        _POOLS[(n, device)] = found = Pool(n, device)
    return found


@atexit.register
def _close_pools() -> None:
    for p in list(_POOLS.values()):
        p.close()
    _POOLS.clear()


# ---- one call -------------------------------------------------------------------------------------------------------
class _Call:
    """One production call at CP ``n``: the forward request, then (through :class:`_Bridge`) the backward."""

    def __init__(self, scope: str, names: list[str], n_inputs: int, config: ModelConfig, provider: str,
                 training: bool, packed: PackedSeqParams, rows: int, device: torch.device):
        self.scope, self.names, self.n_inputs = scope, names, n_inputs
        self.config, self.provider, self.training = config, provider, training
        self.part = partition(rows, size(), config)
        self.psp = {"cu_seqlens": [int(v) for v in packed.cu_seqlens_q.tolist()],
                    "cu_seqlens_padded": [int(v) for v in packed.cu_seqlens_q_padded.tolist()],
                    "max_seqlen": int(packed.max_seqlen_q)}
        self.device = device
        self.pool = pool(self.part.size, device.type)
        self.records: list[dict] = []

    def forward(self, leaves: tuple) -> torch.Tensor:
        inputs = dict(zip(self.names[:self.n_inputs], leaves[:self.n_inputs]))
        params = {n: t.detach() for n, t in zip(self.names[self.n_inputs:], leaves[self.n_inputs:])}
        params = {n: t.cpu() for n, t in params.items()}
        per_rank = {n: _slices(t.detach().cpu(), self.part) for n, t in inputs.items()}
        payloads = [{"scope": self.scope, "config": self.config.to_dict(), "provider": self.provider,
                     "training": self.training, "psp": self.psp, "params": params,
                     "inputs": {n: s[r] for n, s in per_rank.items()}} for r in range(self.part.size)]
        answers = self.pool.request("forward", payloads)
        self.records = [{k: v.to(self.device) for k, v in a["record"].items()} for a in answers]
        return torch.cat([a["out"] for a in answers], dim=0)[:self.part.rows].to(self.device)

    def backward(self, grad_out: torch.Tensor) -> tuple:
        slices = _slices(grad_out.detach().cpu(), self.part)
        answers = self.pool.request("backward", [{"grad_out": s} for s in slices])
        grads = []
        for name in self.names[:self.n_inputs]:
            parts = [a["inputs"].get(name) for a in answers]
            if all(p is None for p in parts):
                grads.append(None)
                continue
            like = next(p for p in parts if p is not None)
            full = torch.cat([torch.zeros_like(like) if p is None else p for p in parts], dim=0)
            grads.append(full[:self.part.rows].to(self.device))
        reduced = answers[0]["params"]
        grads += [None if reduced[name] is None else reduced[name].to(self.device)
                  for name in self.names[self.n_inputs:]]
        return tuple(grads)

    # ---- gathered forward tensors (layout only: concatenation, per-sequence ids -> the contract's form) ---------
    def gathered(self, name: str) -> Optional[torch.Tensor]:
        parts = [r.get(name) for r in self.records]
        if any(p is None for p in parts):
            return None
        return torch.cat(parts, dim=0)[:self.part.rows]

    def loss(self) -> Optional[torch.Tensor]:
        parts = [r.get("loss") for r in self.records]
        if any(p is None for p in parts):
            return None
        total = parts[0].detach().clone()
        for p in parts[1:]:
            total = total + p
        return total


class _Bridge(torch.autograd.Function):
    """``out = production at CP n (leaves)``: the harness's leaves in, the gathered output out; the backward sends
    ``dO`` to the ranks and returns their gathered / reduced gradients."""

    @staticmethod
    def forward(ctx, call: _Call, *leaves):
        ctx.call = call
        return call.forward(leaves)

    @staticmethod
    def backward(ctx, grad_out):
        return (None, *ctx.call.backward(grad_out))


def _check(packed: Optional[PackedSeqParams], like: torch.Tensor) -> None:
    if packed is None:
        raise CPUnavailable("production's context parallelism needs a THD pack (deepseek_v4_hybrid_attention.py: "
                            "\"DSv4 Hybrid with CP requires qkv_format='thd'\")")
    if like.device.type == "cuda" and len(visible_gpus()) < size():
        raise CPUnavailable(f"--cp {size()} on CUDA runs one rank per GPU over NCCL (which refuses two ranks of one "
                            f"communicator on one GPU); {len(visible_gpus())} visible")
    if like.device.type not in ("cpu", "cuda"):
        raise CPUnavailable(f"--cp runs its ranks on the CPU (gloo) or on GPUs (nccl), not on {like.device.type}")


def run(scope: str, inputs: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], config: ModelConfig,
        packed: Optional[PackedSeqParams], training: bool, provider: str):
    """Production at the current CP size on ``inputs`` (``{"hidden"}`` or ``{"query", "kv", "hidden",
    "q_latent"}``); returns ``(out, call)`` — ``out`` differentiable in every input and parameter."""
    like = next(iter(inputs.values()))
    _check(packed, like)
    names = list(inputs) + list(params)
    call = _Call(scope, names, len(inputs), config, provider, training, packed, like.shape[0], like.device)
    out = _Bridge.apply(call, *inputs.values(), *params.values())
    return out, call


def compressed_offsets(packed: PackedSeqParams, ratio: int, rows: int) -> torch.Tensor:
    """Per row of the pack, the sequence-major index of its sequence's first compressed row (``cu_seqlens_compressed
    [seq]``, segments by their padded boundaries; a row past the last boundary takes the last segment's)."""
    padded = packed.cu_seqlens_q_padded.to(torch.int64)
    comp = torch.cat((padded.new_zeros(1), torch.cumsum((padded[1:] - padded[:-1]) // ratio, 0)))
    seq = torch.bucketize(torch.arange(rows, dtype=torch.int64), padded[1:], right=True)
    return comp[seq.clamp_max(max(padded.shape[0] - 2, 0))]


def output(call: _Call, out: torch.Tensor, config: ModelConfig, packed: PackedSeqParams):
    """The :class:`~adapters.megatron.layer.MegatronOutput` of a CP call (``topk`` in the contract's form)."""
    from .layer import MegatronOutput

    not_provided = {}
    lse = call.gathered("lse")
    if lse is not None:
        lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
    else:
        not_provided["lse"] = "production's unfused attention (unfused_compressed_sparse_attn) computes no LSE"
    topk = scores = None
    if config.has_indexer:
        ids = call.gathered("cp_topk")
        topk = None if ids is None else recorders.contract_topk(ids, config.dsa_indexer_topk)
        width = int(packed.max_seqlen_q) // config.compress_ratio
        scores = call.gathered("fused_scores")
        if scores is not None and scores.shape[-1] != width:
            scores = None
        if scores is None and call.gathered("cp_scores") is not None:  # unfused: by sequence-major row -> local id
            scores = recorders.thd_scores_to_local(call.gathered("cp_scores").unsqueeze(0),
                                                   compressed_offsets(packed, config.compress_ratio,
                                                                      call.part.rows), width)
        if scores is None and topk is not None:
            not_provided["index_scores"] = ("production's CP top-k (cp_utils.compute_cp_indexer_topk) returns the "
                                            "selection only")
    loss = call.loss()
    wide = torch.float64 if out.dtype == torch.float64 else torch.float32
    lse, scores, loss = (None if t is None else t.to(wide) for t in (lse, scores, loss))
    return MegatronOutput(out=out, lse=lse, indexer_loss=loss, topk_indices=topk, index_scores=scores,
                          not_provided=not_provided)
