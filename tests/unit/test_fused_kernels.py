"""Fused decoder-layer kernels (tokenmill/kernels/cpu_fused.cpp) against the PyTorch chains
they replace, at every capability level this CPU runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.rotary import RotaryEmbedding


def hf_head_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_norm", [True, False])
# Head and rotary sizes that are not multiples of the vector width (40, 24: a
# vector part and a scalar tail at 8 lanes, a tail only at 16) as well as ones that are.
@pytest.mark.parametrize("d,rotary_dim", [(64, 64), (64, 16), (40, 24), (40, 40)])
@pytest.mark.parametrize("t", [1, 5, 37])
def test_qk_norm_rope_matches_the_torch_chain(ops, dtype, qk_norm, d, rotary_dim, t):
    hq, hkv, eps = 8, 2, 1e-6
    g = torch.Generator().manual_seed(t * 10 + rotary_dim)
    rot = RotaryEmbedding(d, rotary_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.randint(0, 4096, (t,), generator=g)
    cos, sin = rot.cos_sin(positions, dtype)
    # Rows wider than q + k + v: a strided view, as after a fused projection.
    wide = (torch.randn(t, (hq + 2 * hkv) * d + 32, generator=g) * 2).to(dtype)
    qkv = wide[:, :(hq + 2 * hkv) * d]
    qw = torch.randn(d, generator=g).to(dtype) if qk_norm else torch.empty(0)
    kw = torch.randn(d, generator=g).to(dtype) if qk_norm else torch.empty(0)
    q_ref, k_ref, v_ref = qkv.clone().split([hq * d, hkv * d, hkv * d], dim=-1)
    q_ref, k_ref = q_ref.reshape(t, hq, d), k_ref.reshape(t, hkv, d)
    if qk_norm:
        q_ref, k_ref = hf_head_norm(q_ref, qw, eps), hf_head_norm(k_ref, kw, eps)
    q_ref, k_ref = rot.apply(q_ref, cos, sin), rot.apply(k_ref, cos, sin)

    q = ops.qk_norm_rope(qkv, qw, kw, cos, sin, hq, hkv, d, rotary_dim, eps)
    k = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:]
    assert q.shape == (t, hq, d) and q.is_contiguous() and q.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    torch.testing.assert_close(v, v_ref.reshape(t, -1), rtol=0, atol=0)  # v untouched
    if not qk_norm:  # no mean to sum: every rounding is the chain's, bit for bit
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    elif dtype != torch.float32:  # the mean's summation order moves a few roundings
        assert (q == q_ref).float().mean() > 0.97


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_matches_the_torch_chain(ops, dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(9, 2 * 100, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(100, dim=-1)
    ref = F.silu(gate) * up
    out = ops.silu_mul(gate_up)
    assert out.shape == (9, 100) and out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)
    if dtype != torch.float32:
        assert (out == ref).float().mean() > 0.97


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_extreme_gates_as_aten(ops, dtype):
    """Gates past fp32 exp's range give ATen's zeros (silu(-100) = -0), and NaN / inf
    what ATen gives, though the vector exp clamps its argument there."""
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(4, 40, generator=g) * 4
    gate[0, 3], gate[0, 17] = -100.0, -88.6
    gate[1, 5], gate[1, 30] = 90.0, -87.0
    gate[2, 1], gate[2, 2] = float("inf"), float("-inf")
    gate[3, 9] = float("nan")
    up = torch.randn(4, 40, generator=g)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    ref = F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    out = ops.silu_mul(gate_up)
    assert torch.equal(out == 0, ref == 0) and torch.equal(out.isnan(), ref.isnan())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("width", [100, 3000])  # 3000: more than one chunk per row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_tanh_mul_matches_the_torch_chain(ops, dtype, width):
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(5, 2 * width, generator=g) * 4).to(dtype)
    gate_up[0, 3], gate_up[1, 7], gate_up[2, 11] = -100.0, 90.0, -9.0  # exp's range ends
    gate, up = gate_up.split(width, dim=-1)
    ref = F.gelu(gate, approximate="tanh") * up
    out = ops.gelu_tanh_mul(gate_up)
    assert out.shape == (5, width) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if dtype != torch.float32:
        # Where ATen's 0.5 x (1 + tanh(z)) has not cancelled to (nearly) 0: the kernel's
        # x * sigmoid(2 z) keeps the tiny negative tail ATen rounds away.
        big = ref.float().abs() > 1e-3
        assert (out == ref)[big].float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_matches_index_put(ops, dtype):
    g = torch.Generator().manual_seed(2)
    nb, bs, hkv, d, t = 6, 4, 2, 8, 7
    cache = torch.randn(nb, 2, bs, hkv, d, generator=g).to(dtype)
    ref = cache.clone()
    kv = torch.randn(t, 3 * hkv * d, generator=g).to(dtype)  # strided k / v views
    k = kv[:, hkv * d:2 * hkv * d].view(t, hkv, d)
    v = kv[:, 2 * hkv * d:].view(t, hkv, d)
    slot_block = torch.tensor([1, 1, 5, 3, 0, 2, 5])
    slot_offset = torch.tensor([0, 3, 2, 1, 1, 0, 3])
    ref[slot_block, 0, slot_offset] = k
    ref[slot_block, 1, slot_offset] = v
    ops.kv_cache_write(cache, k, v, slot_block, slot_offset)
    assert torch.equal(cache, ref)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.kv_cache_write(cache, k, v, slot_block + 10, slot_offset)
