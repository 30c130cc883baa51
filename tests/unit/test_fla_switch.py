"""The flash-linear-attention switch of the Gated DeltaNet layer (models/layers/
gated_deltanet.py): the wrappers hand fla's kernels the layer's inputs and state in
fla's layout ([B, T, H, D] inputs, state [N, H, Dk, Dv], the transpose of the
layer's [H, Dv, Dk]) and write the final state back. fla needs CUDA, so stand-ins
written from fla's recurrence (the per-token gated delta rule in fla's layout) take
its place in the first tests. The real kernels follow, run by Triton's interpreter on
CPU tensors where fla-core is installed (the test extras install it); compiled, on a
GPU, they run in tests/gpu."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before fla imports triton

import torch  # noqa: E402

from tokenmill.models.layers.gated_deltanet import (delta_rule_chunked,  # noqa: E402
                                                    delta_rule_decode, fla_chunked,
                                                    fla_decode, l2_normalize)


def fla_recurrence(q, k, v, g, beta, scale, initial_state, output_final_state):
    """fla's contract: q/k [B, T, H, K], v [B, T, H, V], g/beta [B, T, H], state
    [B, H, K, V]: h <- h * exp(g); h += k (beta (v - k h)); o = scale q h."""
    b, t, h, _ = q.shape
    state = initial_state.clone()
    out = torch.empty(b, t, h, v.shape[-1])
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        update = beta[:, i][..., None] * (v[:, i] - pred)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], update)
        out[:, i] = scale * torch.einsum("bhk,bhkv->bhv", q[:, i], state)
    return out, state


def _inputs(t, h=3, dk=8, dv=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, h, dk, generator=gen)) * dk ** -0.5
    k = l2_normalize(torch.randn(t, h, dk, generator=gen))
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    return q, k, v, g, beta


def test_fla_decode_wrapper_matches_the_pytorch_step():
    q, k, v, g, beta = _inputs(4)
    state = torch.randn(6, 3, 4, 8, generator=torch.Generator().manual_seed(1))  # [S, H, Dv, Dk]
    slots, write = torch.tensor([5, 0, 2, 3]), torch.tensor([1, 4, 2, 3])
    ref_state = state.clone()
    ref = delta_rule_decode(q, k, v, g, beta, ref_state, slots, write)
    got = fla_decode(fla_recurrence, q, k, v, g, beta, state, slots, write)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_fla_chunked_wrapper_matches_the_pytorch_chunks():
    q, k, v, g, beta = _inputs(70, seed=2)  # two chunks of 64 and a tail
    state = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(3))
    ref_out, ref_final = delta_rule_chunked(q, k, v, g, beta, state)
    out, final = fla_chunked(fla_recurrence, q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref_final, atol=1e-4, rtol=1e-4)


def test_real_fla_decode_kernel_matches_the_pytorch_step(fla_interpreted):
    """fla's fused recurrent kernel through the decode wrapper: rows read and write
    different state slots (a request's slot moves under the persistent batch)."""
    _, fused = fla_interpreted
    q, k, v, g, beta = _inputs(5, h=2, dk=16, dv=32, seed=4)
    state = torch.randn(7, 2, 32, 16, generator=torch.Generator().manual_seed(5))
    slots, write = torch.tensor([6, 0, 2, 3, 4]), torch.tensor([1, 5, 2, 3, 4])
    ref_state = state.clone()
    ref = delta_rule_decode(q, k, v, g, beta, ref_state, slots, write)
    got = fla_decode(fused, q, k, v, g, beta, state, slots, write)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_real_fla_chunked_kernel_matches_the_pytorch_chunks(fla_interpreted):
    """fla's chunked kernels through the prefill wrapper: 150 tokens are two whole
    chunks of 64 and a tail, from a non-zero state (a prompt's second chunk)."""
    chunk, _ = fla_interpreted
    q, k, v, g, beta = _inputs(150, h=2, dk=32, dv=16, seed=6)
    state = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(7))
    ref_out, ref_final = delta_rule_chunked(q, k, v, g, beta, state)
    out, final = fla_chunked(chunk, q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)
