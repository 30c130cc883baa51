"""Tensor parallelism, the Megatron way: which slice of each weight a rank holds,
and the collectives that put the ranks' partial results together.

The generic mechanics only: what is split, and how, is declared by the layers.

- A rank's model is the model class built from a *rank config*: the head counts and
  intermediate sizes divided by the number of ranks (`rank_config`; a model class
  may adjust its own fields with `tp_rank_config`), so every layer allocates its
  shard only and computes with its local heads unchanged (the KV cache and the
  Gated DeltaNet state per rank hold its heads only).
- Each module may declare `tp_plan(tp) -> {(parameter, checkpoint shard): slice}`,
  built with the `RankSlices` helpers below. A `Linear` derives its plan from the
  role its model gave it (layers/linear.py: "column", "row", a packed q|k|v split by
  heads, "replicated"); modules with weights of their own layout (the stacked MoE
  experts, Gated DeltaNet's conv and per-head tensors) declare theirs. Anything not
  named is replicated (norms, routers, the latent projection of MLA, Gemma 4's
  per-layer inputs).
- A module whose output is a partial sum over the ranks says so (`tp_reduces`: a
  row-parallel Linear, the experts, an MoE block that adds its shared expert first);
  the outermost such module all-reduces its output, once. A row-parallel bias is
  added by rank 0 only.
- Vocab-parallel: the embedding (each rank its rows, ids outside them masked, then
  all-reduced) and lm_head (each rank its vocabulary shard, all-gathered).
- KV heads: split like the query heads, or replicated where the model has fewer than
  ranks (each rank the KV head its query heads read). A model whose layers differ in
  KV head count (Gemma 4's global layers) gives each layer's with
  `tp_layer_kv_heads(hf_config)`; each layer splits at its own.
- Submodules every rank holds whole (REPLICATED_SUBMODULES: a vision tower) get no
  slices and no collectives.

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


def layer_kv_heads(hf_config: dict, model_cls=None) -> list[int] | None:
    """Each layer's KV head count where the model's layers differ (its class's
    `tp_layer_kv_heads`); None: one count for all."""
    per_layer = getattr(model_cls, "tp_layer_kv_heads", None)
    return per_layer(hf_config) if per_layer is not None else None


def check_divisible(hf_config: dict, size: int, model_cls=None) -> None:
    """The model's heads and sizes split evenly over `size` ranks, or a ValueError
    naming tensor_parallel_size and the field that does not (`model_cls`: the model
    class, for its per-layer KV head counts)."""
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
    per_layer = layer_kv_heads(hf_config, model_cls)
    if per_layer is not None:
        kv_counts += [(f"num_key_value_heads of layer {i} (per_layer_config / "
                       f"num_global_key_value_heads)", n) for i, n in enumerate(per_layer)]
    for name, n in kv_counts:
        if n % size and size % n:
            raise ValueError(f"{TP_FIELD}={size}: the model's {name} ({n}) must divide "
                             f"by it, or divide it (KV heads replicated)")


def rank_config(hf_config: dict, size: int, model_cls=None) -> dict:
    """The config one rank's model is built from: its share of every split dim (and
    of the model class's own, `tp_rank_config`)."""
    c = dict(hf_config)
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    c["head_dim"] = c.get("head_dim") or c["hidden_size"] // heads  # unchanged per head
    c["num_attention_heads"] = heads // size
    c["num_key_value_heads"] = max(1, kv // size)
    for name in ("intermediate_size", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "linear_num_key_heads",
                 "linear_num_value_heads"):
        if c.get(name):
            c[name] //= size
    c["vocab_size"] = cdiv(c["vocab_size"], size)
    own = getattr(model_cls, "tp_rank_config", None)
    if own is not None:
        own(c, size)
    return c


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


    def local_len(self) -> int:
        """This rank's length along `dim` (its pieces of every segment)."""
        return sum(full // n for full, n, _ in self.segments)

    def full_len(self) -> int:
        return sum(full for full, _, _ in self.segments)

    def regrid(self, dim: int, unit: int, what: str) -> "Split":
        """The same pieces of a tensor whose `dim` counts the split dim in units of
        `unit` (a scale per block of `unit` rows, a word of `unit` codes, a group of
        `unit` columns): every rank's piece must start and end on a unit, else a
        ValueError naming `what` (a quantized layer's shard would cut a block, word or
        group in two)."""
        segments = []
        for full, n, i in self.segments:
            step = full // n
            if step % unit:
                raise ValueError(f"{TP_FIELD}: {what}: a rank's {step} of {full} is not a "
                                 f"multiple of {unit}, so the split would cut one in two "
                                 f"(not supported)")
            segments.append((full // unit, n, i))
        return Split(dim, tuple(segments))

    def local_shape(self, index: int) -> "LocalShape":
        """A stored (N, K) shape whose entry `index` this split shortens."""
        return LocalShape(index, self.full_len(), self.local_len())


@dataclass(frozen=True)
class LocalShape:
    """compressed-tensors' `weight_shape` (N, K) of this rank's shard: entry `index`
    (0: rows, 1: columns) becomes the rank's length of the split dim."""
    index: int
    full: int
    local: int

    def take(self, tensor) -> torch.Tensor:
        t = materialize(tensor).clone()
        if int(t[self.index]) != self.full:
            raise ValueError(f"weight_shape {t.tolist()}: entry {self.index} should be "
                             f"{self.full}")
        t[self.index] = self.local
        return t


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


class RankSlices:
    """What a module's `tp_plan(tp)` builds its slices with: this rank, the ranks, and
    the checkpoint's KV head counts. Sizes are of the full (checkpoint) tensors."""

    def __init__(self, rank: int, size: int, kv_heads: int,
                 kv_by_layer: list[int] | None = None):
        self.rank, self.size = rank, size
        self._kv_heads, self._kv_by_layer = kv_heads, kv_by_layer

    def kv_heads(self, layer_idx: int | None = None) -> int:
        """The checkpoint's KV head count (of layer `layer_idx` where layers differ)."""
        return self._kv_heads if self._kv_by_layer is None else self._kv_by_layer[layer_idx]

    def split(self, dim: int, *fulls: int) -> Split:
        """Each of the consecutive segments `fulls` (along `dim`) in equal pieces."""
        return Split(dim, tuple((f, self.size, self.rank) for f in fulls))

    def first_rank_only(self) -> FirstRankOnly:
        return FirstRankOnly(self.rank)

    def column(self, out_features: int, output_sizes=None) -> dict:
        """A column-parallel Linear of `out_features` rows on this rank: its rows of
        each packed segment (`output_sizes`, this rank's, one checkpoint shard each; a
        shard may itself be several segments), or of the whole."""
        shards = [(s,) if isinstance(s, int) else tuple(s)
                  for s in (output_sizes or (out_features,))]
        full = [[n * self.size for n in shard] for shard in shards]
        rules = {}
        for w in ("weight", "bias"):
            rules[(w, None)] = self.split(0, *(n for shard in full for n in shard))
            if output_sizes:
                for i, shard in enumerate(full):
                    rules[(w, i)] = self.split(0, *shard)
        return rules

    def row(self, in_features: int) -> dict:
        """A row-parallel Linear of `in_features` input columns on this rank; its bias
        added once."""
        return {("weight", None): self.split(1, in_features * self.size),
                ("bias", None): self.first_rank_only()}

    def qkv(self, spec) -> dict:
        """A packed q | k | v Linear (layers/linear.py QKVParallel): q by heads; K and V
        by heads too, or (fewer KV heads than ranks) the one KV head this rank's query
        heads read. A missing section (k_rows / v_rows 0) has no shard to cut."""
        d = spec.head_dim
        kv_full = self.kv_heads(spec.layer_idx)
        kv_pieces = min(kv_full, self.size)
        kv_seg = (kv_full * d, kv_pieces, self.rank * kv_pieces // self.size)
        q = spec.q_rows * self.size
        segments = [(q, self.size, self.rank)] + [kv_seg for n in (spec.k_rows, spec.v_rows)
                                                  if n]
        rules = {}
        for w in ("weight", "bias"):
            rules[(w, 0)] = self.split(0, q)
            for shard, n in ((1, spec.k_rows), (2, spec.v_rows)):
                if n:
                    rules[(w, shard)] = Split(0, (kv_seg,))
            rules[(w, None)] = Split(0, tuple(segments))
        return rules


class ShardPlan:
    """(parameter name, packed shard index or None) -> how this rank slices the
    checkpoint tensor that fills it, from the modules' `tp_plan`s; anything not
    named is replicated."""

    def __init__(self, model: nn.Module, hf_config: dict, rank: int, size: int):
        kv = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
        tp = RankSlices(rank, size, kv, layer_kv_heads(hf_config, type(model)))
        self.rules: dict[tuple[str, int | None], object] = {}
        for mod_name, m in model.named_modules():
            plan = getattr(m, "tp_plan", None)
            if plan is None or _replicated(mod_name):
                continue
            p = mod_name + "." if mod_name else ""
            try:
                rules = plan(tp)
            except ValueError as e:  # a quantized layer's shards: name the layer
                raise ValueError(f"layer {mod_name}: {e}") from None
            for (name, shard), rule in rules.items():
                self.rules[(p + name, shard)] = rule
        vocab = hf_config["vocab_size"]
        shard = cdiv(vocab, size)
        for name in ("embed_tokens.weight", "lm_head.weight"):
            self.rules[(name, None)] = VocabSplit(vocab, shard, rank)

    def take(self, name: str, shard: int | None, tensor) -> torch.Tensor:
        rule = self.rules.get((name, shard))
        if rule is None:
            return materialize(tensor)
        try:
            return rule.take(tensor)
        except ValueError as e:  # (a quantized tensor's data refusing the split)
            raise ValueError(f"parameter {name}: {e}") from None


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
    logits (cut to `vocab_size`), and each outermost module whose output is a partial
    sum (`tp_reduces`) all-reduces it."""

    def reduce(module, args, out):
        return group.all_reduce(out)

    def gather(module, args, out):
        logits = group.all_gather_last(out)
        return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size]

    inside: set[int] = set()  # modules a reducing module around them reduces for
    for name, m in model.named_modules():  # (parents before their children)
        if _replicated(name) or id(m) in inside or not getattr(m, "tp_reduces", False):
            continue
        m.register_forward_hook(reduce)
        inside.update(id(sub) for sub in m.modules())
    emb = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(emb.weight, group.rank * emb.num_embeddings,
                                                group)
    if model.lm_head is not None:  # (None: a checkpoint without one, it only pools)
        model.lm_head.register_forward_hook(gather)
    model.config.vocab_size = vocab_size  # the batch's view: the whole vocabulary


def whole_vocab_io(model: nn.Module, group, vocab_size: int) -> tuple[nn.Embedding, nn.Linear]:
    """The embedding and lm_head whole, from every rank's rows (a collective: every rank
    calls it, after loading and before the platform prepares the layers): what a draft
    model that runs unsharded on rank 0 shares with the target."""
    head = model.lm_head
    weight = getattr(head, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2
            or not weight.is_floating_point() or getattr(head, "bias", None) is not None):
        raise ValueError("speculative decoding with a draft model under "
                         f"{TP_FIELD} > 1 needs the target's lm_head as a plain "
                         "floating-point weight without bias (the draft runs on rank 0 "
                         "with the whole head)")

    def rows(w: torch.Tensor) -> torch.Tensor:  # [shard, H] per rank -> [vocab, H]
        return group.all_gather_last(w.detach().t()).t()[:vocab_size].contiguous()

    emb = rows(model.embed_tokens.weight)
    lm = rows(weight)
    embed = nn.Embedding(emb.shape[0], emb.shape[1], _weight=emb)
    linear = nn.Linear(lm.shape[1], lm.shape[0], bias=False, device=lm.device, dtype=lm.dtype)
    linear.weight = nn.Parameter(lm, requires_grad=False)
    return embed.requires_grad_(False), linear
