"""Gated DeltaNet (linear attention with a recurrent state), paged by request slot.

Per token t and value head h, with q, k L2-normalised and q scaled by 1/sqrt(Dk):

    S_t = exp(g_t) * S_{t-1} + beta_t * (v_t - exp(g_t) * S_{t-1} k_t) k_t^T     S: [Dv, Dk]
    o_t = S_t q_t

Decode rows (one token each) take that step directly, batched over rows. A
prompt chunk runs the chunked form: inside a chunk of C tokens the updates
u_i = beta_i * (v_i - (decayed state) k_i) solve one unit-lower-triangular
system, so a chunk costs a few matmuls and only the chunks are sequential.
Before either, q/k/v pass a depthwise causal conv1d whose last kernel-1
inputs are carried per sequence (the conv state), so a prompt split across
steps, even into chunks shorter than the kernel, convolves exactly as whole.

On a CPU with the native kernels the platform hands the layer
`gated_delta_rule` (kernels/cpu_gated_delta.cpp) and `causal_conv1d_silu`
(kernels/cpu_causal_conv.cpp) through `set_linear_attention("native")`: the
recurrence token by token and the conv, for prompt chunks and decode rows alike,
each sequence in place on its state slots, q/k heads shared by their value heads
without copies; a step whose rows are one sequence each (no speculation, no
prefix-cache pieces) runs each in one call. (The chunked form's small products,
solve and copies cost 6-30x more than the recurrence's L1-resident passes
there.) The output norm takes the native `gated_rms_norm` in half-precision
models (`set_norm_kernels`).

On CUDA the platform may hand the layer flash-linear-attention's kernels
(`set_linear_attention("fla")`, where `fla` imports): the fused recurrent step
for decode rows and the chunked rule for prompt chunks, over the same fp32
inputs and the same per-slot state (fla keeps its state as [H, Dk, Dv], the
transpose of ours). The conv1d stays in PyTorch (one small depthwise conv per
chunk; fla's causal_conv1d signature has changed across releases).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.linear import Linear

# Tokens per chunk: at most CHUNK, and a short call (a prompt's tail, a suffix after a
# cached prefix, a chunk between state snapshots) takes the power of two >= its length
# (at least 8) instead of padding to CHUNK. Measured on the AVX512-BF16 EPYC, one
# thread, 8 heads of 64 x 64: 32 beats 64 at every length (1.12 vs 1.46 ms at 64
# tokens, 4.65 vs 5.52 at 256), and an 8-token call takes 0.34 ms at chunk 8.
CHUNK = 32
MIN_CHUNK = 8


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv1d_decode(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None,
                  write_slots: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, C] one new input per row; conv_state [S, K-1, C] (a slot's last K-1 inputs,
    oldest first) read at `slots` and written at `write_slots` (default: in place)."""
    window = torch.cat([conv_state[slots].to(x.dtype), x.unsqueeze(1)], dim=1)  # [n, K, C]
    conv_state[slots if write_slots is None else write_slots] = \
        window[:, 1:].to(conv_state.dtype)
    out = (window * weight.t()).sum(dim=1)
    if bias is not None:
        out = out + bias
    return F.silu(out)


def _copy_slots(state: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """state[dst] = state[src] for each (src, dst): snapshots of prefix caching."""
    for src, dst in pairs:
        state[dst] = state[src]


def conv1d_prefill(x: torch.Tensor, conv_state: torch.Tensor, slot: int,
                   weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [L, C] consecutive inputs of one sequence, continuing from its conv state."""
    keep = conv_state.shape[1]
    seq = torch.cat([conv_state[slot].to(x.dtype), x], dim=0)  # [K-1+L, C]
    conv_state[slot] = seq[seq.shape[0] - keep:].to(conv_state.dtype)
    out = F.conv1d(seq.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=seq.shape[1])[0]
    return F.silu(out.t())  # [L, C]


def delta_rule_decode(q, k, v, g, beta, ssm_state: torch.Tensor, slots: torch.Tensor,
                      write_slots: torch.Tensor | None = None):
    """One step for n rows. q/k [n, H, Dk], v [n, H, Dv], g/beta [n, H] (fp32);
    ssm_state [S, H, Dv, Dk] read at `slots`, written at `write_slots` (default: in
    place). Returns [n, H, Dv] fp32."""
    state = ssm_state[slots].float() * g.exp()[..., None, None]
    predicted = torch.matmul(state, k.unsqueeze(-1)).squeeze(-1)  # [n, H, Dv]
    update = (v - predicted) * beta.unsqueeze(-1)
    state = state + update.unsqueeze(-1) * k.unsqueeze(-2)
    ssm_state[slots if write_slots is None else write_slots] = state.to(ssm_state.dtype)
    return torch.matmul(state, q.unsqueeze(-1)).squeeze(-1)


def delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int | None = None):
    """One sequence. q/k [L, H, Dk], v [L, H, Dv], g/beta [L, H] (fp32), state [H, Dv, Dk].
    Returns (out [L, H, Dv], final state [H, Dv, Dk]). `chunk`: tokens per chunk
    (default: see CHUNK)."""
    length = q.shape[0]
    if chunk is None:
        chunk = min(CHUNK, max(MIN_CHUNK, 1 << max(0, length - 1).bit_length()))
    pad = (-length) % chunk
    # Padded steps have g = beta = k = 0: no decay, no update.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (length + pad) // chunk
    # [n, H, C, D] and [n, H, C], made contiguous once: chunk c's slices are then
    # contiguous and the batched products read their operands without copies
    q, k, v = (x.view(n, chunk, *x.shape[1:]).transpose(1, 2).contiguous() for x in (q, k, v))
    g, beta = (x.view(n, chunk, -1).transpose(1, 2).contiguous() for x in (g, beta))

    gamma = g.cumsum(dim=-1)  # log of the decay from the chunk start to each step
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i, else 0
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    kk = torch.matmul(k, k.transpose(-1, -2))
    # (I + A) U = beta*V - (beta*a) K S0^T, with A strictly lower: beta_i decay_ij k_i.k_j
    system = (beta.unsqueeze(-1) * decay * kk).tril(-1) + torch.eye(chunk, device=q.device)
    a = gamma.exp()
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * a).unsqueeze(-1) * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w_v, w_k = (w.contiguous() for w in solved.split([v.shape[-1], k.shape[-1]], dim=-1))
    attn = torch.matmul(q, k.transpose(-1, -2)) * decay  # [n, H, C, C]
    q_decayed = a.unsqueeze(-1) * q
    k_to_end = (gamma[..., -1:] - gamma).exp().unsqueeze(-1) * k  # decay to the chunk end
    chunk_decay = gamma[..., -1].exp()  # [n, H]

    out = torch.empty_like(v)
    s = state.float()  # [H, Dv, Dk]
    for c in range(n):
        s_t = s.transpose(-1, -2)  # [H, Dk, Dv]
        u = w_v[c] - torch.matmul(w_k[c], s_t)  # [H, C, Dv]
        out[c] = torch.matmul(q_decayed[c], s_t) + torch.matmul(attn[c], u)
        s = chunk_decay[c, :, None, None] * s + torch.matmul(u.transpose(-1, -2), k_to_end[c])
    out = out.transpose(1, 2).reshape(n * chunk, -1, v.shape[-1])[:length]
    return out, s


def load_fla_kernels():
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) from
    flash-linear-attention, or None where it is not installed."""
    try:
        from fla.ops.gated_delta_rule import (chunk_gated_delta_rule,
                                              fused_recurrent_gated_delta_rule)
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


# The native conv's largest kernel (cpu_causal_conv.cpp kMaxK; Qwen's is 4): a
# config with a longer one keeps the PyTorch conv.
NATIVE_CONV_MAX_KERNEL = 8


class NativeKernels(NamedTuple):
    """The CPU kernels module's Gated DeltaNet entry points, and each bound into the
    signatures `GatedDeltaNet._by_pieces` calls (for the steps run piece by piece)."""
    rule: Callable            # ops.gated_delta_rule_qkv: whole steps
    conv: Callable | None     # ops.causal_conv1d_silu (None: a build without it)
    prefill: Callable
    decode: Callable
    conv_prefill: Callable | None
    conv_decode: Callable | None


def native_conv_decode(conv, x, conv_state, slots, weight, bias, write_slots=None):
    """conv1d_decode through the native kernel: each row a one-token sequence."""
    assert bias is None
    return conv(x, conv_state, weight, torch.arange(x.shape[0] + 1), slots,
                slots if write_slots is None else write_slots)


def native_conv_prefill(conv, x, conv_state, slot: int, weight, bias):
    """conv1d_prefill through the native kernel, in place on conv state slot `slot`."""
    assert bias is None
    s = torch.tensor([slot])
    return conv(x, conv_state, weight, torch.tensor([0, x.shape[0]]), s, s)


# The native rule takes the layer's own tensors: mixed_qkv (the conv output), a and b (the
# gate inputs), and the layer's `gates` = (A_log, dt_bias, num_k_heads, q_scale).
def native_decode(rule, mixed_qkv, a, b, ssm_state, slots, A_log, dt_bias, num_k_heads,
                  q_scale, write_slots=None):
    """The rule over a batch of decode rows through the native kernel: each row a
    one-token sequence."""
    cu = torch.arange(mixed_qkv.shape[0] + 1)
    return rule(mixed_qkv, a, b, A_log, dt_bias, ssm_state, cu, slots,
                slots if write_slots is None else write_slots, num_k_heads, q_scale)


def native_prefill(rule, mixed_qkv, a, b, ssm_state, slot: int, A_log, dt_bias, num_k_heads,
                   q_scale):
    """One sequence's chunk through the native kernel, in place on state slot `slot`."""
    s = torch.tensor([slot])
    return rule(mixed_qkv, a, b, A_log, dt_bias, ssm_state, torch.tensor([0, mixed_qkv.shape[0]]),
                s, s, num_k_heads, q_scale)


def state_prefill(chunked, q, k, v, g, beta, ssm_state, slot: int):
    """One sequence's chunk through a chunked rule that returns its final state."""
    out, final = chunked(q, k, v, g, beta, ssm_state[slot])
    ssm_state[slot] = final.to(ssm_state.dtype)
    return out


def fla_decode(fused, q, k, v, g, beta, ssm_state, slots, write_slots=None):
    """delta_rule_decode through fla's fused recurrent kernel (one token per row)."""
    init = ssm_state[slots].float().transpose(-1, -2).contiguous()  # [n, H, Dk, Dv]
    out, final = fused(q=q.unsqueeze(1), k=k.unsqueeze(1), v=v.unsqueeze(1),
                       g=g.unsqueeze(1), beta=beta.unsqueeze(1), scale=1.0,
                       initial_state=init, output_final_state=True)
    ssm_state[slots if write_slots is None else write_slots] = \
        final.transpose(-1, -2).to(ssm_state.dtype)
    return out[:, 0].float()


def fla_chunked(chunk, q, k, v, g, beta, state):
    """delta_rule_chunked through fla's chunked kernel (one sequence)."""
    init = state.float().transpose(-1, -2).unsqueeze(0).contiguous()  # [1, H, Dk, Dv]
    out, final = chunk(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None],
                       scale=1.0, initial_state=init, output_final_state=True)
    return out[0].float(), final[0].transpose(-1, -2)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, then times silu(z); x (the delta rule's fp32
    output) is first rounded to z's dtype, the model's. The native kernel
    (`set_norm_kernels`; fp32 models too, `native_fp32_norm`: the PyTorch form is nine
    ops) does a row in one pass with the same roundings."""

    native_fp32_norm = True

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._ops = None

    def set_norm_kernels(self, ops) -> None:
        self._ops = ops

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self._ops is not None and self.weight.dtype == z.dtype:
            return self._ops.gated_rms_norm(x, z, self.weight, self.eps)
        dtype = z.dtype
        x = x.to(dtype).float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Token mixer of the linear-attention layers of Qwen3.5 / Qwen3-Next.

    `in_proj` packs, in this order, q, k, v (the conv input), z (the output
    gate), b (-> beta) and a (-> decay); the loader maps each checkpoint
    layout onto it. The runner binds `state` = (conv_state [S, K-1, conv_dim],
    ssm_state [S, Hv, Dv, Dk]).
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel: int, eps: float):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        # Checkpoint shards: q|k|v (the conv input), z, b, a; each section split by heads.
        self.in_proj = Linear(hidden_size, self.conv_dim + self.value_dim + 2 * num_v_heads,
                              bias=False, tp="column",
                              output_sizes=((self.key_dim, self.key_dim, self.value_dim),
                                            self.value_dim, num_v_heads, num_v_heads))
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False, tp="row")
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the runner
        # The delta-rule implementations, bound once by set_linear_attention (PyTorch's
        # until then): a prompt chunk's (in place on its slot) and a batch of decode
        # rows'; the native kernels beside them where the platform has them.
        self.set_linear_attention("torch")

    def tp_plan(self, tp) -> dict:
        """Tensor parallel, by key heads and their value heads: in_proj column-parallel
        and out_proj row-parallel (their roles), the conv weights of the q|k|v sections
        and the per-value-head dt_bias / A_log split the same way."""
        kd, vd, hv = self.key_dim * tp.size, self.value_dim * tp.size, self.num_v_heads * tp.size
        return {("conv1d.weight", None): tp.split(0, kd, kd, vd),
                ("dt_bias", None): tp.split(0, hv), ("A_log", None): tp.split(0, hv)}

    def set_linear_attention(self, kind: str, kernels=None) -> None:
        """"native": the CPU kernels module `kernels`' gated_delta_rule_qkv (and its
        causal_conv1d_silu); "fla":
        flash-linear-attention's kernels where installed (CUDA), `kernels` = (chunk,
        fused recurrent) to use instead of fla's own (tests); else PyTorch."""
        rule = getattr(kernels, "gated_delta_rule_qkv", None) if kind == "native" else None
        fla = (kernels or load_fla_kernels()) if kind == "fla" else None
        # (the native kernel keeps an fp32 state only: a narrower ssm cache dtype
        # takes the PyTorch path, decided per call from the bound state)
        conv = getattr(kernels, "causal_conv1d_silu", None) if rule is not None else None
        self._native = None if rule is None else NativeKernels(
            rule, conv, functools.partial(native_prefill, rule),
            functools.partial(native_decode, rule),
            None if conv is None else functools.partial(native_conv_prefill, conv),
            None if conv is None else functools.partial(native_conv_decode, conv))
        if fla is not None:
            self._prefill = functools.partial(state_prefill, functools.partial(fla_chunked, fla[0]))
            self._decode = functools.partial(fla_decode, fla[1])
        else:
            self._prefill = functools.partial(state_prefill, delta_rule_chunked)
            self._decode = delta_rule_decode

    def state_shapes(self) -> list[tuple[int, ...]]:
        # The conv state token-major (a slot's last K-1 inputs as rows of channels), as
        # the inputs come: a decode row's window is whole rows (vLLM keeps it so too).
        return [(self.conv_kernel - 1, self.conv_dim),
                (self.num_v_heads, self.head_v_dim, self.head_k_dim)]

    @staticmethod
    def state_dtypes(model_dtype: torch.dtype) -> list[torch.dtype]:
        # The conv state holds raw inputs (model dtype); the SSM state accumulates
        # over the whole sequence, so it stays fp32.
        return [model_dtype, torch.float32]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        sm = meta.state
        conv_state, ssm_state = self.state
        t = x.shape[0]
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads,
                                     self.num_v_heads], dim=-1)
        weight = self.conv1d.weight[:, 0, :].to(x.dtype)
        nk = self._native
        # The native kernels keep the states in place in their own dtypes only (fp32
        # ssm, conv in the model's); where the step's rows are one sequence each
        # (sm.query_start_loc), each kernel takes the whole step in one call.
        native_conv = (nk is not None and nk.conv is not None and conv_state.dtype == x.dtype
                       and self.conv_kernel <= NATIVE_CONV_MAX_KERNEL)
        native_rule = nk is not None and ssm_state.dtype == torch.float32
        whole = sm.query_start_loc
        if whole is not None and int(whole[-1]) != t:  # (rows padded past the requests')
            whole = None
        if native_conv and whole is not None:
            conv_out = nk.conv(mixed, conv_state, weight, whole, sm.state_indices, sm.state_indices)
        else:
            conv_out = self._by_pieces(
                sm, mixed, (nk.conv_prefill, nk.conv_decode) if native_conv
                else (conv1d_prefill, conv1d_decode), conv_state, (weight, None))

        heads = (self.num_v_heads, self.head_v_dim)
        if native_rule:
            # q | k | v as the conv left them and a, b as in_proj did: the q / k norms, g
            # and beta are the kernel's (one pass, not a dozen PyTorch ops a layer)
            gates = (self.A_log, self.dt_bias, self.num_k_heads, self.head_k_dim ** -0.5)
            if whole is not None:
                core = nk.rule(conv_out, a, b, *gates[:2], ssm_state, whole, sm.state_indices,
                               sm.state_indices, *gates[2:])
            else:
                core = self._by_pieces(sm, (conv_out, a, b), (nk.prefill, nk.decode), ssm_state,
                                       gates, out_shape=heads)
        else:
            core = self._by_pieces(sm, self._rule_inputs(conv_out, a, b),
                                   (self._prefill, self._decode), ssm_state, (), out_shape=heads)
        core = self.norm(core, z.reshape(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(core.reshape(t, self.value_dim))

    def _rule_inputs(self, conv_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
        """The delta rule's fp32 inputs q, k, v, g, beta from the conv output and the gate
        inputs, for the PyTorch / fla rules (the native kernel computes the same itself)."""
        t = conv_out.shape[0]
        q, k, v = conv_out.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = l2_normalize(q.view(t, self.num_k_heads, self.head_k_dim)) * self.head_k_dim ** -0.5
        k = l2_normalize(k.view(t, self.num_k_heads, self.head_k_dim))
        if rep > 1:  # each q/k head serves `rep` consecutive value heads
            # (expand, not repeat_interleave: that one builds its repeats tensor on the
            # host, a copy a CUDA graph cannot capture)
            q, k = (x.unsqueeze(2).expand(t, self.num_k_heads, rep, self.head_k_dim)
                    .reshape(t, self.num_v_heads, self.head_k_dim) for x in (q, k))
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v, g, beta

    @staticmethod
    def _by_pieces(sm, inputs, impl, state: torch.Tensor, extra: tuple,
                   out_shape: tuple[int, ...] | None = None):
        """Run a stage (the conv, the delta rule) over the step's rows in the order the
        states need: the decode rows (speculation: token j of every row, j = 0, 1, ...),
        their snapshots, then each prefill piece after its restore, before its snapshot.
        `inputs`: one tensor (the conv's x) or a tuple of per-token tensors (the rule's);
        impl = (prefill(*inputs, state, slot, *extra), decode(*inputs, state, read,
        *extra, write)); `out_shape`: the rule's per-token (H, Dv), its output fp32."""
        prefill, decode = impl
        several = isinstance(inputs, tuple)
        rows_of = (lambda sel: tuple(x[sel] for x in inputs)) if several else inputs.__getitem__
        first = inputs[0] if several else inputs
        out = (torch.empty(first.shape[0], *out_shape, dtype=torch.float32, device=first.device)
               if out_shape else torch.empty_like(first))
        nd = sm.num_decodes

        def run_decode(sel, read, write):
            args = rows_of(sel)
            args = args if several else (args,)
            return decode(*args, state, read, *extra, write)

        if sm.decode_steps is not None:  # speculation: token j of every row, j = 0, 1, ...
            for rows, read, write in sm.decode_steps:
                out[rows] = run_decode(rows, read, write)
        elif nd:
            out[:nd] = run_decode(slice(0, nd), sm.state_indices[:nd], None)
        _copy_slots(state, sm.decode_snapshots)
        for i, (start, end, slot) in enumerate(sm.prefills):
            if i in sm.restore_before:  # a cache hit: its state starts from a snapshot
                state[slot] = state[sm.restore_before[i]]
            args = rows_of(slice(start, end))
            out[start:end] = prefill(*(args if several else (args,)), state, slot, *extra)
            if i in sm.snapshot_after:
                state[sm.snapshot_after[i]] = state[slot]
        return out
