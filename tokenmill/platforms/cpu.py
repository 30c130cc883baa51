"""The CPU platform: which kernels the engine runs on a CPU, decided in one place, once.

`CpuPlatform.create` is called at engine start (through
`tokenmill.platforms.create_platform`) with the device, the model dtype
and the engine arguments (`cpu_kernels`, `cpu_capability`, `linear_bf16_max_rows`,
`greedy_head_max_rows`, `decode_layers`). It reads what this CPU can do (the
kernel levels it runs, tokenmill.kernels; whether it has native bf16 GEMMs) and
fixes, for the whole run:

- the kernel capability level and its module of native kernels (`ops`, or None
  for the plain PyTorch path);
- the GEMM dtype: a bf16 / fp16 model computes its GEMMs in fp32 where the CPU
  has no native bf16 (no AVX512-BF16 / AMX: oneDNN emulates bf16, ~3-4x slower
  than fp32) or where a level below avx512 is forced (the run then takes an AVX2
  CPU's path end to end); elsewhere in the model dtype;
- the linear kernel of a bf16 model: `packed_bf16` (the bf16 weights packed once,
  widened to fp32 in the kernel; where the level's `linear_bf16` is vectorised) or
  `torch`. Without native bf16 it takes every input and the packed weights are
  the only copy (half the bytes of an fp32 copy, and a batch-1 step is bound by
  reading them). With native bf16 too, at a level whose kernel has the many-row
  path on vdpbf16ps (`ops.has_bf16_dot_gemm`: avx512_bf16; bf16 inputs of 9+ rows,
  kernels/cpu_linear_dot.cpp) or on AMX tiles (`ops.has_amx_gemm`: amx,
  kernels/cpu_linear_amx.cpp), it takes every input and keeps no oneDNN copy:
  resident weights ~1.0x the checkpoint instead of ~1.9x, at about oneDNN's speed
  (figures at DEFAULT_NATIVE_BF16_PACKED_ROWS) -- except vdpbf16ps on a CPU with AMX
  (the avx512_bf16 level forced there), 5-10x behind oneDNN's AMX GEMM at batch, which
  keeps the oneDNN copy for the larger inputs. Elsewhere with native bf16 it takes
  the small inputs (decode) and oneDNN's bf16 GEMM the rest. `linear_bf16_max_rows`
  (an engine argument) sets the row limit instead: then oneDNN's prepacked bf16
  copy (native bf16) or an fp32 copy (bf16 emulated) serves the larger inputs;
- the linear kernel of an fp32 model: `packed_f32` for inputs of up to
  DEFAULT_F32_PACKED_ROWS rows (decode; a second, packed, copy of the weights) and
  oneDNN above, where the level's linear is vectorised; else `torch`;
- the GEMM of the inputs the packed kernels do not take (batched decode, prefill):
  `onednn_prepacked` (the weights reordered once for oneDNN, layers/linear_methods/
  `OneDNNPrepackedLinearMethod`; fp32 models, and bf16 ones where bf16 is native) or `torch`
  (F.linear); the prepacked copy replaces the plain weights;
- the quantized layers (GPTQ / AWQ / int8, fp8 checkpoints and fp8 made at load): the
  native W4A16 / W8A16 kernel (e4m3 codes widened as integer ones) for inputs of up to
  `quantized_max_rows` rows, dequantized tiles above (0: the PyTorch reference path),
  where the level's kernels are vectorised; bf16 GEMMs at avx512_bf16
  (`ops.has_quant_dot`) take `linear_quant_dot` above instead (bf16 pairs dequantized in
  the kernel's scratch, vdpbf16ps), from DEFAULT_QUANT_DOT_ROWS + 1 rows;
- the attention, norm and activation kernels (`native` or `torch`), and Gated
  DeltaNet's (`linear_attention`: the native recurrence, kernels/cpu_gated_delta.cpp,
  or the PyTorch chunked form);
- the lm_head: `greedy_int8` (the int8-screened argmax for all-greedy steps of up
  to `greedy_head_max_rows` rows; needs the packed lm_head, bf16 or fp32) or `full`;
- the decode-layer path: the native C++ loop over every layer of a decode step
  (bf16 models with packed bf16 linears, fp32 models with packed fp32 ones), on
  or off.

`prepare_model` (platforms/interface.py) hands those decisions to the layers once, after the weights are
loaded (each GEMM layer's method, chosen from these fields by
`Platform.linear_method` / `moe_method`; each layer's kernels module; the decode
loop); the model runner takes the rest (attention metadata, the greedy head). No
layer looks anything up per call. `describe()` is the line logged at start-up,
`as_dict()` what the benchmarks write into their JSON.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import platform as _host
from dataclasses import dataclass

from tokenmill.platforms.interface import Platform, dtype_name

logger = logging.getLogger(__name__)

CPU_KERNELS = ("auto", "native", "torch")
# fp32 models: inputs of up to this many rows take the packed fp32 kernel. A batch-1
# F.linear streams its weights from memory at ~11 GB/s on the AVX512-BF16 EPYC, the
# packed kernel (prefetching) at ~40-50 GB/s (32000 x 512: 6.2 vs ~1.5 ms); at 8+ rows
# a step is no longer a pure weight stream and oneDNN's blocked GEMM takes over.
DEFAULT_F32_PACKED_ROWS = 8
# Without native bf16 the packed kernel takes every input: measured on the 2-vCPU bench
# machine (AVX-512, no BF16), all 33 GEMMs of the bench model in one run, 10 vs 18 ms
# for oneDNN's fp32 GEMM at 1 row, 15 vs 49 at 8, 87-108 vs 80-95 GFLOP/s at 32-128
# rows; at prefill sizes (512-2048 rows) the fp32 GEMM is about 20% ahead
# (docs/benchmarks.md), not worth a second, fp32, copy of every weight.
# With native bf16 (AMX / AVX512-BF16) oneDNN's bf16 GEMM overtakes the packed kernel
# between 8 and 16 rows; below, the packed kernel reads the weights faster. Measured on
# a Xeon with AMX, 3072 x 512: 0.11 vs 0.26 ms at 1 row, 0.47 vs 0.37 ms at 16 rows,
# and on the 32000 x 512 lm_head 3.1 vs 9.4 ms at 1 row.
#
# At avx512_bf16 the packed kernel's many-row path on vdpbf16ps (bf16 inputs from 9
# rows; cpu_linear_dot.cpp) keeps pace with oneDNN's prepacked bf16 GEMM, so the
# packed copy takes every input and the oneDNN copy is not kept (linear_bf16_max_rows
# ALL_ROWS there). Measured on the 2-core AVX512-BF16 EPYC (Zen 4 class), one thread,
# thread CPU time, packed / oneDNN ms (`python -m tokenmill.bench.linear_rows`):
# 3072 x 512 at 16 rows 0.26 / 0.29, 32: 0.62 / 0.57, 128: 2.24 / 1.91, 512: 8.7 / 7.9,
# 2048: 33.1 / 30.4; 32000 x 512 (lm_head) at 16: 3.4 / 3.5, 128: 22.7 / 20.5 (the
# widening path took 47.8), 2048: 431 / 391; 4096 x 4096 at 16: 3.2 / 3.7, 128: 23.0 /
# 21.6, 2048: 361 / 336. Over the bench model's five shapes and 4096 x 4096, 0.78-0.95x
# at 16 rows, 0.99-1.17x at 32-2048 (mean ~1.09x): a few per cent of prefill time for
# half the resident weight bytes. Below 9 rows (decode) the widening path stays: it
# streams the weights, and the greedy head and the decode-layer loop rely on its results.
DEFAULT_NATIVE_BF16_PACKED_ROWS = 8
# linear_bf16_max_rows of a packed layer that takes every input (no other copy of the
# weights is kept): layers/linear.py's ALL_ROWS.
from tokenmill.models.layers.linear_methods import ALL_ROWS  # noqa: E402
# Integer-quantized layers (GPTQ / AWQ / int8): inputs of up to this many rows take the
# native W4A16 / W8A16 kernel (cpu_quant_linear.cpp), larger ones dequantized tiles and
# the library GEMM. Where the GEMMs run in fp32, measured on the 2-core AVX2 EPYC (Zen 3),
# 4096 x 4096 int4 g128, one thread: the kernel 0.8 ms at 1 row (dequantize + F.linear:
# 7 ms), 27 vs 56 ms at 64 rows, 106 vs 130 at 256, even at 512-1024 (226 vs 253, 475 vs
# 484; int8 260 vs 248 at 512): past 256 rows the fp32 GEMMs are level.
DEFAULT_QUANTIZED_ROWS = 256
# Where bf16 GEMMs are native (AVX512-BF16), oneDNN's bf16 GEMM on dequantized tiles
# overtakes the kernel later than it does the packed bf16 one, since every call pays the
# dequantization. Measured on the 2-core AVX512-BF16 EPYC (Zen 4 class), bf16 inputs,
# kernel / tiles in ms: int8 3072 x 512 at 16 rows 0.56 / 0.72, 32 rows 1.06 / 1.03,
# 48 rows 1.52 / 1.21; 4096 x 4096 at 16 rows 9.7 / 15.4, 32 rows 16.1 / 24.0, 48 rows
# 25.8 / 26.4; int4 g128 the same within noise (`python -m tokenmill.bench.quant_rows`).
DEFAULT_NATIVE_BF16_QUANTIZED_ROWS = 32
# At avx512_bf16 (`ops.has_quant_dot`) bf16 inputs past the kernel's rows take
# linear_quant_dot (the codes dequantized to bf16 pairs in the kernel's scratch, then
# vdpbf16ps; cpu_quant_linear.cpp) instead of the tiles: ahead of the widening kernel
# from 9 rows. Measured on the 2-core Zen 4 EPYC, one thread, ms widening / dot:
# int8 3072 x 512 at 9 rows 0.29 / 0.23, 16 rows 0.54 / 0.33, 32 rows 0.99 / 0.58;
# 512 x 1536 at 9 rows 0.15 / 0.12; int4 g128 the same within 3%. (The quad layout's
# kernel stays ahead of it up to ~64 rows: DEFAULT_QUAD_QUANTIZED_ROWS holds.)
DEFAULT_QUANT_DOT_ROWS = 8
# bf16 models at a level with the quad layout (integer dot products on 15-bit
# activations, cpu_quant_linear.cpp) keep 4- / 8-bit inputs of up to this many rows in
# the kernel: it widens nothing, so it stays ahead of the tiles longer (where the tiles'
# GEMM runs in fp32, up to quantized_max_rows: from 65 rows the kernel dequantizes each
# block and multiplies it exactly, as the widening kernel does; 4-bit codes at avx2
# from 32 rows, where the two-row passes stop paying: cpu_quant_linear.cpp).
DEFAULT_QUAD_QUANTIZED_ROWS = 64
# Rows from which the quad kernel itself dequantizes each block and multiplies it
# exactly (cpu_quant_linear.cpp's quad_dequant_min_rows, mirrored here for the log;
# tests/unit/test_quant_quad_kernel.py checks the two agree at every level it runs).
QUAD_EXACT_ROWS = 65
QUAD_EXACT_ROWS_AVX2_INT4 = 32


def quad_exact_from(level: str | None, bits: int) -> int:
    """Rows from which `level`'s quad kernel multiplies `bits`-bit codes exactly."""
    return QUAD_EXACT_ROWS_AVX2_INT4 if level == "avx2" and bits == 4 else QUAD_EXACT_ROWS


# At amx the rows past the quad kernel's go to linear_quant_dot on TDPBF16PS tiles
# (`ops.has_amx_gemm`), which overtakes the quad kernel far sooner. Measured on the
# 2-core AMX Xeon, bf16 inputs, 2 threads, ms quad / tiles (`python -m
# tokenmill.bench.quant_rows --rows 8,10,12,14,16,20,24`): int8 3072 x 512 at 12 rows
# 0.091 / 0.129, 16 rows 0.121 / 0.131, 24 rows 0.178 / 0.160, 64 rows 0.441 / 0.239;
# 512 x 1536 at 12 rows 0.071 / 0.078, 16 rows 0.092 / 0.080; 4096 x 4096 at 12 rows
# 1.05 / 1.11, 14 rows 1.26 / 1.14, 64 rows 4.81 / 1.99; int4 g128 the same within 10%.
DEFAULT_AMX_QUAD_QUANTIZED_ROWS = 12
# The levels whose quad kernel was measured faster than the widening kernel at 1-16 rows
# (docs/benchmarks.md; vpdpbusd at avx512_vnni and avx512_bf16, a superset of it;
# vpmaddwd at avx512 and avx2): the platform asks for the layout there only.
QUAD_LEVELS = frozenset({"avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"})
# All-greedy steps with up to this many rows take the int8-screened lm_head. Measured on
# the bench model's lm_head (32000 x 512): 0.6 vs 1.8 ms at 1 row, 1.2 vs 1.9 at 4,
# slower than the full GEMM from about 8 rows.
DEFAULT_GREEDY_HEAD_MAX_ROWS = 4
GREEDY_HEAD_KERNEL_ROWS = 128  # greedy_lm_head takes 1 to 128 rows
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
_AMX_CPU_FLAGS = ("amx_tile", "amx_bf16")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 GEMMs natively (AVX512-BF16 or AMX), from
    /proc/cpuinfo; without it (macOS, Windows), from torch's own CPU probe.

    Without native bf16, oneDNN emulates bf16 and a bf16 GEMM runs several times
    slower than fp32 (measured: 3.4x on an AVX-512 Xeon without BF16).
    """
    from tokenmill.kernels import _cpu_flags
    flags = _cpu_flags()
    if flags is None:
        import torch
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, p, lambda: False)() for p in probes)
    return any(flag in flags for flag in _BF16_CPU_FLAGS)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX bf16 tiles (oneDNN's bf16 GEMM then runs on them), from
    /proc/cpuinfo; without it, from torch's own CPU probe."""
    from tokenmill.kernels import _cpu_flags
    flags = _cpu_flags()
    if flags is None:
        import torch
        return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return all(flag in flags for flag in _AMX_CPU_FLAGS)


# torch's CPU sin, cos, log, sqrt, ... (fp32 and fp64) call MKL's vector math, whose
# functions are set up by their first call. Two threads making that first call at once
# (an input of a few thousand elements, after any GEMM) sometimes get the first
# thread's share wrong: on the 2-core Xeon with AMX ~10% of processes, cos off by
# 1.5e-4, log and sqrt too; a second call is right. One small, single-threaded call of
# each before any large one settles them (0 in 80 processes after it).
VECTOR_MATH_OPS = ("abs", "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp",
                   "log", "log1p", "sin", "sqrt", "tan", "tanh", "trunc")


@functools.cache
def settle_vector_math() -> None:
    """Make the first call of each of torch's vector-math functions in this process,
    on one thread (see VECTOR_MATH_OPS). Cheap; once per process."""
    import torch
    for dtype in (torch.float32, torch.float64):
        x = torch.full((4,), 0.5, dtype=dtype)
        for name in VECTOR_MATH_OPS:
            getattr(torch, name)(x)


@functools.cache
def onednn_prepack_works(dtype) -> bool:
    """Whether this torch build reorders linear weights for oneDNN and computes with
    them (torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise) in `dtype`:
    probed once per dtype on a small GEMM against F.linear."""
    import torch
    import torch.nn.functional as F
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(40, 24, generator=g).to(dtype)
        x = torch.randn(12, 24, generator=g).to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return bool(torch.allclose(y.float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_cpu_args(cpu_kernels="auto", cpu_capability=None,
                   linear_bf16_max_rows=None,
                   greedy_head_max_rows=DEFAULT_GREEDY_HEAD_MAX_ROWS,
                   decode_layers=True) -> str | None:
    """ValueError naming the argument for a bad value; -> cpu_capability normalised."""
    from tokenmill import kernels
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, "
                         f"got {cpu_kernels!r}")
    if cpu_capability is not None:
        if not isinstance(cpu_capability, str):
            raise ValueError(f"cpu_capability must be a level name or None, "
                             f"got {cpu_capability!r}")
        level = cpu_capability.strip().lower()
        levels, runnable = kernels.all_levels(), kernels.runnable_levels()
        if level not in levels:
            raise ValueError(f"cpu_capability={cpu_capability!r} is not a CPU capability level "
                             f"of {_host.machine()}; the levels are {', '.join(levels)}")
        if level not in runnable:
            missing = sorted(kernels.LEVELS[level].cpu_flags - (kernels._cpu_flags() or frozenset()))
            raise ValueError(f"cpu_capability={level!r}: this CPU cannot run the {level} kernels"
                             f" (missing {', '.join(missing) or 'support'}); it runs "
                             f"{', '.join(runnable)}")
        cpu_capability = level
    if linear_bf16_max_rows is not None and (not _is_int(linear_bf16_max_rows)
                                             or linear_bf16_max_rows < 0):
        raise ValueError(f"linear_bf16_max_rows must be None (auto) or an int >= 0 (0: off), "
                         f"got {linear_bf16_max_rows!r}")
    if (not _is_int(greedy_head_max_rows)
            or not 0 <= greedy_head_max_rows <= GREEDY_HEAD_KERNEL_ROWS):
        raise ValueError(f"greedy_head_max_rows must be an int from 0 (off) to "
                         f"{GREEDY_HEAD_KERNEL_ROWS}, got {greedy_head_max_rows!r}")
    if not isinstance(decode_layers, bool):
        raise ValueError(f"decode_layers must be True or False, got {decode_layers!r}")
    return cpu_capability


@dataclass(frozen=True, kw_only=True)
class CpuPlatform(Platform):
    # What the machine is.
    arch: str                       # platform.machine()
    runnable_levels: tuple[str, ...]  # kernel levels this CPU executes, lowest first
    torch_capability: str           # torch.backends.cpu.get_cpu_capability()
    cpu_bf16: bool                  # the CPU has native bf16 GEMMs (AVX512-BF16 / AMX)
    # What was asked.
    cpu_kernels: str                # auto / native / torch
    capability_forced: bool         # a level below the CPU's best (argument or env)
    # What runs (the rest: Platform's fields).
    capability: str | None          # the kernel level (None: not a CPU device)
    kernels: str                    # "native" (ops) or "torch"

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def create(cls, device="cpu", model_dtype=None, *, cpu_kernels: str = "auto",
               cpu_capability: str | None = None,
               linear_bf16_max_rows: int | None = None,
               greedy_head_max_rows: int = DEFAULT_GREEDY_HEAD_MAX_ROWS,
               decode_layers: bool = True, tensor_parallel_size: int = 1) -> CpuPlatform:
        """The platform for a model of `model_dtype` (default fp32) on `device`."""
        import torch

        from tokenmill import kernels
        device = torch.device(device)
        model_dtype = model_dtype or torch.float32
        level = check_cpu_args(cpu_kernels, cpu_capability, linear_bf16_max_rows,
                               greedy_head_max_rows, decode_layers)
        runnable = tuple(kernels.runnable_levels())
        on_cpu = device.type == "cpu"
        forced_by_arg = level is not None
        if on_cpu and level is None:
            # The detected best, or what TOKENMILL_CPU_CAPABILITY / ATEN_CPU_CAPABILITY /
            # kernels.capability_override (tests) say.
            level = kernels.cpu_capability()
        levels = kernels.all_levels()
        below_avx512 = (level is not None and "avx512" in levels
                        and levels.index(level) < levels.index("avx512"))
        cpu_bf16 = cpu_has_native_bf16()
        ops = None
        if on_cpu and cpu_kernels != "torch":
            ops = kernels.cpu_ops(level) if forced_by_arg else kernels.cpu_ops()
            if ops is None and cpu_kernels == "native":
                raise ValueError("cpu_kernels='native': the native CPU kernels are not "
                                 "available here (no C++ compiler, or TOKENMILL_NO_NATIVE=1); "
                                 "use cpu_kernels='auto' or 'torch'")
        half = model_dtype in (torch.bfloat16, torch.float16)
        # The GEMM dtype rule: fp32 for half-precision models where bf16 is emulated; a
        # level forced below avx512 takes that path as an AVX2 CPU would.
        widen = on_cpu and half and (not cpu_bf16 or below_avx512)
        gemm = torch.float32 if widen else model_dtype
        if linear_bf16_max_rows is None:  # auto: see the module docstring
            # (vdpbf16ps where the CPU has AMX: oneDNN's AMX GEMM is 5-10x ahead at
            # batch, measured on a 2-core Xeon with AMX, bench.linear_rows)
            dot_gemm = (ops is not None and gemm == torch.bfloat16
                        and getattr(ops, "has_bf16_dot_gemm", False)
                        and (getattr(ops, "has_amx_gemm", False) or not cpu_has_amx()))
            linear_bf16_max_rows = (ALL_ROWS if widen or dot_gemm
                                    else DEFAULT_NATIVE_BF16_PACKED_ROWS)
        packed = (ops is not None and model_dtype == torch.bfloat16
                  and linear_bf16_max_rows > 0 and getattr(ops, "has_fast_linear_bf16", False))
        packed_f32 = (ops is not None and model_dtype == torch.float32
                      and getattr(ops, "has_fast_linear_bf16", False)
                      and hasattr(ops, "linear_f32"))
        # Prepacked oneDNN weights where the GEMMs run in the model's fp32 / bf16 and some
        # inputs take them (not where a packed-only layer takes every input).
        prepack = (on_cpu and cpu_kernels != "torch" and gemm == model_dtype
                   and model_dtype in (torch.float32, torch.bfloat16)
                   and not (packed and linear_bf16_max_rows >= ALL_ROWS)
                   and onednn_prepack_works(model_dtype))
        dense = (f"{dtype_name(gemm)} prepacked for oneDNN" if prepack else
                 f"{dtype_name(gemm)} (the model's)" if gemm == model_dtype else "fp32 copy")
        if packed_f32:
            weights = "packed fp32 + " + dense
        elif not packed:
            weights = dense
        elif linear_bf16_max_rows >= ALL_ROWS:
            weights = "packed bf16 only"
        else:
            weights = "packed bf16 + " + ("fp32 copy" if widen else dense)
        sharded = tensor_parallel_size > 1  # lm_head and layers need collectives inside
        greedy = ((packed or packed_f32) and greedy_head_max_rows > 0 and not sharded
                  and getattr(ops, "has_greedy_lm_head", False))
        packed_rows = linear_bf16_max_rows if packed else DEFAULT_F32_PACKED_ROWS
        quantized = (ops is not None and getattr(ops, "has_fast_linear_bf16", False)
                     and hasattr(ops, "linear_quant"))
        quantized_rows = (0 if not quantized else DEFAULT_QUANTIZED_ROWS
                          if gemm == torch.float32
                          else DEFAULT_QUANT_DOT_ROWS if getattr(ops, "has_quant_dot", False)
                          else DEFAULT_NATIVE_BF16_QUANTIZED_ROWS)
        # bf16 activations only: the 15-bit rounding is below a bf16's own, not an fp32's
        # (tiles in fp32: as many rows as the widening kernel takes, see above)
        quad_rows = (max(DEFAULT_QUAD_QUANTIZED_ROWS, quantized_rows) if gemm != model_dtype
                     else DEFAULT_AMX_QUAD_QUANTIZED_ROWS if getattr(ops, "has_amx_gemm", False)
                     else DEFAULT_QUAD_QUANTIZED_ROWS)
        quad_rows = (quad_rows if quantized and model_dtype == torch.bfloat16
                     and getattr(ops, "has_quant_quad", False)
                     and getattr(ops, "capability", None) in QUAD_LEVELS else 0)
        native = "native" if ops is not None else "torch"
        return cls(
            device=str(device), arch=_host.machine(), runnable_levels=runnable,
            torch_capability=str(torch.backends.cpu.get_cpu_capability()),
            cpu_bf16=cpu_bf16, cpu_kernels=cpu_kernels,
            capability_forced=bool(on_cpu and level and runnable and level != runnable[-1]),
            capability=level if on_cpu else None, kernels=native,
            model_dtype=dtype_name(model_dtype), gemm_dtype=dtype_name(gemm),
            linear="packed_bf16" if packed else "packed_f32" if packed_f32 else "torch",
            linear_bf16_max_rows=linear_bf16_max_rows if packed else 0,
            gemm="onednn_prepacked" if prepack else "torch", weights=weights,
            attention=native,
            norm=native if ops is not None and half else "torch", fp32_norm=native,
            activation=native,
            linear_attention="native" if hasattr(ops, "gated_delta_rule_qkv") else "torch",
            lm_head="greedy_int8" if greedy else "full",
            greedy_head_max_rows=min(greedy_head_max_rows, packed_rows) if greedy else 0,
            decode_layers=bool((packed or packed_f32) and decode_layers and not sharded
                               and hasattr(ops, "decode_layers")),
            linear_f32_max_rows=DEFAULT_F32_PACKED_ROWS if packed_f32 else 0,
            quantized_max_rows=quantized_rows, quantized_quad_max_rows=quad_rows,
            tensor_parallel_size=tensor_parallel_size, ops=ops)

    # ---- what it decided ---------------------------------------------------------------
    @property
    def fast_decode_rows(self) -> int | None:
        """Rows a decode step may have at about the cost of one: it takes the packed
        kernels and the native decode-layer loop (streaming the weights once) and, where
        the screen runs, the int8 greedy head (past its rows the full lm_head and the
        logits cost more than the extra rows save: measured with `bench spec` at 1 to 16
        requests). None: no such limit (the PyTorch path)."""
        if self.linear == "packed_f32":
            rows = self.linear_f32_max_rows
        elif self.linear == "packed_bf16" and self.linear_bf16_max_rows < ALL_ROWS:
            rows = self.linear_bf16_max_rows
        elif self.linear == "packed_bf16":
            rows = DEFAULT_NATIVE_BF16_PACKED_ROWS  # packed-only: the decode loop's limit too
        else:
            return None
        if self.lm_head == "greedy_int8":
            rows = min(rows, self.greedy_head_max_rows)
        return rows

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.capability is None:
            return (f"{self.device}: not a CPU device; PyTorch kernels, "
                    f"{self.model_dtype} model, GEMMs in {self.gemm_dtype}")
        best = self.runnable_levels[-1] if self.runnable_levels else "?"
        level = (f"level {self.capability} (forced; the CPU runs up to {best})"
                 if self.capability_forced else f"level {self.capability}")
        kernels = ("native" if self.kernels == "native"
                   else f"PyTorch (cpu_kernels={self.cpu_kernels})")
        bf16 = "yes" if self.cpu_bf16 else "no"
        if self.cpu_bf16 and self.model_dtype in ("bfloat16", "float16") and (
                self.gemm_dtype == "float32"):
            bf16 += ", unused below avx512"
        rows = ("every input" if self.linear_bf16_max_rows >= ALL_ROWS
                else f"up to {self.linear_bf16_max_rows} rows")
        linear = (f"packed_bf16 {rows}" if self.linear == "packed_bf16" else
                  f"packed_f32 up to {self.linear_f32_max_rows} rows" if self.linear == "packed_f32"
                  else "torch")
        if self.linear != "torch" and self.linear_bf16_max_rows < ALL_ROWS:
            linear += f", {self.gemm} above"
        elif self.linear == "torch":
            linear = self.gemm
        head = (f"greedy_int8 up to {self.greedy_head_max_rows} rows"
                if self.lm_head == "greedy_int8" else "full")
        # fp32 activations: RMSNorm keeps ATen's fused op, the norms it has none for
        # (Qwen3.5 / Qwen3-Next's zero-centred and gated ones) may still be native
        norm = (f"{self.norm} (zero-centred and gated norms {self.fp32_norm})"
                if self.norm != self.fp32_norm else self.norm)
        return (f"{self.arch} CPU, kernels {kernels} at {level}, native bf16 {bf16}; "
                f"{self.model_dtype} model, GEMMs in {self.gemm_dtype}; linear {linear}, weights {self.weights}, "
                f"attention {self.attention}, norm {norm}, activation {self.activation}, "
                f"linear attention {self.linear_attention}, "
                f"lm_head {head}, decode layers {'native' if self.decode_layers else 'python'}"
                + (f", int4 / int8 / fp8 weights native up to {self.quantized_max_rows} rows"
                   if self.quantized_max_rows else "")
                + (", dequantized to bf16 pairs for vdpbf16ps above"
                   if self.quantized_max_rows and self.gemm_dtype == "bfloat16"
                   and getattr(self.ops, "has_quant_dot", False) else "")
                + (f" ({self._quad_rows()} by integer dot products on 15-bit activations)"
                   if self.quantized_quad_max_rows else "")
                + (f"; tensor parallel over {self.tensor_parallel_size} ranks (gloo): decode "
                   f"layers and lm_head off the native paths (no collectives inside them)"
                   if self.tensor_parallel_size > 1 else ""))

    def _quad_rows(self) -> str:
        """"int4 / int8 up to N" (rows taking the quad kernel's integer products, past
        which it multiplies exactly), per width where the two differ."""
        rows = {bits: min(self.quantized_quad_max_rows,
                          quad_exact_from(self.capability, bits) - 1) for bits in (4, 8)}
        if rows[4] == rows[8]:
            return f"int4 / int8 up to {rows[4]}"
        return f"int4 up to {rows[4]}, int8 up to {rows[8]}"

    def in_this_process(self) -> CpuPlatform:
        """The same decisions with this process's kernels module (a tensor-parallel
        worker: the engine's module object does not cross the process boundary)."""
        if self.kernels != "native" or self.capability is None:
            return self
        from tokenmill import kernels
        return dataclasses.replace(self, ops=kernels.cpu_ops(self.capability))
