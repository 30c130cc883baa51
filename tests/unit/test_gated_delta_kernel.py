"""The native Gated DeltaNet delta rule (kernels/cpu_gated_delta.cpp) at every level this
CPU runs, against the recurrence in float64: several sequences of one call (empty,
one token, long) from their own state slots, read and write slots apart and alike,
value heads sharing q/k heads, head sizes off the vector width (the scalar tails),
strided q/k/v; the slots it must refuse; the PyTorch chunked form beside it; and the
entry that takes the layer's conv output and gate inputs (gated_delta_rule_qkv)."""
import pytest
import torch

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.gated_deltanet import delta_rule_chunked, l2_normalize


def recurrence(q, k, v, g, beta, state, cu, read, write):
    """The rule as written (S <- aS; u = beta (v - S k); S += u k^T; o = S q), float64,
    on a copy of the state; returns (out, state)."""
    state = state.double().clone()
    rep = v.shape[1] // q.shape[1]
    q, k = (x.double().repeat_interleave(rep, dim=1) for x in (q, k))
    v, g, beta = v.double(), g.double(), beta.double()
    out = torch.zeros(v.shape, dtype=torch.float64)
    for n in range(len(read)):
        s = state[read[n]].clone()  # [H, Dv, Dk]
        for t in range(cu[n], cu[n + 1]):
            s = s * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - (s @ k[t][..., None])[..., 0])
            s = s + u[..., None] * k[t][:, None, :]
            out[t] = (s @ q[t][..., None])[..., 0]
        state[write[n]] = s
    return out, state


def inputs(lens, hk, hv, dk, dv, slots, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    if strided:  # q, k, v as views into one packed row per token, as the layer has them
        packed = torch.randn(t, 2 * hk * dk + hv * dv + 3, generator=gen) * 0.1
        q = packed[:, :hk * dk].view(t, hk, dk)
        k = packed[:, hk * dk:2 * hk * dk].view(t, hk, dk)
        v = packed[:, 2 * hk * dk:2 * hk * dk + hv * dv].view(t, hv, dv)
    else:
        q, k, v = (torch.randn(t, h, d, generator=gen) for h, d in ((hk, dk), (hk, dk), (hv, dv)))
    if not strided:
        q, k = l2_normalize(q) * dk ** -0.5, l2_normalize(k)
    g = -torch.rand(t, hv, generator=gen) * 2   # decays exp(g) in (e^-2, 1]
    beta = torch.rand(t, hv, generator=gen)
    state = torch.randn(slots, hv, dv, dk, generator=gen) * 0.3
    cu = torch.tensor([0] + lens).cumsum(0)
    return q, k, v, g, beta, state, cu


def assert_slots(got, want_out, got_state, want_state, state, write, tol):
    """The outputs as the recurrence's; every written slot as the recurrence leaves it,
    the slots read elsewhere and the untouched ones as they were."""
    rtol, atol = tol
    torch.testing.assert_close(got.double(), want_out, rtol=rtol, atol=atol)
    for slot in range(state.shape[0]):
        want = want_state[slot] if slot in write.tolist() else state[slot].double()
        torch.testing.assert_close(got_state[slot].double(), want, rtol=rtol, atol=atol,
                                   msg=f"slot {slot}")


SHAPES = [(2, 2, 64, 64), (2, 4, 32, 48), (1, 3, 20, 17), (2, 2, 128, 128), (1, 1, 8, 1)]


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
def test_matches_the_recurrence_in_float64(ops, hk, hv, dk, dv):
    lens = [1, 37, 0, 70, 5]
    read = torch.tensor([0, 1, 2, 3, 4])
    write = torch.tensor([0, 5, 6, 3, 7])  # in place, and into other slots
    q, k, v, g, beta, state, cu = inputs(lens, hk, hv, dk, dv, slots=9)
    want_out, want_state = recurrence(q, k, v, g, beta, state, cu, read, write)
    got_state = state.clone()
    got = ops.gated_delta_rule(q, k, v, g, beta, got_state, cu, read, write)
    assert got.shape == v.shape and got.dtype == torch.float32
    assert_slots(got, want_out, got_state, want_state, state, write, tol=(1e-5, 2e-6))


def test_strided_views_and_decode_rows(ops):
    """q/k/v as views of a packed projection (token stride > row), and a batch of
    one-token sequences (decode rows) whose slots are not in order."""
    lens = [1] * 6
    q, k, v, g, beta, state, cu = inputs(lens, 2, 4, 64, 32, slots=8, strided=True, seed=3)
    assert not q.is_contiguous() and not v.is_contiguous()
    read = torch.tensor([7, 2, 0, 5, 3, 1])
    want_out, want_state = recurrence(q, k, v, g, beta, state, cu, read, read)
    got_state = state.clone()
    got = ops.gated_delta_rule(q, k, v, g, beta, got_state, cu, read, read)
    torch.testing.assert_close(got.double(), want_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(got_state.double(), want_state, rtol=1e-5, atol=2e-6)


def test_agrees_with_the_pytorch_chunked_form(ops):
    """The layer's PyTorch path (chunks of 32, a triangular solve) and the kernel
    give the same outputs and final state to fp32 accuracy over a long prompt."""
    q, k, v, g, beta, state, cu = inputs([300], 2, 4, 64, 64, slots=1, seed=5)
    rep = 2
    qe, ke = (x.repeat_interleave(rep, dim=1) for x in (q, k))
    want, want_final = delta_rule_chunked(qe, ke, v, g, beta, state[0])
    got_state = state.clone()
    slot = torch.tensor([0])
    got = ops.gated_delta_rule(q, k, v, g, beta, got_state, cu, slot, slot)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state[0], want_final, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("read,write,match", [
    ([0, 1], [1, 2], "reads a slot another one writes"),
    ([0, 1], [2, 2], "two sequences write one slot"),
    ([0, 9], [0, 1], "slot out of range"),
    ([0, -1], [0, 1], "slot out of range"),
])
def test_refuses_slots_that_would_race(ops, read, write, match):
    q, k, v, g, beta, state, cu = inputs([2, 3], 1, 1, 16, 16, slots=4)
    before = state.clone()
    with pytest.raises(RuntimeError, match=match):
        ops.gated_delta_rule(q, k, v, g, beta, state, cu, torch.tensor(read),
                             torch.tensor(write))
    assert torch.equal(state, before)


def test_refuses_bad_shapes(ops):
    q, k, v, g, beta, state, cu = inputs([4], 2, 4, 16, 16, slots=2)
    s = torch.tensor([0])
    with pytest.raises(RuntimeError, match="state must be"):
        ops.gated_delta_rule(q, k, v, g, beta, state.transpose(-1, -2), cu, s, s)
    with pytest.raises(RuntimeError, match="Hk dividing Hv"):
        ops.gated_delta_rule(q[:, :1].expand(4, 3, 16), k, v, g, beta, state, cu, s, s)
    with pytest.raises(RuntimeError, match="cu_seqlens must run 0 .. T"):
        ops.gated_delta_rule(q, k, v, g, beta, state, torch.tensor([0, 3]), s, s)
    with pytest.raises(RuntimeError, match="float32"):
        ops.gated_delta_rule(q, k, v, g.double(), beta, state, cu, s, s)


# --- gated_delta_rule_qkv: the rule from the layer's own tensors ---------------------

def layer_inputs(lens, hk, hv, dk, dv, slots, dtype, seed=0):
    """A GatedDeltaNet layer with random A_log / dt_bias, and a step's conv output
    (q | k | v rows inside a wider buffer, as a view's rows are) and gate inputs a, b
    (strided views of one packed projection, as in_proj leaves them), in `dtype`."""
    from tokenmill.models.layers.gated_deltanet import GatedDeltaNet
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    layer = GatedDeltaNet(64, hk, hv, dk, dv, conv_kernel=4, eps=1e-6)
    with torch.no_grad():
        layer.A_log.copy_(torch.randn(hv, generator=gen))
        layer.dt_bias.copy_(torch.randn(hv, generator=gen))
    layer.to(dtype)
    width = 2 * hk * dk + hv * dv
    mixed = (torch.randn(t, width + 5, generator=gen) * 0.5).to(dtype)[:, :width]
    ab = (torch.randn(t, 2 * hv + 3, generator=gen) * 3).to(dtype)
    a, b = ab[:, :hv], ab[:, hv:2 * hv]
    if t:  # softplus past its threshold (20), and a beta of ~0 and of ~1
        a[0, 0], b[0, 0] = 25.0, -30.0
        b[-1, -1] = 30.0
    state = torch.randn(slots, hv, dv, dk, generator=gen) * 0.3
    cu = torch.tensor([0] + lens).cumsum(0)
    return layer, mixed, a, b, state, cu


QKV_SHAPES = [(2, 4, 64, 64), (1, 3, 20, 17), (4, 8, 128, 128), (2, 2, 16, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hk,hv,dk,dv", QKV_SHAPES)
def test_qkv_entry_matches_the_layer_formulas(ops, dtype, hk, hv, dk, dv):
    """q / k L2-normalised (q scaled), g = -exp(A_log) softplus(a + dt_bias), beta =
    sigmoid(b) computed in the kernel: the same as the layer's PyTorch formulas
    (`_rule_inputs`) fed to the recurrence in float64, over decode rows, an empty
    sequence and prompt chunks (both of the kernel's forms) in one call."""
    lens = [1, 37, 0, 70, 5]
    read = torch.tensor([0, 1, 2, 3, 4])
    write = torch.tensor([0, 5, 6, 3, 7])
    layer, mixed, a, b, state, cu = layer_inputs(lens, hk, hv, dk, dv, 9, dtype)
    q, k, v, g, beta = layer._rule_inputs(mixed, a, b)
    want_out, want_state = recurrence(q, k, v, g, beta, state, cu, read, write)
    got_state = state.clone()
    got = ops.gated_delta_rule_qkv(mixed, a, b, layer.A_log, layer.dt_bias, got_state, cu,
                                   read, write, hk, dk ** -0.5)
    assert got.shape == (sum(lens), hv, dv) and got.dtype == torch.float32
    assert_slots(got, want_out, got_state, want_state, state, write, tol=(2e-5, 5e-6))


def test_qkv_entry_equals_the_prepared_entry_on_the_same_inputs(ops):
    """Given what `_rule_inputs` makes, gated_delta_rule gives what gated_delta_rule_qkv
    gives from the raw tensors, to the last few ulps (the only difference: the order of
    the squares summed in the norms)."""
    layer, mixed, a, b, state, cu = layer_inputs([3, 50], 2, 4, 64, 64, 2, torch.float32, 7)
    q, k, v, g, beta = layer._rule_inputs(mixed, a, b)
    slots = torch.tensor([0, 1])
    s1, s2 = state.clone(), state.clone()
    want = ops.gated_delta_rule(q, k, v, g, beta, s1, cu, slots, slots)
    got = ops.gated_delta_rule_qkv(mixed, a, b, layer.A_log, layer.dt_bias, s2, cu, slots,
                                   slots, 2, 64 ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s2, s1, rtol=1e-5, atol=1e-6)


def test_qkv_entry_refuses_bad_tensors(ops):
    layer, mixed, a, b, state, cu = layer_inputs([4], 2, 4, 16, 16, 2, torch.float32)
    s = torch.tensor([0])
    args = (layer.A_log, layer.dt_bias, state, cu, s, s)
    before = state.clone()
    with pytest.raises(RuntimeError, match=r"mixed_qkv must be \[T, 128\]"):
        ops.gated_delta_rule_qkv(mixed[:, :-1], a, b, *args, 2, 0.25)
    with pytest.raises(RuntimeError, match="num_k_heads must divide"):
        ops.gated_delta_rule_qkv(mixed, a, b, *args, 3, 0.25)
    with pytest.raises(RuntimeError, match="a and b must be"):
        ops.gated_delta_rule_qkv(mixed, a.double(), b, *args, 2, 0.25)
    with pytest.raises(RuntimeError, match="a and b must be"):
        ops.gated_delta_rule_qkv(mixed, a[:, :2], b, *args, 2, 0.25)
    with pytest.raises(RuntimeError, match="A_log and dt_bias must hold 4"):
        ops.gated_delta_rule_qkv(mixed, a, b, layer.A_log[:3], layer.dt_bias, state, cu, s, s,
                                 2, 0.25)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.gated_delta_rule_qkv(mixed, a, b, layer.A_log, layer.dt_bias, state, cu,
                                 torch.tensor([5]), s, 2, 0.25)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.gated_delta_rule_qkv(mixed.t().contiguous().t(), a, b, *args, 2, 0.25)
    assert torch.equal(state, before)
