"""Child process of ``test_compile_cache_gpu.py`` (GPU only): run every cuDNN kernel call of ``parity.kernel_checks``
(``div=8`` sizes, fixed seed) once through the cudnn provider and save the outputs and the compiled-kernel cache's
counters. ``python tests/gpu/compile_cache_child.py OUT_DIR`` (``DSV4_PARITY_CACHE_DIR`` chooses the cache)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from parity import kernel_checks as gpu_checks
from fused.kernels import compile_cache


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tensors, ran = {}, []
    for call in gpu_checks.build_calls(torch.device("cuda"), div=8):
        if call.provider != "cudnn":
            continue
        prov = gpu_checks._provider(call.provider, call.provider_kwargs)
        args, kwargs = call.make()
        if prov.check_support(call.stage, *args, **kwargs) is not None:
            continue
        args, kwargs = gpu_checks._clone(args, kwargs, call.inplace)
        res = getattr(prov, call.stage)(*args, **kwargs)
        torch.cuda.synchronize()
        for i, t in enumerate(gpu_checks._flatten(res) + [args[i] for i in call.inplace]):
            tensors[f"{call.label}/{i}"] = t.detach().cpu()
        ran.append(call.label)
    torch.save(tensors, out / "outputs.pt")
    (out / "stats.json").write_text(json.dumps({"calls": ran, "stats": compile_cache.stats()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
