"""One rank of production's THD context-parallel run: a process of its own (``python -m adapters.megatron.cp_rank``),
started by :mod:`adapters.megatron.cp` and driven over a local socket.

At start the rank joins a process group of ``N`` ranks (a ``FileStore`` in the pool's private directory; ``gloo`` on
the CPU, ``nccl`` with one GPU per rank, its ``CUDA_VISIBLE_DEVICES`` set by the pool; tensors travel as CPU copies),
makes it production's CP group (``pg_collection.cp``; ``tp`` is a 1-rank group of its own), installs the CP
stand-ins (:mod:`adapters.megatron.cp_standins`) and answers ``ready``. Then, per request:

* ``forward`` — production's layer (or its core attention) on this rank's rows ``[rank·l_local, (rank+1)·l_local)``
  of the pack, with production's per-rank ``PackedSeqParams`` (the **global** boundaries, ``cp_partition_mode=
  "contiguous"``, as production's packing scheduler hands them to every rank), in the case's provider context, with
  the parameters as ``functional_call`` leaves. Answers this rank's output rows and what the recorders saw (top-k,
  scores, LSE, loss). The autograd graph and the provider context stay open for the backward.
* ``backward`` — this rank's ``dO`` rows through production's backward (boundary-exchange and reduce-scatter
  collectives run between the ranks inside it); every parameter gradient is all-reduced (``SUM``) over the group, as
  data-parallel training reduces them, with a flag saying whether *any* rank produced it (autograd's ``None`` on
  every rank stays ``None``). Answers this rank's input-gradient rows and the reduced parameter gradients.
* ``stop``.

At core scope the rank also supplies what production's layer hands its core attention under CP: the left-boundary
rows of ``hidden`` and of the roped ``kv``, both through production's own boundary exchange
(``cp_utils.exchange_cp_boundary_hidden``, whose backward returns their gradients to the owning rank).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import traceback
from typing import Optional

import torch

AUTHKEY_ENV = "DSV4_CP_AUTHKEY"


def send(conn, obj) -> None:
    """Send ``obj`` by value (plain pickle: torch's multiprocessing reductions would pass shared-memory handles,
    which need a ``multiprocessing``-spawned peer)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


class Parallel:
    """What :data:`adapters.megatron.build.PARALLEL` holds in a rank process."""

    def __init__(self, tp, cp, size: int):
        self.tp, self.cp, self.size = tp, cp, size

    def config_fields(self) -> dict:
        """Production's CP config, as its own CP tests build it (``test_dsv4_hybrid_attention_cp.py``)."""
        return {"context_parallel_size": self.size, "cp_partition_mode": "contiguous",
                "sequence_packing_scheduler": "dp_balanced"}

    def config_context(self, mg):
        from .cp_standins import te_version_satisfied

        return te_version_satisfied(mg, not mg.has_te)


class Rank:
    """The rank's state between a forward and its backward."""

    def __init__(self, rank: int, size: int, backend: str = "gloo"):
        self.rank, self.size, self.backend = rank, size, backend
        #: where production's tensors live: the CPU for gloo; for nccl the one GPU this process sees
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.stack: Optional[contextlib.ExitStack] = None
        self.pending: Optional[dict] = None
        self.standins: list[str] = []

    # ---- setup ------------------------------------------------------------------------------------------------
    def start(self, store_path: str, timeout_s: float) -> None:
        import torch.distributed as dist

        from . import build, cp_standins
        from .providers import megatron

        store = dist.FileStore(store_path, self.size)
        if self.device == "cuda":
            torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES names this rank's GPU
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        singles = [dist.new_group([r], backend=self.backend) for r in range(self.size)]
        build.PARALLEL = Parallel(singles[self.rank], dist.group.WORLD, self.size)
        mg = megatron()
        cp_standins.install(mg, self.standins)

    # ---- requests ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack, self.pending = None, None

    def forward(self, req: dict) -> dict:
        from cases.config import ModelConfig

        from . import providers, recorders
        from .layer import CORE_PREFIX

        self.close()
        config = ModelConfig.from_dict(req["config"])
        provider = req["provider"]
        leaves_in = {n: t.detach().to(self.device).clone().requires_grad_(True) for n, t in req["inputs"].items()}
        params = {n: t.detach().to(self.device).clone().requires_grad_(True) for n, t in req["params"].items()}
        stack = contextlib.ExitStack()
        self.stack = stack
        stack.enter_context(providers.use_backend(provider))
        like = next(iter(leaves_in.values()))
        mg, built = stack.enter_context(providers.run_context(provider, config, like, req["training"]))
        psp = self._psp(mg, req["psp"])
        record = stack.enter_context(recorders.recording(mg))
        cp_utils = _cp_utils(mg)
        topk = _TopkRecorder(cp_utils.compute_cp_indexer_topk)
        stack.enter_context(recorders.patched(cp_utils, "compute_cp_indexer_topk", topk))
        branch = _BranchRecorder(mg.module("csa").CompressedSparseAttention)
        stack.enter_context(recorders.patched(branch.cls, "_forward_thd_cp", branch.wrapper()))
        if req["scope"] == "layer":
            x = leaves_in["hidden"].unsqueeze(1)
            out, _bias = torch.func.functional_call(built.module, params, (x, None), {"packed_seq_params": psp},
                                                    strict=False)
            out = out.squeeze(1)
        else:
            out = self._core(built, config, leaves_in, params, psp, CORE_PREFIX, cp_utils)
        record.update(topk.seen)
        if not branch.calls:
            raise RuntimeError("production's THD CP branch (CompressedSparseAttention._forward_thd_cp) did not run")
        self.pending = {"out": out, "leaves": leaves_in, "params": params}
        recorded = {k: v.cpu() for k, v in record.items() if isinstance(v, torch.Tensor)}
        return {"out": out.detach().cpu(), "record": recorded}

    @staticmethod
    def _core(built, config, leaves: dict, params: dict, psp, prefix: str, cp_utils) -> torch.Tensor:
        group = built.module.core_attention.pg_collection.cp
        d = config.v_head_dim
        n = config.num_attention_heads
        l_local = leaves["query"].shape[0]
        x, qr = leaves["hidden"].unsqueeze(1), leaves["q_latent"].unsqueeze(1)
        key = leaves["kv"].view(l_local, 1, 1, d)
        boundary_hidden = cp_utils.exchange_cp_boundary_hidden(x, config.compress_ratio, config.csa_window_size,
                                                               group)
        boundary_kv = cp_utils.exchange_cp_boundary_hidden(key, config.compress_ratio, config.csa_window_size,
                                                           group)
        core_params = {name[len(prefix):]: t for name, t in params.items() if name.startswith(prefix)}
        out = torch.func.functional_call(
            built.module.core_attention, core_params, (leaves["query"], key, key, None),
            {"x": x, "qr": qr, "packed_seq_params": psp, "boundary_hidden": boundary_hidden,
             "boundary_kv": boundary_kv}, strict=False)
        return out.reshape(l_local, n, d)

    def backward(self, req: dict) -> dict:
        import torch.distributed as dist

        if self.pending is None:
            raise RuntimeError("backward without a forward")
        out, leaves, params = self.pending["out"], self.pending["leaves"], self.pending["params"]
        dout = req["grad_out"].to(device=out.device, dtype=out.dtype)
        inputs = list(leaves.values()) + list(params.values())
        grads = torch.autograd.grad(out, inputs, grad_outputs=dout, allow_unused=True)  # inside the provider context
        names_in = list(leaves)
        in_grads = {n: (None if g is None else g.detach().cpu()) for n, g in zip(names_in, grads[:len(names_in)])}
        reduced = {}
        for name, param, g in zip(params, params.values(), grads[len(names_in):]):
            present = torch.tensor([0 if g is None else 1], dtype=torch.int32, device=self.device)
            dist.all_reduce(present, op=dist.ReduceOp.MAX)
            if not int(present):
                reduced[name] = None
                continue
            total = torch.zeros_like(param) if g is None else g.detach().clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            reduced[name] = total.cpu()
        self.close()
        return {"inputs": in_grads, "params": reduced if self.rank == 0 else None}

    # ---- helpers ----------------------------------------------------------------------------------------------
    @staticmethod
    def _psp(mg, spec: dict):
        """Production's per-rank ``PackedSeqParams``: the pack's global boundaries (real and padded, separate
        tensors), the global ``max_seqlen``, ``cp_partition_mode="contiguous"`` (production's data schedule,
        ``get_batch_on_this_rank_for_sequence_packing``, builds it so)."""
        cls = mg.modules["megatron.core.packed_seq_params"].PackedSeqParams
        real = torch.tensor(spec["cu_seqlens"], dtype=torch.int32)
        padded = torch.tensor(spec["cu_seqlens_padded"], dtype=torch.int32)
        return cls(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                   cu_seqlens_kv_padded=padded, max_seqlen_q=int(spec["max_seqlen"]),
                   max_seqlen_kv=int(spec["max_seqlen"]), cp_partition_mode="contiguous", pad_between_seqs=True)


def _cp_utils(mg):
    from .loader import VARIANT

    return __import__(f"{VARIANT}.csa_utils.cp_utils", fromlist=["compute_cp_indexer_topk"])


class _TopkRecorder:
    """``cp_utils.compute_cp_indexer_topk`` recording its selection (per-sequence compressed ids, this rank's rows)
    and, on production's unfused path, the masked score chunks it hands ``torch.topk`` (``[rows, sequence-major
    compressed rows]``: production's own tensors, read as they pass, never recomputed)."""

    def __init__(self, original):
        self.original, self.seen = original, {}

    def __call__(self, *args, **kwargs):
        chunks: list = []
        with _TopkInputs(chunks, active=not kwargs.get("use_fused", False)):
            topk, layout = self.original(*args, **kwargs)
        if topk is not None:
            self.seen["cp_topk"] = topk.detach().clone()
            if chunks:
                self.seen["cp_scores"] = torch.cat(chunks, dim=0)
        return topk, layout


class _TopkInputs(torch.overrides.TorchFunctionMode):
    """Keeps a detached copy of the first argument of every ``torch.topk`` call inside the block."""

    def __init__(self, chunks: list, active: bool):
        super().__init__()
        self.chunks, self.active = chunks, active

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.active and func is torch.topk and args:
            self.chunks.append(args[0].detach().clone())
        return func(*args, **(kwargs or {}))


class _BranchRecorder:
    """Counts calls of ``CompressedSparseAttention._forward_thd_cp``: a CP run that did not take production's CP
    branch is an error, never a pass."""

    def __init__(self, cls):
        self.cls, self.original, self.calls = cls, cls._forward_thd_cp, 0

    def wrapper(self):
        original = self.original

        def _forward_thd_cp(module, *args, **kwargs):
            self.calls += 1
            return original(module, *args, **kwargs)

        return _forward_thd_cp


# ---- the process ------------------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    from multiprocessing.connection import Client

    address, rank, size, store_path, timeout_s = argv[0], int(argv[1]), int(argv[2]), argv[3], float(argv[4])
    backend = argv[5] if len(argv) > 5 else "gloo"
    torch.set_num_threads(int(os.environ.get("DSV4_CP_THREADS", "1") or 1))
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    state = Rank(rank, size, backend)
    try:
        state.start(store_path, timeout_s)
        send(conn, ("ready", rank, list(state.standins)))
    except Exception as exc:  # noqa: BLE001 — reported to the pool, which raises it in the harness
        send(conn, ("error", rank, _describe(exc)))
        return 1
    while True:
        try:
            kind, payload = recv(conn)
        except EOFError:
            return 0
        if kind == "stop":
            state.close()
            send(conn, ("ok", rank, None))
            return 0
        try:
            answer = state.forward(payload) if kind == "forward" else state.backward(payload)
            send(conn, ("ok", rank, answer))
        except Exception as exc:  # noqa: BLE001
            if os.environ.get("DSV4_CP_DEBUG"):
                traceback.print_exc()
            state.close()
            send(conn, ("error", rank, _describe(exc)))


def _describe(exc: BaseException) -> dict:
    from cases.vocabulary import Unsupported

    frames = traceback.extract_tb(exc.__traceback__)
    where, raised = "", {"type": type(exc).__name__, "types": [k.__name__ for k in type(exc).__mro__]}
    for frame in reversed(frames):
        if "/torch/" not in frame.filename and "site-packages" not in frame.filename:
            where = "/".join(frame.filename.split("/")[-2:]) + f":{frame.lineno}"
            raised.update(file=frame.filename, function=frame.name, line=frame.lineno)
            break
    return {"type": type(exc).__name__, "message": " ".join(str(exc).split()), "where": where, "raised": raised,
            "unsupported": isinstance(exc, (Unsupported, NotImplementedError))}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
