"""Platforms: every kernel decision of an engine, made once at its start.

`create_platform(device, model_dtype, **engine arguments)` picks the platform of the
device (`CudaPlatform` for CUDA, `CpuPlatform` otherwise) and lets it decide;
`from_engine_args` does so from an `EngineArgs`. The engine makes one and passes it
to the executor, the runner, the model loader and the draft-model loaders; none of
them builds one of its own. `interface.Platform` lists what every platform decides.
"""
from __future__ import annotations

from tokenmill.platforms.cpu import (DEFAULT_GREEDY_HEAD_MAX_ROWS, CpuPlatform,
                                     check_cpu_args)
from tokenmill.platforms.cuda import CudaPlatform
from tokenmill.platforms.interface import Platform

__all__ = ["Platform", "CpuPlatform", "CudaPlatform", "create_platform", "from_engine_args",
           "check_cpu_args", "DEFAULT_GREEDY_HEAD_MAX_ROWS"]


def create_platform(device="cpu", model_dtype=None, *, cpu_kernels: str = "auto",
                    cpu_capability: str | None = None, linear_bf16_max_rows: int | None = None,
                    greedy_head_max_rows: int = DEFAULT_GREEDY_HEAD_MAX_ROWS,
                    decode_layers: bool = True, tensor_parallel_size: int = 1,
                    enforce_eager: bool = False) -> Platform:
    """The platform for a model of `model_dtype` (default fp32) on `device`. The CPU
    arguments are checked on every device (a bad value is an error wherever it runs)."""
    import torch
    check_cpu_args(cpu_kernels, cpu_capability, linear_bf16_max_rows, greedy_head_max_rows,
                   decode_layers)
    if torch.device(device).type == "cuda":
        return CudaPlatform.create(device, model_dtype, enforce_eager=enforce_eager,
                                   tensor_parallel_size=tensor_parallel_size)
    return CpuPlatform.create(device, model_dtype, cpu_kernels=cpu_kernels,
                              cpu_capability=cpu_capability,
                              linear_bf16_max_rows=linear_bf16_max_rows,
                              greedy_head_max_rows=greedy_head_max_rows,
                              decode_layers=decode_layers,
                              tensor_parallel_size=tensor_parallel_size)


def from_engine_args(args, device, model_dtype) -> Platform:
    """The platform an engine with `args` runs on (EngineSetup calls it once)."""
    return create_platform(device, model_dtype, cpu_kernels=args.cpu_kernels,
                           cpu_capability=args.cpu_capability,
                           linear_bf16_max_rows=args.linear_bf16_max_rows,
                           greedy_head_max_rows=args.greedy_head_max_rows,
                           decode_layers=args.decode_layers,
                           tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                           enforce_eager=getattr(args, "enforce_eager", False))
