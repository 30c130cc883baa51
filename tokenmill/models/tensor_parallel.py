"""Tensor parallelism, the Megatron way: which slice of each weight a rank holds,
and the collectives that put the ranks' partial results together.

A rank's model is the model class built from a *rank config*: the head counts and
intermediate sizes divided by the number of ranks (`rank_config`), so every layer
allocates its shard only and computes with its local heads unchanged (the KV cache
and the Gated DeltaNet state per rank hold its heads only). Then:

- column-parallel: qkv_proj (its q, k and v heads; KV heads replicated when there
  are fewer than ranks), gate_up_proj (its gate and up rows; Gemma's gelu-tanh MLP
  too), Gated DeltaNet's
  in_proj / conv1d / dt_bias / A_log (its key heads and their value heads), each
  MoE expert's gate_up rows;
- row-parallel: o_proj, down_proj, out_proj, each expert's down columns; the block
  that ends in one (attention, Gated DeltaNet, MLP, MoE block with its shared
  expert) all-reduces its output once; a row-parallel bias is added by rank 0 only;
- vocab-parallel: the embedding (each rank its rows, ids outside them masked, then
  all-reduced) and lm_head (each rank its vocabulary shard, all-gathered);
- replicated: norms, the MoE router, the shared-expert gate, a vision tower, Gemma 4's
  per-layer input tables and gates (small, and computed from replicated activations).

Gemma 4's layers differ in head shape (global layers: their own head_dim, maybe their
own KV head count): each layer splits at its own (`layer_kv_heads`; head_dim is per
head, unchanged). Its k = v layers pack no V rows and its KV-shared layers no K / V
(they read their source's cache, split the same way). Its experts sit beside the
dense MLP, each normalised apart, so its FusedMoE all-reduces on its own.

Multi-head latent attention (DeepSeek-V2 / V3) splits by heads too: q_proj / q_b_proj
and kv_b_proj column-parallel (each rank its heads' rows), o_proj row-parallel. The
latent projection (kv_a_proj_with_mqa, q_a_proj) and its norms are replicated: the
latent row serves every head, so each rank caches the whole latent of a token (as
vLLM does) and absorbs its own heads' kv_b_proj for decode.

MoE: each expert's intermediate dim is split (not the experts): every rank routes
every token the same way and runs every expert that received tokens on its slice,
so the work is even whatever the routing, and the MoE block reduces once like a
dense MLP (its shared expert's partial sum joins the same all-reduce).

The checkpoint is read slice by slice (`safe_open(...).get_slice(name)[...]`):
no rank holds more than its shards and one tensor at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.checkpoint_io import materialize

TP_FIELD = "tensor_parallel_size"
# Submodules every rank holds whole and runs alone: a vision tower (small beside the
# language model, run once per image) gives every rank the same embeddings.
REPLICATED_SUBMODULES = ("visual",)


def _replicated(module_name: str) -> bool:
    return module_name.split(".", 1)[0] in REPLICATED_SUBMODULES


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tensor_parallel_size(size) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{TP_FIELD} must be a positive int, got {size!r}")
    return size


def layer_kv_heads(hf_config: dict) -> list[int] | None:
    """Each layer's KV head count where layers differ (Gemma 4: its global layers' own
    count, per_layer_config or num_global_key_value_heads); None: one count for all."""
    if not (hf_config.get("per_layer_config") or hf_config.get("global_head_dim")):
        return None
    from tokenmill.models.gemma4 import Gemma4Config
    return Gemma4Config(hf_config).kv_heads


def check_divisible(hf_config: dict, size: int) -> None:
    """The model's heads and sizes split evenly over `size` ranks, or a ValueError
    naming tensor_parallel_size and the field that does not."""
    heads = hf_config["num_attention_heads"]
    kv = hf_config.get("num_key_value_heads") or heads
    checks = [("num_attention_heads", heads)]
    for name in ("intermediate_size", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "linear_num_key_heads",
                 "linear_num_value_heads"):
        if hf_config.get(name):
            checks.append((name, hf_config[name]))
    for name, value in checks:
        if value % size:
            raise ValueError(f"{TP_FIELD}={size} does not divide the model's {name} "
                             f"({value})")
    kv_counts = [("num_key_value_heads", kv)]
    per_layer = layer_kv_heads(hf_config)
    if per_layer is not None:
        kv_counts += [(f"num_key_value_heads of layer {i} (per_layer_config / "
                       f"num_global_key_value_heads)", n) for i, n in enumerate(per_layer)]
    for name, n in kv_counts:
        if n % size and size % n:
            raise ValueError(f"{TP_FIELD}={size}: the model's {name} ({n}) must divide "
                             f"by it, or divide it (KV heads replicated)")


def rank_config(hf_config: dict, size: int) -> dict:
    """The config one rank's model is built from: its share of every split dim."""
    c = dict(hf_config)
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    c["head_dim"] = c.get("head_dim") or c["hidden_size"] // heads  # unchanged per head
    c["num_attention_heads"] = heads // size
    c["num_key_value_heads"] = max(1, kv // size)
    # Gemma 4's global layers: their own KV head count, split (or replicated) the same
    # way; their head_dim is per head, unchanged.
    if c.get("num_global_key_value_heads"):
        c["num_global_key_value_heads"] = max(1, c["num_global_key_value_heads"] // size)
    if c.get("per_layer_config"):
        c["per_layer_config"] = {
            k: dict(v, num_key_value_heads=max(1, v["num_key_value_heads"] // size))
            if v.get("num_key_value_heads") else v
            for k, v in c["per_layer_config"].items()}
    for name in ("intermediate_size", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "linear_num_key_heads",
                 "linear_num_value_heads"):
        if c.get(name):
            c[name] //= size
    c["vocab_size"] = cdiv(c["vocab_size"], size)
    return c


def _is_attention(m: nn.Module) -> bool:
    """Llama's Attention or the hybrids' GatedAttention: qkv_proj -> heads -> o_proj."""
    return hasattr(m, "qkv_proj") and hasattr(m, "o_proj") and hasattr(m, "attn")


# ---- which slice of each checkpoint tensor --------------------------------------------
@dataclass(frozen=True)
class Split:
    """Along `dim`, consecutive segments of the full tensor (full length, pieces, this
    rank's piece); the rank's tensor is its piece of each, concatenated."""
    dim: int
    segments: tuple[tuple[int, int, int], ...]

    def take(self, tensor) -> torch.Tensor:
        pieces, base = [], 0
        for full, n, i in self.segments:
            step = full // n
            pieces.append(_read(tensor, self.dim, base + i * step, base + (i + 1) * step))
            base += full
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


@dataclass(frozen=True)
class VocabSplit:
    """Rows [rank * shard, (rank + 1) * shard) of a vocabulary of `vocab`, zero-padded."""
    vocab: int
    shard: int
    rank: int

    def take(self, tensor) -> torch.Tensor:
        lo = self.rank * self.shard
        hi = min(lo + self.shard, self.vocab)
        part = _read(tensor, 0, lo, hi)
        if hi - lo < self.shard:
            part = torch.cat([part, part.new_zeros(self.shard - (hi - lo), *part.shape[1:])])
        return part


@dataclass(frozen=True)
class FirstRankOnly:
    """A row-parallel bias: added once, by rank 0 (zeros elsewhere)."""
    rank: int

    def take(self, tensor) -> torch.Tensor:
        t = materialize(tensor)
        return t if self.rank == 0 else torch.zeros_like(t)


def _read(tensor, dim: int, lo: int, hi: int) -> torch.Tensor:
    index = (slice(None),) * dim + (slice(lo, hi),)
    return tensor[index]


class ShardPlan:
    """(parameter name, packed shard index or None) -> how this rank slices the
    checkpoint tensor that fills it; anything not named is replicated."""

    def __init__(self, model: nn.Module, hf_config: dict, rank: int, size: int):
        from tokenmill.models.deepseek_v2 import MLAttention
        from tokenmill.models.layers.gated_deltanet import GatedDeltaNet
        from tokenmill.models.layers.mlp import GatedMLP
        from tokenmill.models.layers.moe import FusedMoE
        from tokenmill.models.gemma3 import GeluTanhMLP
        self.rules: dict[tuple[str, int | None], object] = {}
        kv_model = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
        kv_by_layer = layer_kv_heads(hf_config)
        rules = self.rules

        def split(dim, *fulls, n=size, i=rank):
            return Split(dim, tuple((f, n, i) for f in fulls))

        for mod_name, m in model.named_modules():
            p = mod_name + "." if mod_name else ""
            if _replicated(mod_name):
                continue
            if _is_attention(m):
                d = m.head_dim
                kv_full = (kv_model if kv_by_layer is None
                           else kv_by_layer[m.layer_idx])  # Gemma 4: this layer's
                kv_pieces = min(kv_full, size)
                kv_index = rank * kv_pieces // size
                kv_seg = (kv_full * d, kv_pieces, kv_index)
                # Packed K and V rows; Gemma 4 packs none for a missing projection (k = v:
                # no V; KV-shared: neither): those shards stay empty, nothing to cut.
                k_rows = getattr(m, "k_size", m.kv_size)
                v_rows = getattr(m, "v_size", m.kv_size)
                # q rows (a gated attention's q_proj: q and gate rows per head)
                q = (m.qkv_proj.out_features - k_rows - v_rows) * size
                segments = [(q, size, rank)] + [kv_seg for n in (k_rows, v_rows) if n]
                for w in ("weight", "bias"):
                    rules[(f"{p}qkv_proj.{w}", 0)] = split(0, q)
                    for shard, n in ((1, k_rows), (2, v_rows)):
                        if n:
                            rules[(f"{p}qkv_proj.{w}", shard)] = Split(0, (kv_seg,))
                    rules[(f"{p}qkv_proj.{w}", None)] = Split(0, tuple(segments))
                rules[(f"{p}o_proj.weight", None)] = split(1, m.q_size * size)
                rules[(f"{p}o_proj.bias", None)] = FirstRankOnly(rank)
            elif isinstance(m, MLAttention):
                c = m.c  # this rank's config: its heads
                heads = c.num_heads * size
                for q in ("q_proj", "q_b_proj"):
                    rules[(f"{p}{q}.weight", None)] = split(0, heads * c.qk_head_dim)
                rules[(f"{p}kv_b_proj.weight", None)] = split(
                    0, heads * (c.qk_nope_head_dim + c.v_head_dim))
                rules[(f"{p}o_proj.weight", None)] = split(1, heads * c.v_head_dim)
                rules[(f"{p}o_proj.bias", None)] = FirstRankOnly(rank)
            elif isinstance(m, (GatedMLP, GeluTanhMLP)):
                inter = m.intermediate_size * size
                for w in ("weight", "bias"):
                    rules[(f"{p}gate_up_proj.{w}", 0)] = split(0, inter)
                    rules[(f"{p}gate_up_proj.{w}", 1)] = split(0, inter)
                    rules[(f"{p}gate_up_proj.{w}", None)] = split(0, inter, inter)
                rules[(f"{p}down_proj.weight", None)] = split(1, inter)
                rules[(f"{p}down_proj.bias", None)] = FirstRankOnly(rank)
            elif isinstance(m, FusedMoE):
                inter = m.gate_up_proj.shape[1] // 2 * size
                # per-expert tensors ([I, H] / [H, I]) and the fused stacked ones
                rules[(f"{p}gate_up_proj", 0)] = split(0, inter)
                rules[(f"{p}gate_up_proj", 1)] = split(0, inter)
                rules[(f"{p}down_proj", 0)] = split(1, inter)
                rules[(f"{p}gate_up_proj", None)] = split(1, inter, inter)
                rules[(f"{p}down_proj", None)] = split(2, inter)
            elif isinstance(m, GatedDeltaNet):
                kd, vd, hv = m.key_dim * size, m.value_dim * size, m.num_v_heads * size
                rules[(f"{p}in_proj.weight", 0)] = split(0, kd, kd, vd)
                rules[(f"{p}in_proj.weight", 1)] = split(0, vd)
                rules[(f"{p}in_proj.weight", 2)] = split(0, hv)
                rules[(f"{p}in_proj.weight", 3)] = split(0, hv)
                rules[(f"{p}conv1d.weight", None)] = split(0, kd, kd, vd)
                rules[(f"{p}dt_bias", None)] = split(0, hv)
                rules[(f"{p}A_log", None)] = split(0, hv)
                rules[(f"{p}out_proj.weight", None)] = split(1, vd)
        vocab = hf_config["vocab_size"]
        shard = cdiv(vocab, size)
        for name in ("embed_tokens.weight", "lm_head.weight"):
            rules[(name, None)] = VocabSplit(vocab, shard, rank)

    def take(self, name: str, shard: int | None, tensor) -> torch.Tensor:
        rule = self.rules.get((name, shard))
        return materialize(tensor) if rule is None else rule.take(tensor)


# ---- the collectives in the forward ---------------------------------------------------
class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the embedding: other ids
    look up zeros here, and the all-reduce adds the rank that holds them."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group):
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


def shard_model(model: nn.Module, group, vocab_size: int) -> None:
    """After loading: the embedding becomes vocab-parallel, lm_head all-gathers its
    logits (cut to `vocab_size`), and each block ending in a row-parallel projection
    all-reduces its output."""
    from tokenmill.models.deepseek_v2 import DeepseekMoE, MLAttention
    from tokenmill.models.layers.gated_deltanet import GatedDeltaNet
    from tokenmill.models.layers.mlp import GatedMLP
    from tokenmill.models.gemma3 import GeluTanhMLP
    from tokenmill.models.layers.moe import FusedMoE, SparseMoeBlock

    def reduce(module, args, out):
        return group.all_reduce(out)

    def gather(module, args, out):
        logits = group.all_gather_last(out)
        return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size]

    # A shared expert's partial sum joins its MoE block's all-reduce.
    shared = {id(getattr(m, "shared_expert", None) or getattr(m, "shared_experts", None))
              for m in model.modules() if isinstance(m, (SparseMoeBlock, DeepseekMoE))}
    # Experts inside such a block reduce with it; experts outside one (Gemma 4's, beside
    # the dense MLP, each normalised apart) reduce their own output.
    in_block = {id(e) for m in model.modules() if isinstance(m, (SparseMoeBlock, DeepseekMoE))
                for e in m.modules() if isinstance(e, FusedMoE)}
    for name, m in list(model.named_modules()):
        if _replicated(name):
            continue
        if isinstance(m, (GatedDeltaNet, SparseMoeBlock, DeepseekMoE, MLAttention)) or (
                isinstance(m, (GatedMLP, GeluTanhMLP)) and id(m) not in shared) or (
                isinstance(m, FusedMoE) and id(m) not in in_block) or _is_attention(m):
            m.register_forward_hook(reduce)
    emb = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(emb.weight, group.rank * emb.num_embeddings,
                                                group)
    model.lm_head.register_forward_hook(gather)
    model.config.vocab_size = vocab_size  # the batch's view: the whole vocabulary
