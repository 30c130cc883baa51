"""The CUDA side of the platform decision (cpu_platform.CpuPlatform.create asks here
for a CUDA device): which attention kernels, Gated DeltaNet kernels and whether
pure-decode steps replay CUDA graphs. Kept apart so the CPU rules stay readable.

- attention: "triton" (tokenmill/ops/triton_attention.py: paged KV write, decode
  and prefill over the block table) where triton imports, else "torch" (the
  PyTorch gather + SDPA path the CPU runs without native kernels);
- linear_attention: "fla" (flash-linear-attention's chunked / fused-recurrent
  Gated DeltaNet kernels) for bf16 / fp16 models where `fla` imports, else
  "torch" (an fp32 model keeps the exact PyTorch path: fla's kernels may
  multiply in TF32);
- cuda_graphs: decode steps replay graphs captured at start (worker/cuda_graph.py)
  unless `enforce_eager`, and only with Triton attention (the PyTorch decode path
  builds its masks with host-sized shapes per step).
"""
from __future__ import annotations

import functools
import importlib.util


@functools.cache
def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cuda_decisions(enforce_eager: bool = False, half: bool = True) -> dict:
    """The fields of CpuPlatform that differ on a CUDA device (`half`: a bf16 / fp16
    model)."""
    triton = module_available("triton")
    return dict(attention="triton" if triton else "torch",
                linear_attention="fla" if half and module_available("fla") else "torch",
                cuda_graphs=bool(triton and not enforce_eager))


def describe_cuda(p) -> str:
    graphs = ("CUDA graphs for decode steps" if p.cuda_graphs else
              "eager (enforce_eager)" if p.enforce_eager else "eager (no Triton)")
    return (f"{p.device}: attention {p.attention}, Gated DeltaNet {p.linear_attention}, "
            f"MoE sorted grouped GEMMs without host sync, {graphs}; {p.model_dtype} model, "
            f"GEMMs in {p.gemm_dtype}")
