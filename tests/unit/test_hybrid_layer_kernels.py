"""The native kernels around Gated DeltaNet's delta rule (Qwen3.5 / Qwen3-Next), at every
level this CPU runs, against the layer's PyTorch code on the same inputs: the causal
conv1d + SiLU (kernels/cpu_causal_conv.cpp) over several sequences and decode rows
with their conv state slots, and the zero-centered and gated RMSNorms (cpu_norm.cpp), the
first with the residual add folded in.
In bf16 the roundings are the PyTorch path's, so all but a few elements (sums taken
in another order landing on the other side of a rounding) are equal bit for bit."""
import pytest
import torch

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.gated_deltanet import GatedRMSNorm, conv1d_decode, conv1d_prefill
from tokenmill.models.qwen3_next import ZeroCenteredRMSNorm

DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(got, want, dtype, max_off=0.002):
    """fp32: close to rounding; bf16: equal but for at most `max_off` of the elements,
    which are one bf16 step apart."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    off = got != want
    assert off.float().mean().item() <= max_off, f"{int(off.sum())} of {off.numel()} differ"
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def conv_inputs(lens, channels, kernel, slots, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    proj = (torch.randn(t, channels + 5, generator=gen) * scale).to(dtype)
    x = proj[:, :channels]  # a column slice, as the layer's split leaves it
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).to(dtype)
    state = torch.randn(slots, kernel - 1, channels, generator=gen).to(dtype)
    cu = torch.tensor([0] + lens).cumsum(0)
    return x, weight, state, cu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels,kernel", [(1024, 4), (70, 4), (33, 2), (16, 1)])
def test_conv_sequences_match_the_pytorch_path(ops, dtype, channels, kernel):
    """Sequences shorter than the kernel (their state partly the old one), an empty one,
    long ones; read and write slots alike and apart."""
    lens = [5, 1, 0, 40, 2]
    read, write = [0, 1, 2, 3, 4], [0, 5, 6, 3, 7]
    x, weight, state, cu = conv_inputs(lens, channels, kernel, 9, dtype)
    want_state = state.clone()
    want = []
    for n in range(len(lens)):
        s, e = cu[n].item(), cu[n + 1].item()
        want_state[write[n]] = want_state[read[n]]
        if e > s:  # (F.conv1d refuses an input shorter than its kernel)
            want.append(conv1d_prefill(x[s:e], want_state, write[n], weight, None))
    want = torch.cat(want)
    got_state = state.clone()
    got = ops.causal_conv1d_silu(x, got_state, weight, cu, torch.tensor(read),
                                 torch.tensor(write))
    assert_matches(got, want, dtype)
    assert torch.equal(got_state, want_state)  # the inputs themselves: exact


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_decode_rows(ops, dtype):
    """One-token sequences (decode rows, slots out of order, some written elsewhere):
    rounded as F.conv1d rounds a window (HF's decode update convolves the window
    too), which in bf16 is not conv1d_decode's product-by-product rounding: fp32
    matches that one as well."""
    x, weight, state, _ = conv_inputs([1] * 7, 96, 4, 10, dtype, seed=2)
    slots, write = torch.tensor([9, 0, 4, 2, 7, 1, 3]), torch.tensor([8, 0, 5, 2, 6, 1, 3])
    want_state = state.clone()
    want = []
    for r in range(7):
        want_state[write[r]] = want_state[slots[r]]
        want.append(conv1d_prefill(x[r:r + 1], want_state, int(write[r]), weight, None))
    got_state = state.clone()
    got = ops.causal_conv1d_silu(x, got_state, weight, torch.arange(8), slots, write)
    assert_matches(got, torch.cat(want), dtype)
    assert torch.equal(got_state, want_state)
    if dtype == torch.float32:
        assert_matches(got, conv1d_decode(x, state.clone(), slots, weight, None, write), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_large_negative_sums_take_atens_exp(ops, dtype):
    """Sums below -88.3 (where the vector exp clamps): -0 / the tiny values of std::exp."""
    x, weight, state, cu = conv_inputs([30], 64, 4, 1, dtype, seed=4, scale=60.0)
    want = conv1d_prefill(x, state.clone(), 0, weight, None)
    got = ops.causal_conv1d_silu(x, state.clone(), weight, cu, torch.tensor([0]), torch.tensor([0]))
    assert (want.float() < -1e-30).any() or (want == 0).any()
    assert_matches(got, want, dtype)


def test_conv_refusals(ops):
    x, weight, state, cu = conv_inputs([3, 2], 16, 4, 3, torch.float32)
    s = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.causal_conv1d_silu(x, state.bfloat16(), weight, cu, s, s)
    with pytest.raises(RuntimeError, match="reads a slot another one writes"):
        ops.causal_conv1d_silu(x, state, weight, cu, torch.tensor([0, 1]), torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="1 <= K <= 8"):
        ops.causal_conv1d_silu(x, torch.zeros(3, 16, 8), torch.zeros(16, 9), cu, s, s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(300, 512), (7, 4, 64), (5, 3, 20)])
def test_zero_centered_norm_matches_the_module(ops, dtype, shape):
    gen = torch.Generator().manual_seed(1)
    norm = ZeroCenteredRMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen) * 0.2)
    norm = norm.to(dtype)
    wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)
    x = wide[..., :shape[-1]]  # strided rows, as q_norm sees them
    got = ops.rms_norm_zero_centered(x, norm.weight, norm.eps)
    assert_matches(got, norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim", [(8, 64), (3, 20)])
def test_gated_norm_matches_the_module(ops, dtype, heads, dim):
    gen = torch.Generator().manual_seed(2)
    norm = GatedRMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(dim, generator=gen) * 0.2)
    norm = norm.to(dtype)
    t = 50
    core = torch.randn(t, heads, dim, generator=gen)  # the delta rule's fp32 output
    proj = torch.randn(t, heads * dim + 9, generator=gen) * 4
    proj[3, :20] = -120.0  # silu(z) past the vector exp's range
    z = proj.to(dtype)[:, :heads * dim].reshape(t, heads, dim)
    got = ops.gated_rms_norm(core, z, norm.weight, norm.eps)
    assert_matches(got, norm(core.to(dtype), z), dtype)
    # x already in the model dtype takes the same path
    got = ops.gated_rms_norm(core.to(dtype), z, norm.weight, norm.eps)
    assert_matches(got, norm(core.to(dtype), z), dtype)


def test_a_conv_kernel_past_the_native_limit_keeps_the_pytorch_conv(ops):
    """A linear_conv_kernel_dim the native conv does not take (> 8) is not handed to
    it (it would refuse mid-step): the layer runs PyTorch's conv, the rule stays native."""
    from tokenmill.attention.metadata import AttentionMetadata, StateMetadata
    from tokenmill.models.layers.gated_deltanet import NATIVE_CONV_MAX_KERNEL, GatedDeltaNet
    torch.manual_seed(0)
    outs = []
    for kernel in (NATIVE_CONV_MAX_KERNEL, NATIVE_CONV_MAX_KERNEL + 2):
        layer = GatedDeltaNet(32, 2, 2, 8, 8, kernel, 1e-6)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.3)
        layer.in_proj.weight.data.normal_(0, 0.3)
        layer.out_proj.weight.data.normal_(0, 0.3)
        layer.set_linear_attention("native", ops)
        conv_calls = []
        conv = layer._native.conv
        layer._native = layer._native._replace(
            conv=lambda *a, _c=conv: conv_calls.append(1) or _c(*a))
        layer.state = (torch.zeros(2, *layer.state_shapes()[0]),
                       torch.zeros(2, 2, 8, 8))
        sm = StateMetadata(0, torch.tensor([1]), prefills=[(0, 5, 1)],
                           query_start_loc=torch.tensor([0, 5]))
        meta = AttentionMetadata.__new__(AttentionMetadata)
        meta.state = sm
        out = layer(torch.randn(5, 32), meta)
        assert torch.isfinite(out).all()
        outs.append(bool(conv_calls))
    assert outs == [True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,dim", [(300, 512), (7, 64), (5, 20), (1, 1)])
def test_add_zero_centered_norm_is_the_add_then_the_norm(ops, dtype, rows, dim):
    """add_rms_norm_zero_centered_: the residual stream += x in place (rounded to the
    dtype) and the zero-centered norm of it, bit for bit the two kernels one after the
    other; x a column slice (rows of a wider stride), odd widths (the scalar tails)."""
    gen = torch.Generator().manual_seed(3)
    residual = (torch.randn(rows, dim, generator=gen) * 2).to(dtype)
    x = (torch.randn(rows, dim + 3, generator=gen)).to(dtype)[:, :dim]
    weight = (torch.randn(dim, generator=gen) * 0.3).to(dtype)
    want_res = residual + x
    want = ops.rms_norm_zero_centered(want_res, weight, 1e-6)
    got_res = residual.clone()
    got = ops.add_rms_norm_zero_centered_(got_res, x, weight, 1e-6)
    assert torch.equal(got_res, want_res)
    assert torch.equal(got, want)


def test_add_zero_centered_norm_refusals(ops):
    residual, x, w = torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(8)
    with pytest.raises(RuntimeError, match="residual must be contiguous"):
        ops.add_rms_norm_zero_centered_(residual.t(), x.t(), torch.zeros(4), 1e-6)
    with pytest.raises(RuntimeError, match="x must be shaped like residual"):
        ops.add_rms_norm_zero_centered_(residual, x[:3], w, 1e-6)
    with pytest.raises(RuntimeError, match="x must be shaped like residual"):
        ops.add_rms_norm_zero_centered_(residual, x.bfloat16(), w, 1e-6)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.add_rms_norm_zero_centered_(residual, x, w.bfloat16(), 1e-6)
