"""Paged attention in Triton: the KV write, batched decode and prefill over a cache prefix.

The cache of one layer is the CPU path's view (worker/kv_cache.py):
[num_blocks, 2, block_size, num_kv_heads, head_size], K at index 0, V at 1, the
last dim contiguous; a page may be padded (the block stride is whatever the view
says), so every kernel takes the strides. Token t of a request sits at block
block_table[t // block_size], offset t % block_size; block 0 is the null block.

* `write_kv`: k/v [T, Hkv, D] into the cache through `slot_mapping` (block id *
  block_size + offset); a slot of -1 writes nothing (the pad rows of a CUDA graph).
* `paged_decode`: one query token per row (GQA: one program per row and KV head
  takes the group's query heads as the rows of its tiles), keys 0..seq_len-1, or
  with a sliding `window` w only the last w of them (HF's mask: (p - w, p]). A row
  with seq_len 0 (a pad row) outputs zeros.
* `paged_prefill`: the prompt chunks of a step, flat: request r's queries are rows
  query_start_loc[r]..[r+1]-1, at positions seq_len - query_len + i; each attends
  causally over everything its request has in the cache (the chunk's own K/V was
  written first), through the block table; with a window only the keys in it, so
  a block given back before the window is never read.

Any head size up to 512: the head dim is a power-of-two block (HEAD_PAD) with the
tail masked on every load and store, picked per call; a power of two takes no
extra mask (the constexpr branches compile it away). Soft-capped attention (Gemma
2 style, `softcap` > 0): scores = cap * tanh(scores / cap) after the scale and
before the mask and softmax, as the CPU path does.

Scores and the softmax run in fp32 (online softmax, one pass over the keys); the
products of an fp32 model use IEEE fp32 (no TF32), so they follow the CPU path
to rounding. Imported only where the platform picks Triton: it imports triton.

An fp8 cache (float8_e4m3fn, --kv-cache-dtype fp8) is handed to the kernels as its
uint8 bits (FP8): the writes divide K / V by the layer's k_scale / v_scale in fp32,
round to nearest even and saturate at +-448 in integer and fp32 arithmetic (`to_e4m3`,
c10's algorithm, so the codes equal torch's cast), the reads widen the codes through
fp16 bits (`from_e4m3`), multiply by the scale in fp32 and round to the queries' dtype
(as the PyTorch reference's `from_cache`; both conversions in ops/triton_fp8.py).
The scales default to 1.0, which leaves every value as it was without them.
Bit arithmetic rather than tl.float8e4nv: the same code on every GPU generation
(sm_80 has no e4m3 conversions) and under the interpreter.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill.ops.triton_fp8 import from_e4m3, to_e4m3


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ckv, stride_ct, stride_ch,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_PAD: tl.constexpr, FP8: tl.constexpr = False):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    valid = (d * 0 + slot) >= 0  # -1: a pad row, nothing to write
    safe = tl.maximum(slot, 0)
    blk = safe // BLOCK_SIZE
    off = safe % BLOCK_SIZE
    if HEAD_PAD == HEAD_DIM:
        key = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
        val = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
    else:  # the head dim's tail past HEAD_DIM is another head's (or nothing)
        in_head = d < HEAD_DIM
        valid = valid & in_head
        key = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=in_head, other=0.0)
        val = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=in_head, other=0.0)
    dst = cache_ptr + blk * stride_cb + off * stride_ct + h * stride_ch + d
    if FP8:
        tl.store(dst, to_e4m3(key.to(tl.float32) / k_scale), mask=valid)
        tl.store(dst + stride_ckv, to_e4m3(val.to(tl.float32) / v_scale), mask=valid)
    else:
        tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=valid)
        tl.store(dst + stride_ckv, val.to(cache_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _tile_mask(rows_ok, d, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """The load / store mask of an [M, HEAD_PAD] tile: its valid rows, and with a head
    size that is not a power of two the columns before HEAD_DIM."""
    mask = rows_ok[:, None]
    if HEAD_PAD != HEAD_DIM:
        mask = mask & (d < HEAD_DIM)[None, :]
    return mask


@triton.jit
def _tanh(x):
    """fp32 tanh from exp (the interpreter has no libdevice): (1 - e) / (1 + e) with
    e = exp(-2|x|), and its Taylor series to x^9 below |x| = 1/4, where 1 - e would
    cancel (soft-capped scores / cap sit mostly there); a few ulp off torch.tanh."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    a2 = a * a
    near = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (
        -0.05396825396825397 + a2 * 0.021869488536155203))))
    t = tl.where(a < 0.25, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(q, k, IEEE: tl.constexpr, USE_DOT: tl.constexpr):
    """q [M, D] . k [N, D]^T -> [M, N] fp32."""
    if USE_DOT:
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
    else:  # head_dim below tl.dot's minimum of 16
        s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
    return s


@triton.jit
def _weighted(p, v, IEEE: tl.constexpr, USE_DOT: tl.constexpr):
    """p [M, N] fp32 . v [N, D] -> [M, D] fp32 (p rounded to v's dtype first, as the
    PyTorch path rounds its probabilities)."""
    if USE_DOT:
        if IEEE:
            o = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            o = tl.dot(p.to(v.dtype), v)
    else:
        o = tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * v[None, :, :].to(tl.float32),
                   axis=1)
    return o


@triton.jit
def _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_row_ptr, kvh, k_start, k_end,
                 qpos, window, scale, softcap, k_scale, v_scale,
                 stride_cb, stride_ckv, stride_ct, stride_ch,
                 HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                 USE_DOT: tl.constexpr, FP8: tl.constexpr):
    """Online softmax over keys k_start..k_end-1 for queries at positions qpos [M]
    (causal; a window > 0 keeps keys in (qpos - window, qpos]). The masked tail of
    the head dim loads zeros: it adds nothing to the scores or the output."""
    d = tl.arange(0, HEAD_PAD)
    for s in range(k_start, k_end, BLOCK_N):
        kpos = s + tl.arange(0, BLOCK_N)
        kin = kpos < k_end
        blk = tl.load(bt_row_ptr + kpos // BLOCK_SIZE, mask=kin, other=0).to(tl.int64)
        base = blk * stride_cb + (kpos % BLOCK_SIZE) * stride_ct + kvh * stride_ch
        kv_mask = _tile_mask(kin, d, HEAD_DIM, HEAD_PAD)
        k = tl.load(cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + stride_ckv + base[:, None] + d[None, :], mask=kv_mask,
                    other=0.0)
        if FP8:  # e4m3 codes times the layer's scale, in the queries' dtype
            k = (from_e4m3(k).to(tl.float32) * k_scale).to(q.dtype)
            v = (from_e4m3(v).to(tl.float32) * v_scale).to(q.dtype)
        visible = kin[None, :] & (kpos[None, :] <= qpos[:, None])
        if window > 0:
            visible = visible & (kpos[None, :] > qpos[:, None] - window)
        raw = _scores(q, k, IEEE, USE_DOT) * scale
        if SOFTCAP:  # capped before the mask, as the CPU path
            raw = softcap * _tanh(raw / softcap)
        scores = tl.where(visible, raw, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen no visible key yet keeps m = -inf: shift by 0 instead.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _weighted(p, v, IEEE, USE_DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_decode_kernel(q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, scale, window,
                         softcap, k_scale, v_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_cb, stride_ckv, stride_ct, stride_ch, stride_bt,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                         IEEE: tl.constexpr, USE_DOT: tl.constexpr, FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    in_group = g < GROUP
    heads = kvh * GROUP + g
    q_mask = _tile_mask(in_group, d, HEAD_DIM, HEAD_PAD)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    k_start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    qpos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_ptr + row * stride_bt, kvh,
                                 k_start, seq_len, qpos, window, scale, softcap,
                                 k_scale, v_scale, stride_cb, stride_ckv, stride_ct, stride_ch,
                                 HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_N, SOFTCAP, IEEE,
                                 USE_DOT, FP8)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a pad row (seq_len 0): zeros
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _paged_decode_split_kernel(q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, part_ptr, ml_ptr,
                               scale, window, softcap, k_scale, v_scale,
                               stride_qt, stride_qh,
                               stride_cb, stride_ckv, stride_ct, stride_ch, stride_bt,
                               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                               HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                               BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                               NUM_SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
                               IEEE: tl.constexpr, USE_DOT: tl.constexpr,
                               FP8: tl.constexpr):
    """Split-K decode: split s of a row's keys -> its unnormalised output and (m, l)
    per query head, in part [N, Hq, S, D] and ml [N, Hq, S, 2] (fp32)."""
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    in_group = g < GROUP
    heads = kvh * GROUP + g
    q_mask = _tile_mask(in_group, d, HEAD_DIM, HEAD_PAD)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Splits of whole BLOCK_N tiles, so a split's tiles are the single pass's tiles.
    tiles = tl.cdiv(seq_len - first, BLOCK_N)
    per = tl.cdiv(tiles, NUM_SPLITS) * BLOCK_N
    k_start = first + split * per
    k_end = tl.minimum(k_start + per, seq_len)
    qpos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_ptr + row * stride_bt, kvh,
                                 k_start, k_end, qpos, window, scale, softcap,
                                 k_scale, v_scale, stride_cb, stride_ckv, stride_ct, stride_ch,
                                 HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_N, SOFTCAP, IEEE,
                                 USE_DOT, FP8)
    at = (row * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split  # (row, head, split)
    tl.store(part_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
    tl.store(ml_ptr + at * 2, m_i, mask=in_group)
    tl.store(ml_ptr + at * 2 + 1, l_i, mask=in_group)


@triton.jit
def _combine_splits_kernel(part_ptr, ml_ptr, out_ptr, stride_ot, stride_oh,
                           NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEAD_PAD: tl.constexpr):
    """out[row, head] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_PAD)
    base = (row * tl.num_programs(1) + head) * NUM_SPLITS + sp
    m = tl.load(ml_ptr + base * 2)
    l_s = tl.load(ml_ptr + base * 2 + 1)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_safe)  # a split that saw no key: m = -inf, weight 0
    total = tl.sum(w * l_s, axis=0)
    out_ptrs = out_ptr + row * stride_ot + head * stride_oh + d
    if HEAD_PAD == HEAD_DIM:
        part = tl.load(part_ptr + base[:, None] * HEAD_DIM + d[None, :])
    else:
        part = tl.load(part_ptr + base[:, None] * HEAD_DIM + d[None, :],
                       mask=(d < HEAD_DIM)[None, :], other=0.0)
    acc = tl.sum(w[:, None] * part, axis=0)
    out = (acc / tl.where(total > 0, total, 1.0)).to(out_ptr.dtype.element_ty)
    if HEAD_PAD == HEAD_DIM:
        tl.store(out_ptrs, out)
    else:
        tl.store(out_ptrs, out, mask=d < HEAD_DIM)


@triton.jit
def _paged_prefill_kernel(q_ptr, cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
                          scale, window, softcap, k_scale, v_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_cb, stride_ckv, stride_ct, stride_ch, stride_bt,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                          USE_DOT: tl.constexpr, FP8: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r)
    context = seq_len - q_len
    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    in_chunk = i < q_len
    qpos = context + i
    d = tl.arange(0, HEAD_PAD)
    rows = (q_start + i).to(tl.int64)
    q_mask = _tile_mask(in_chunk, d, HEAD_DIM, HEAD_PAD)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    kvh = h // GROUP
    first_q = context + mb * BLOCK_M
    k_end = tl.minimum(seq_len, first_q + BLOCK_M)  # causal: nothing past the tile's last query
    # With a window the tile's first query sees nothing before first_q - window + 1.
    k_start = tl.where(window > 0, tl.maximum(first_q - window + 1, 0), 0)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_ptr + r * stride_bt, kvh,
                                 k_start, k_end, qpos, window, scale, softcap,
                                 k_scale, v_scale, stride_cb, stride_ckv, stride_ct, stride_ch,
                                 HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_N, SOFTCAP, IEEE,
                                 USE_DOT, FP8)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


MAX_HEAD_SIZE = 512


def _check_cache(cache: torch.Tensor) -> None:
    if cache.dim() != 5 or cache.shape[1] != 2 or cache.stride(4) != 1:
        raise ValueError(f"kv cache must be a [num_blocks, 2, block_size, num_kv_heads, "
                         f"head_size] view with a contiguous last dim, got "
                         f"{tuple(cache.shape)} strides {cache.stride()}")
    head = cache.shape[4]
    if not 0 < head <= MAX_HEAD_SIZE:
        raise ValueError(f"head_size must be at most {MAX_HEAD_SIZE}, got {head}")


def _check_query(q: torch.Tensor, cache: torch.Tensor, softcap: float) -> None:
    if q.shape[2] != cache.shape[4]:
        raise ValueError(f"head_size of q ({q.shape[2]}) and of the kv cache "
                         f"({cache.shape[4]}) differ")
    if q.shape[1] % cache.shape[3]:
        raise ValueError(f"num_heads {q.shape[1]} must be a multiple of num_kv_heads "
                         f"{cache.shape[3]}")
    if softcap < 0:
        raise ValueError(f"logit_softcap must be positive (0: off), got {softcap}")


def _cache_strides(cache: torch.Tensor):
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)


def _head(d: int) -> dict:
    """The head dim and the power-of-two block it is computed in (tail masked)."""
    return dict(HEAD_DIM=d, HEAD_PAD=triton.next_power_of_2(d))


def _flags(q: torch.Tensor, cache: torch.Tensor) -> dict:
    return dict(IEEE=q.dtype == torch.float32,
                USE_DOT=triton.next_power_of_2(cache.shape[4]) >= 16,
                FP8=cache.dtype == torch.float8_e4m3fn)


def _cache_arg(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels read: an fp8 cache as its uint8 codes (same strides)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def _block_n(d: int) -> int:
    return 32 if triton.next_power_of_2(d) <= 128 else 16


def _launch(d: int) -> dict:
    """Launch options: the compiler's defaults up to a 256 block; a 512 block (head
    sizes 257..512, Gemma 4's global layers) takes 8 warps for its [16, 512] fp32
    accumulator and 2 pipeline stages. Compiled for sm_90 (ops/triton_compile.py)
    that is 80-128 registers a thread where the defaults take 168-212, and at most
    99392 B of shared memory (fp32 cache), which also fits the 99 KB parts; which
    is faster is not yet measured on a GPU."""
    return dict(num_warps=8, num_stages=2) if triton.next_power_of_2(d) > 256 else {}


def _check_kv_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    k_scale, v_scale = float(k_scale), float(v_scale)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (s > 0 and s != float("inf")):
            raise ValueError(f"{name} must be a finite positive number, got {s}")
    if (k_scale, v_scale) != (1.0, 1.0) and cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"k_scale / v_scale apply to a float8_e4m3fn cache only, not "
                         f"{cache.dtype}")
    return k_scale, v_scale


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k/v [T, Hkv, D] -> cache at slot_mapping [T] (int64; -1: skipped); an fp8 cache
    stores k / k_scale and v / v_scale."""
    _check_cache(cache)
    k_scale, v_scale = _check_kv_scales(cache, k_scale, v_scale)
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    _kv_write_kernel[(t, hkv)](k, v, _cache_arg(cache), slot_mapping, k_scale, v_scale,
                               k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               *_cache_strides(cache), BLOCK_SIZE=cache.shape[2], **_head(d),
                               FP8=cache.dtype == torch.float8_e4m3fn)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_splits(num_rows: int, num_kv_heads: int, device: torch.device) -> int:
    """How many splits of the keys a decode step takes: enough programs to fill the
    GPU's SMs twice when rows x KV heads alone do not (batch 1 has 8 programs for 8
    KV heads), at most MAX_DECODE_SPLITS; 1 off CUDA. Depends on the shapes only, so
    a captured CUDA graph keeps it."""
    if device.type != "cuda":
        return 1
    programs = max(num_rows * num_kv_heads, 1)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return min(MAX_DECODE_SPLITS, triton.next_power_of_2(triton.cdiv(2 * sms, programs)))


MAX_DECODE_SPLITS = 16


def paged_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int = 0,
                 out: torch.Tensor | None = None, num_splits: int | None = None,
                 softcap: float = 0.0, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> torch.Tensor:
    """q [N, Hq, D], block_table [N, >= blocks of the longest row] (int32),
    seq_lens [N] (int32; 0: a pad row) -> [N, Hq, D]. `num_splits` (a power of two;
    None: `decode_splits`): the keys of each row in that many parts run by programs
    of their own, then combined (split-K, for batches too small to fill the GPU).
    `softcap` > 0: scores soft-capped at it (0: off). `k_scale` / `v_scale`: an fp8
    cache's per-layer scales (its values are the codes times them)."""
    _check_cache(cache)
    k_scale, v_scale = _check_kv_scales(cache, k_scale, v_scale)
    softcap = float(softcap or 0.0)
    _check_query(q, cache, softcap)
    n, hq, d = q.shape
    hkv = cache.shape[3]
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if n == 0:
        return out
    group = hq // hkv
    splits = decode_splits(n, hkv, q.device) if num_splits is None else num_splits
    if splits & (splits - 1) or splits < 1:
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    shapes = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), **_head(d),
                  BLOCK_SIZE=cache.shape[2], BLOCK_N=_block_n(d), SOFTCAP=softcap > 0,
                  **_flags(q, cache), **_launch(d))
    if splits > 1:
        part = torch.empty(n, hq, splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(n, hq, splits, 2, dtype=torch.float32, device=q.device)
        _paged_decode_split_kernel[(n, hkv, splits)](
            q, _cache_arg(cache), block_table, seq_lens, part, ml, float(scale), int(window or 0), softcap,
            k_scale, v_scale,
            q.stride(0), q.stride(1), *_cache_strides(cache), block_table.stride(0),
            NUM_SPLITS=splits, **shapes)
        _combine_splits_kernel[(n, hq)](part, ml, out, out.stride(0), out.stride(1),
                                        NUM_SPLITS=splits, **_head(d))
        return out
    _paged_decode_kernel[(n, hkv)](
        q, _cache_arg(cache), block_table, seq_lens, out, float(scale), int(window or 0), softcap,
        k_scale, v_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(cache), block_table.stride(0), **shapes)
    return out


def paged_prefill(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                  scale: float, window: int = 0,
                  out: torch.Tensor | None = None, softcap: float = 0.0,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q [T, Hq, D] (the chunks' queries, flat), block_table [R, >= blocks of the
    longest request] (int32), query_start_loc [R + 1], seq_lens [R] (int32; the
    cached tokens + this chunk) -> [T, Hq, D]. `softcap`, `k_scale`, `v_scale` as in
    `paged_decode`."""
    _check_cache(cache)
    k_scale, v_scale = _check_kv_scales(cache, k_scale, v_scale)
    softcap = float(softcap or 0.0)
    _check_query(q, cache, softcap)
    t, hq, d = q.shape
    hkv = cache.shape[3]
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    num_reqs = seq_lens.shape[0]
    if t == 0 or num_reqs == 0:
        return out
    block_m = 16 if max_query_len <= 16 or triton.next_power_of_2(d) > 128 else 32
    grid = (num_reqs, hq, triton.cdiv(max_query_len, block_m))
    _paged_prefill_kernel[grid](
        q, _cache_arg(cache), block_table, query_start_loc, seq_lens, out, float(scale), int(window or 0),
        softcap, k_scale, v_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(cache), block_table.stride(0),
        GROUP=hq // hkv, **_head(d), BLOCK_SIZE=cache.shape[2], BLOCK_M=block_m,
        BLOCK_N=_block_n(d), SOFTCAP=softcap > 0, **_flags(q, cache), **_launch(d))
    return out
