"""Compile the Triton attention kernels for NVIDIA GPUs on a machine without one.

Every launch the wrappers of ops/triton_attention.py make for a set of shapes
(head sizes 8 to 512, bf16 / fp16 / fp32 caches, soft-capping, windows, split-K
decode, both prefill tile heights) is compiled ahead of time to a cubin for each
target architecture, the way Triton's JIT would compile it on that GPU: the
launch's own arguments go through the JIT's argument binder (so the alignment
specialisations match), then through ptxas. Triton's wheel carries ptxas and
cuobjdump, so no GPU and no CUDA toolkit is needed. What comes out per kernel:
shared memory against the architecture's per-block limit, registers, and spills
(local memory). The numbers the kernels compute are proven elsewhere: under the
interpreter on the CPU (tests/unit/test_triton_attention.py), and on a GPU by
scripts/gpu_check.sh.

Triton decides interpreted or compiled when it is imported (its standard library
is jit functions too), so this runs in a process that imported triton without
TRITON_INTERPRET: `python -m tokenmill.ops.triton_compile --output-json F`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tokenmill import envs

# Shared memory one block may use (the opt-in maximum), per compute capability:
# A100 (8.0), the Ampere / Ada cards (8.6, 8.9), H100 / H200 (9.0), consumer
# Blackwell (12.0).
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 120: 101376}
KERNELS = ("_kv_write_kernel", "_paged_decode_kernel", "_paged_decode_split_kernel",
           "_combine_splits_kernel", "_paged_prefill_kernel")


@dataclass(frozen=True)
class Shape:
    """One attention layer's shape as a model has it."""
    head_size: int
    dtype: torch.dtype
    num_heads: int = 8
    num_kv_heads: int = 2
    softcap: float = 0.0
    window: int = 0
    # The KV cache's dtype when it differs from the queries' (--kv-cache-dtype fp8).
    kv_dtype: torch.dtype | None = None

    @property
    def label(self) -> str:
        extra = (f" softcap {self.softcap:g}" if self.softcap else "") + \
            (f" window {self.window}" if self.window else "") + \
            (" fp8 kv" if self.kv_dtype == torch.float8_e4m3fn else "")
        return (f"head {self.head_size} {str(self.dtype).removeprefix('torch.')} "
                f"{self.num_heads}/{self.num_kv_heads} heads{extra}")


# The head shapes of the model families tokenmill serves (Llama / Qwen 64 and 128,
# Phi-3 96, Gemma 256 with soft-capping or a window, Gemma 4's global 512, Qwen2-0.5B
# style GQA 7:1 and a 32-query group), every cache dtype, and a head below tl.dot's
# minimum of 16.
SHAPES = (
    Shape(128, torch.bfloat16), Shape(128, torch.float16), Shape(128, torch.float32),
    Shape(64, torch.bfloat16, 14, 2), Shape(128, torch.bfloat16, 32, 1),
    Shape(96, torch.bfloat16), Shape(96, torch.float32),
    Shape(80, torch.bfloat16),
    Shape(256, torch.bfloat16, softcap=50.0), Shape(256, torch.bfloat16, window=512),
    Shape(256, torch.float32, softcap=50.0),
    Shape(512, torch.bfloat16), Shape(512, torch.float32),
    Shape(8, torch.float32),
    # the FP8 KV cache (e4m3 codes as uint8) under bf16 queries
    Shape(128, torch.bfloat16, kv_dtype=torch.float8_e4m3fn),
    Shape(256, torch.bfloat16, softcap=50.0, kv_dtype=torch.float8_e4m3fn),
)


@dataclass
class CompiledKernel:
    arch: int
    shape: str
    kernel: str
    num_warps: int
    num_stages: int
    shared: int  # bytes of shared memory per block
    max_shared: int  # the architecture's per-block limit
    registers: int  # per thread
    spill_bytes: int  # local memory per thread (register spills)


def load_kernels(filename: str = "triton_attention.py"):
    """An ops/ kernel module loaded as a private copy (its wrappers call the
    module's kernel names, which `compile_launches` swaps for compilers)."""
    if envs.triton_interpret():
        raise RuntimeError("run without TRITON_INTERPRET: the interpreter replaces "
                           "Triton's own jit functions at import")
    path = Path(__file__).with_name(filename)
    spec = importlib.util.spec_from_file_location(f"_{path.stem}_aot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Compile:
    """Stands in for `kernel[grid]`: compiles the launch for `target` instead of
    running it, with the JIT's own argument binder and option parsing."""

    def __init__(self, fn, target, sink: dict):
        self.fn, self.target, self.sink = fn, target, sink

    def __getitem__(self, grid):
        return self._compile

    def _compile(self, *args, **kwargs):
        import triton
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(self.target)
        binder = create_function_from_signature(self.fn.signature, self.fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self.fn._pack_args(
            backend, kwargs, bound, specialization, options)
        key = (self.fn.__name__, repr(signature), repr(constexprs), repr(attrs),
               repr(sorted(options.__dict__.items())))
        if key not in self.sink:
            source = ASTSource(self.fn, signature, constexprs, attrs)
            self.sink[key] = triton.compile(source, target=self.target,
                                            options=options.__dict__)


def _launch_all(module, shape: Shape) -> None:
    """Every kernel launch the wrappers make for one layer shape: the K/V write,
    decode in one pass and split-K (MAX_DECODE_SPLITS), prefill at both tile heights."""
    d, dt = shape.head_size, shape.dtype
    num_blocks, block_size, rows = 6, 16, 3
    cache = torch.zeros(num_blocks, 2, block_size, shape.num_kv_heads, d,
                        dtype=shape.kv_dtype or dt)
    q = torch.zeros(rows, shape.num_heads, d, dtype=dt)
    kv = torch.zeros(rows, shape.num_kv_heads, d, dtype=dt)
    block_table = torch.zeros(rows, num_blocks, dtype=torch.int32)
    seq_lens = torch.ones(rows, dtype=torch.int32)
    attn = dict(scale=d ** -0.5, window=shape.window, softcap=shape.softcap)
    module.write_kv(kv, kv, cache, torch.zeros(rows, dtype=torch.long))
    module.paged_decode(q, cache, block_table, seq_lens, num_splits=1, **attn)
    module.paged_decode(q, cache, block_table, seq_lens,
                        num_splits=module.MAX_DECODE_SPLITS, **attn)
    query_start_loc = torch.arange(rows + 1, dtype=torch.int32)
    for max_query_len in (1, 64):  # 16- and 32-row query tiles
        module.paged_prefill(q, cache, block_table, query_start_loc, seq_lens, max_query_len,
                             **attn)


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes) per thread, from cuobjdump's resource usage."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", path],
                              capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return int(fields["REG"]), int(fields["LOCAL"]) + int(fields["STACK"])


# The quantized-weight GEMMs (ops/triton_quant_linear.py): a layer of each format in
# the activation dtypes a GPU serves, at a decode-sized input (whole and split over K),
# a batch's (the fused 64-row tiles) and a prefill's (dequantized for torch's GEMM); the
# integer and fp8 experts' grouped GEMMs (ops/triton_quant_moe.py) likewise, at a decode
# step's routing and a prefill's.
QUANT_MODULES = {"triton_quant_linear.py": ("_int_weight_gemm_kernel", "_fp8_block_gemm_kernel",
                                            "_int_dequant_kernel", "_fp8_dequant_kernel"),
                 "triton_quant_moe.py": ("_int_moe_gemm_kernel", "_fp8_moe_gemm_kernel")}
QUANT_KERNELS = tuple(name for names in QUANT_MODULES.values() for name in names)
QUANT_SHAPES = tuple(f"{fmt} {dtype}" for fmt in ("int4 group 128", "int4 group 32",
                                                    "int8 per channel", "fp8 block 128",
                                                    "moe int4 group 128",
                                                    "moe int4 group 128 act-order",
                                                    "moe int8 per channel",
                                                    "moe fp8 block 128",
                                                    "moe fp8 per channel")
                     for dtype in ("bfloat16", "float16", "float32"))


def _launch_quant(modules: dict, label: str) -> None:
    from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight
    if label.startswith("moe"):
        return _launch_quant_moe(modules["triton_quant_moe.py"], label)
    module = modules["triton_quant_linear.py"]
    n, k = 256, 512
    dtype = getattr(torch, label.rsplit(" ", 1)[1])
    for rows in (1, 64, module.DEQUANT_MIN_ROWS):  # decode, fused tiles, dequantized
        x = torch.zeros(rows, k, dtype=dtype)
        if label.startswith("fp8"):
            w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
            layer = module.Fp8WeightTriton(w, torch.ones(n // 128, k // 128), (128, 128))
        else:
            bits, group = ((4, int(label.split()[2])) if label.startswith("int4")
                           else (8, k))
            qw = QuantizedWeight(torch.zeros(n, k, dtype=torch.uint8),
                                 torch.ones(n, k // group),
                                 torch.zeros(n, k // group, dtype=torch.uint8), bits, group)
            layer = module.IntWeightTriton(qw, "cpu")
        layer.linear(x, torch.zeros(n))
        if rows == 1:  # split over K: the decode launch on a GPU with SMs to fill
            layer.linear(x, torch.zeros(n), split_k=2)


def _launch_quant_moe(module, label: str) -> None:
    """Both GEMMs of a 64-expert block (H 512, I 256, top 8): one token (decode tiles)
    and 256 (prefill tiles)."""
    from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight
    experts, hidden, inter, top_k = 64, 512, 256, 8
    dtype = getattr(torch, label.rsplit(" ", 1)[1])
    bits, group = (4, 128) if "int4" in label else (8, None)

    def stack_fp8(n, k):
        # block 128, or per-channel as --quantization fp8 makes it: (1, max(H, I))
        bn, bk = (128, 128) if "block" in label else (1, max(hidden, inter))
        return module.Fp8ExpertsTriton(
            torch.zeros(experts, n, k, dtype=torch.float8_e4m3fn),
            torch.ones(experts, -(-n // bn), -(-k // bk)), (bn, bk), "cpu")

    def stack(n, k):
        if "fp8" in label:
            return stack_fp8(n, k)
        g = group or k
        perm = torch.arange(k) if "act-order" in label else None
        return module.IntExpertsTriton(
            [QuantizedWeight(torch.zeros(n, k, dtype=torch.uint8), torch.ones(n, k // g),
                             torch.zeros(n, k // g, dtype=torch.uint8), bits, g, perm)] * experts,
            "cpu")
    w13, w2 = stack(2 * inter, hidden), stack(hidden, inter)
    for tokens in (1, 256):
        topk_ids = torch.arange(tokens * top_k).view(tokens, top_k) % experts
        module.fused_experts_triton(torch.zeros(tokens, hidden, dtype=dtype), w13, w2,
                                    torch.ones(tokens, top_k, dtype=dtype), topk_ids)


def compile_launches(archs=tuple(MAX_SHARED), shapes=SHAPES,
                     quantized: bool = False) -> list[CompiledKernel]:
    """Each distinct kernel of each shape compiled for each architecture: the attention
    kernels' shapes, or (`quantized`) the quantized GEMMs'."""
    from triton.backends.compiler import GPUTarget

    if quantized:
        modules = {f: load_kernels(f) for f in QUANT_MODULES}
        names, shapes = QUANT_MODULES, QUANT_SHAPES
    else:
        modules = {"triton_attention.py": load_kernels()}
        names = {"triton_attention.py": KERNELS}
    # (module, kernel name, jit function): swapped for compilers per shape
    jit = [(modules[f], name, getattr(modules[f], name)) for f in modules for name in names[f]]
    results = []
    try:
        for arch in archs:
            target = GPUTarget("cuda", arch, 32)
            for shape in shapes:
                compiled: dict = {}
                for module, name, fn in jit:
                    setattr(module, name, _Compile(fn, target, compiled))
                if quantized:
                    _launch_quant(modules, shape)
                else:
                    _launch_all(modules["triton_attention.py"], shape)
                for kernel in compiled.values():
                    regs, spill = _resources(kernel.asm["cubin"])
                    meta = kernel.metadata
                    results.append(CompiledKernel(
                        arch, shape if quantized else shape.label, meta.name, meta.num_warps, meta.num_stages,
                        meta.shared, MAX_SHARED[arch], regs, spill))
    finally:
        for module, name, fn in jit:
            setattr(module, name, fn)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=",".join(map(str, MAX_SHARED)),
                        help="compute capabilities, e.g. 80,90 (default: %(default)s)")
    parser.add_argument("--head-sizes", help="only the shapes with these head sizes, e.g. "
                        "256,512 (default: all of SHAPES)")
    parser.add_argument("--quantized", action="store_true",
                        help="the quantized-weight GEMMs (ops/triton_quant_linear.py, "
                             "triton_quant_moe.py) instead of the attention kernels")
    parser.add_argument("--output-json", help="write every compiled kernel's resources here")
    args = parser.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",")]
    shapes = SHAPES
    if args.head_sizes:
        heads = {int(h) for h in args.head_sizes.split(",")}
        shapes = tuple(s for s in SHAPES if s.head_size in heads)
        if not shapes:
            parser.error(f"--head-sizes: none of {sorted(heads)} is in SHAPES")
    unknown = [a for a in archs if a not in MAX_SHARED]
    if unknown:
        parser.error(f"--arch: no shared-memory limit known for {unknown}; "
                     f"known: {sorted(MAX_SHARED)}")
    results = compile_launches(archs, shapes, quantized=args.quantized)
    over = [r for r in results if r.shared > r.max_shared]
    for r in results:
        flag = " OVER THE LIMIT" if r.shared > r.max_shared else ""
        print(f"sm_{r.arch} {r.shape:38s} {r.kernel:28s} warps {r.num_warps} stages "
              f"{r.num_stages} shared {r.shared:6d}/{r.max_shared} regs {r.registers:3d} "
              f"spill {r.spill_bytes}{flag}")
    print(f"{len(results)} kernels compiled for sm_{', sm_'.join(map(str, archs))}; "
          f"{len(over)} over the shared-memory limit; "
          f"{sum(r.spill_bytes > 0 for r in results)} spill registers")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
