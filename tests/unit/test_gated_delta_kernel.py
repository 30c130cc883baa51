"""The native Gated DeltaNet delta rule (kernels/cpu_gated_delta.cpp) at every level this
CPU runs, against the recurrence in float64: several sequences of one call (empty,
one token, long) from their own state slots, read and write slots apart and alike,
value heads sharing q/k heads, head sizes off the vector width (the scalar tails),
strided q/k/v; the slots it must refuse; and the PyTorch chunked form beside it."""
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
    torch.testing.assert_close(got.double(), want_out, rtol=1e-5, atol=2e-6)
    # every written slot as the recurrence leaves it; the slots read elsewhere and the
    # untouched ones (1, 2, 4, 8) as they were
    for slot in range(9):
        want = want_state[slot] if slot in write.tolist() else state[slot].double()
        torch.testing.assert_close(got_state[slot].double(), want, rtol=1e-5, atol=2e-6,
                                   msg=f"slot {slot}")


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
