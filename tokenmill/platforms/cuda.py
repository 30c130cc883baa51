"""The CUDA platform: which attention and Gated DeltaNet kernels run on an NVIDIA GPU, and
whether decode steps replay CUDA graphs. Decided from what imports, so the decision
(and its tests) need no GPU.

- attention: "triton" (tokenmill/ops/triton_attention.py: paged KV write, decode
  and prefill over the block table) where triton imports, else "torch" (the
  PyTorch gather + SDPA path the CPU runs without native kernels); per KV cache
  group, `attention_backend` keeps a head size above 512 and MLA's latent cache on
  the PyTorch backends (tokenmill/attention/);
- linear_attention: "fla" (flash-linear-attention's chunked / fused-recurrent
  Gated DeltaNet kernels) for bf16 / fp16 models where `fla` imports, else
  "torch" (an fp32 model keeps the exact PyTorch path: fla's kernels may
  multiply in TF32);
- cuda_graphs: decode steps replay graphs captured at start (worker/cuda_graph.py)
  unless `enforce_eager`, and only with Triton attention (the PyTorch decode path
  builds its masks with host-sized shapes per step);
- GEMMs in the model's dtype through PyTorch (cuBLAS); MoE experts grouped without a
  host sync per expert (graphs and async scheduling need none); quantized layers
  (GPTQ / AWQ / int8, fp8) through the Triton W4A16 / W8A16 / FP8 GEMMs
  (ops/triton_quant_linear.py: the weights read at their stored width); integer
  and fp8 experts through its grouped form (ops/triton_quant_moe.py, also without a
  host sync).
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

from tokenmill.platforms.interface import Platform, dtype_name


@functools.cache
def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True, kw_only=True)
class CudaPlatform(Platform):
    enforce_eager: bool = False     # asked for: no CUDA graphs

    @classmethod
    def create(cls, device="cuda", model_dtype=None, *, enforce_eager: bool = False,
               tensor_parallel_size: int = 1) -> CudaPlatform:
        import torch
        model_dtype = model_dtype or torch.float32
        half = model_dtype in (torch.bfloat16, torch.float16)
        triton = module_available("triton")
        name = dtype_name(model_dtype)
        return cls(device=str(torch.device(device)), model_dtype=name, gemm_dtype=name,
                   attention="triton" if triton else "torch", weights=f"{name} (the model's)",
                   linear_attention="fla" if half and module_available("fla") else "torch",
                   cuda_graphs=bool(triton and not enforce_eager),
                   quantized_gemm="triton" if triton else "torch",
                   enforce_eager=bool(enforce_eager),
                   tensor_parallel_size=tensor_parallel_size)

    def describe(self) -> str:
        graphs = ("CUDA graphs for decode steps" if self.cuda_graphs else
                  "eager (enforce_eager)" if self.enforce_eager else "eager (no Triton)")
        return (f"{self.device}: attention {self.attention}, Gated DeltaNet "
                f"{self.linear_attention}, MoE sorted grouped GEMMs without host sync, "
                f"{graphs}; {self.model_dtype} model, GEMMs in {self.gemm_dtype}")

    def moe_method(self, layer):
        """The experts' grouped GEMMs without a host sync on the expert groups (CUDA
        graphs, async scheduling): quantized experts (GPTQ, AWQ, compressed-tensors,
        int8 at load, block / per-channel fp8: any method with `with_triton`) through
        the Triton grouped GEMMs where triton imports; another non-default method is
        kept."""
        from tokenmill.models.layers.linear_methods import (SyncFreeFusedMoEMethod,
                                                            UnquantizedFusedMoEMethod)
        current = layer.method
        with_triton = getattr(current, "with_triton", None)
        if with_triton is not None and self.quantized_gemm == "triton":
            return current if current.triton else with_triton()
        if type(current) is not UnquantizedFusedMoEMethod or current.compute_dtype is not None:
            return current
        return SyncFreeFusedMoEMethod()

