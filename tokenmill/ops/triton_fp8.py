"""float8_e4m3fn <-> fp32 in Triton by bit arithmetic, for the FP8 KV cache
(ops/triton_attention.py hands the kernels an fp8 cache as its uint8 codes).

No tl.float8e4nv: sm_80 has no e4m3 conversions, and the interpreter none at all; these
are the same integer and fp16 / fp32 operations on every GPU generation and on the CPU
under TRITON_INTERPRET. Imported only with triton_attention (it imports triton).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_e4m3(x):
    """fp32 -> float8_e4m3fn codes (uint8): nearest even, +-448 beyond the range, NaN
    0x7f; c10's fp8e4m3fn_from_fp32_value in lanes."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits ^ sign
    # below 2^-6 (e4m3's smallest normal): adding 2^14 (141 << 23) leaves the FPU to
    # round the value, in units of e4m3's smallest subnormal 2^-9, into the low bits
    sub = ((mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True)
           - (141 << 23))
    odd = (mag >> 20) & 1
    normal = (mag - (120 << 23) + 0x7FFFF + odd) >> 20  # exponent rebiased 127 -> 7
    normal = tl.where(normal == 0x7F, 0x7E, normal)
    code = tl.where(mag < (121 << 23), sub, normal)
    code = tl.where(mag >= (1087 << 20), tl.where(mag > 0x7F800000, 0x7F, 0x7E), code)
    return ((sign >> 24) | code).to(tl.uint8)


@triton.jit
def from_e4m3(code):
    """float8_e4m3fn codes (uint8) -> fp16, exact: the code's bits placed in an fp16's
    (sign 15, exponent and mantissa 13..7) are its value times 2^-8, subnormals too;
    times 2^8 in fp16 is exact (at most 448), and so is any widening after it. (fp16,
    not fp32: half the registers for the K/V tiles.)"""
    c = code.to(tl.uint16)
    h = ((c & 0x7F) << 7) | ((c & 0x80) << 8)
    return h.to(tl.float16, bitcast=True) * 256.0
