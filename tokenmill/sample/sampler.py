"""On-device sampling, vectorised over the batch.

The order follows vLLM: raw logprobs are taken from the model's logits first;
then a structured request's grammar bitmask (forbidden tokens to -inf), then
the logits processors run (allowed tokens, bad words and min_tokens as
-inf masks, logit_bias, penalties), then temperature, min_p and top-k / top-p,
and finally the draw. A batch where every row is greedy and nothing needs a
processor or logprobs takes a plain argmax.

Random rows sample by the inverse of their cumulative distribution (the first
token whose running sum passes a uniform share of the row's total; on the CPU the
native draw_rows takes it from the scaled logits, with no probabilities tensor). A seeded
request draws its uniform from its own generator, one per step, so its tokens do
not depend on whatever else shares the batch. compute_probs (the transform) and
random_sample (the draw) are shared with the rejection sampler of speculative
decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.sample.bitmask import apply_grammar_bitmask


@dataclass
class Penalties:
    """Repetition / frequency / presence penalties for a subset of rows."""

    rows: torch.Tensor  # [R] long: rows of the batch these apply to
    presence: torch.Tensor  # [R] float32
    frequency: torch.Tensor  # [R] float32
    repetition: torch.Tensor  # [R] float32
    prompt_token_ids: torch.Tensor  # [R, Lp] long, padded with vocab_size
    output_token_ids: torch.Tensor  # [R, Lo] long, padded with vocab_size


@dataclass
class SamplingMetadata:
    # [N] float32, 1.0 on greedy rows (never divides by 0) / [N] bool; None when all_greedy.
    temperature: torch.Tensor | None
    greedy_mask: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [N] int32, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [N] float32; None when no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    min_p: torch.Tensor | None = None  # [N] float32; None when no row uses it
    # Top-k width of the logprobs to return (None: no row wants logprobs).
    max_num_logprobs: int | None = None
    # (rows [A], index into rows [M], token ids [M]): rows with an allow-list
    # may sample only the tokens listed for them.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids) that must not be sampled now (bad words, min_tokens).
    blocked: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids, bias) added to the logits.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    # Structured output: (batch rows [R] long, packed bitmask [R, ceil(V / 32)] int32);
    # tokens a row's grammar forbids go to -inf (tokenmill.sample.bitmask).
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def no_processors(self) -> bool:
        return (self.allowed_token_ids is None and self.blocked is None
                and self.logit_bias is None and self.penalties is None)


@dataclass
class LogprobsTensors:
    """Column 0: the chosen token; columns 1..k: the top-k tokens. ranks: 1-based."""

    token_ids: torch.Tensor  # [N, 1 + k] long
    logprobs: torch.Tensor  # [N, 1 + k] float32
    ranks: torch.Tensor  # [N] long


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] long
    logprobs: LogprobsTensors | None = None


def gather_logprobs(logprobs: torch.Tensor, k: int, chosen: torch.Tensor,
                    ops=None) -> LogprobsTensors:
    """Top-k of each row plus the chosen token's logprob and rank. `ops`: the native CPU
    kernels, whose row_logprobs takes all three in one pass over each row (~0.2 ms
    against ~3.4 ms for torch's compare-and-sum and topk at 128 fp32 rows of a 32k
    vocabulary on two threads); of equal values it lists the earlier index first."""
    if (ops is not None and 0 <= k <= 64 and k <= logprobs.shape[1]
            and logprobs.dtype == torch.float32 and _native_rows(logprobs, ops)):
        return LogprobsTensors(*ops.row_logprobs(logprobs, chosen, k))
    chosen = chosen.long().unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)
    # Rank = 1 + how many tokens are strictly more likely than the chosen one.
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=1)
        ids = torch.cat([chosen, top_ids], dim=1)
        lps = torch.cat([chosen_lp, top_lp], dim=1)
    else:
        ids, lps = chosen, chosen_lp
    return LogprobsTensors(ids, lps.float(), ranks)


def _native_rows(x: torch.Tensor, ops) -> bool:
    """Whether the native row_argmax takes x [N, V]: CPU rows of fp32 / bf16 / fp16."""
    return (ops is not None and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def argmax_rows(x: torch.Tensor, ops=None) -> torch.Tensor:
    """x.argmax(dim=-1) of x [N, V] (the first maximum; a row's first NaN if it has
    one); `ops`: the native CPU kernels, whose row_argmax reads each row once for its
    maximum and one block again for the index (0.37 against 1.18 ms for torch's at 128
    fp32 rows of a 32k vocabulary on two threads)."""
    return ops.row_argmax(x)[0] if _native_rows(x, ops) else x.argmax(dim=-1)


def greedy_argmax(logits: torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N] int64, NaN rows [N] bool) of raw logits [N, V] in their own dtype: the
    ids of `logits.float().argmax(-1)` (the first maximum; NaN counts as the maximum)
    and the rows holding a NaN, from one pass. `ops`: the native CPU kernels' row_argmax
    (0.2 against 1.2 ms for max(dim=1) at 128 rows of a 32k bf16 vocabulary on two
    threads). Else one max() pass: on CPU a bf16 argmax is not vectorised and max is,
    and no widened copy is made (a quarter of the time of copy + argmax + isnan)."""
    if _native_rows(logits, ops):
        return ops.row_argmax(logits)
    values, ids = logits.max(dim=1)
    return ids, torch.isnan(values)


def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows of x [N, K] holding an inf or a NaN (= ~isfinite(x).all(1)).
    x * 0 is 0 where x is finite and NaN where it is not, so a row's sum of it is NaN
    exactly then: two ops where isfinite().all() takes five."""
    return torch.isnan(x.mul(0).sum(dim=1, dtype=torch.float32))


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """In place, on p.rows: repetition (prompt and output tokens, HF's rule),
    then frequency and presence (output tokens, OpenAI's rule).

    On the CPU only the tokens a row has seen are touched (a few hundred of a row's V):
    the dense form's passes over [R, V + 1] count and mask tensors took ~9 ms a step at
    128 rows of a 32k vocabulary (two threads; 20-30 ms under load) against ~2. Elsewhere the dense
    form (a GPU reads those tensors in microseconds, and needs no host sync). Both give
    the same values: the same arithmetic on each seen token, the others untouched."""
    if logits.device.type == "cpu":
        _apply_penalties_sparse(logits, p)
    else:
        _apply_penalties_dense(logits, p)


def _apply_penalties_dense(logits: torch.Tensor, p: Penalties) -> None:
    vocab = logits.shape[1]
    sub = logits[p.rows]
    num_rows = sub.shape[0]
    counts = torch.zeros(num_rows, vocab + 1, dtype=sub.dtype, device=sub.device)
    counts.scatter_add_(1, p.output_token_ids, torch.ones_like(p.output_token_ids, dtype=sub.dtype))
    counts = counts[:, :vocab]
    in_output = counts > 0
    in_prompt = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=sub.device)
    in_prompt.scatter_(1, p.prompt_token_ids, True)
    seen = in_prompt[:, :vocab] | in_output
    rep = p.repetition.unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= p.frequency.unsqueeze(1) * counts
    sub -= p.presence.unsqueeze(1) * in_output.to(sub.dtype)
    logits[p.rows] = sub


def _apply_penalties_sparse(logits: torch.Tensor, p: Penalties) -> None:
    vocab = logits.shape[1]
    i_all = torch.arange(p.rows.numel(), device=logits.device).unsqueeze(1)
    # Repetition on every prompt and output token: a token listed twice is read and
    # written twice, the same value both times (every read comes before any write).
    ids = torch.cat([p.prompt_token_ids, p.output_token_ids], dim=1)
    listed = ids < vocab  # (vocab: the padding)
    i, tok = i_all.expand_as(ids)[listed], ids[listed]
    rows = p.rows[i]
    x = logits[rows, tok]
    rep = p.repetition[i]
    logits[rows, tok] = torch.where(x > 0, x / rep, x * rep)
    # Frequency and presence on each output token once, with its count.
    stride = vocab + 1
    keys, counts = torch.unique((i_all * stride + p.output_token_ids).flatten(),
                                return_counts=True)
    listed = keys % stride < vocab
    keys, counts = keys[listed], counts[listed].to(logits.dtype)
    i, tok = keys // stride, keys % stride
    rows = p.rows[i]
    x = logits[rows, tok] - p.frequency[i] * counts
    logits[rows, tok] = x - p.presence[i]  # (every one of these is in the output)


def apply_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """allowed tokens, bad words / min_tokens, logit_bias, penalties: in place on a copy."""
    logits = logits.clone()
    if md.allowed_token_ids is not None:
        rows, which, toks = md.allowed_token_ids
        keep = torch.zeros(rows.shape[0], logits.shape[1], dtype=torch.bool,
                           device=logits.device)
        keep[which, toks] = True
        logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    if md.blocked is not None:
        rows, toks = md.blocked
        logits[rows, toks] = float("-inf")
    if md.logit_bias is not None:
        rows, toks, bias = md.logit_bias
        logits.index_put_((rows, toks), bias, accumulate=True)
    if md.penalties is not None:
        apply_penalties(logits, md.penalties)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability:
    exp(x - max) < min_p, so x < max + log(min_p) (no softmax; min_p 0: log 0 = -inf
    keeps all). A new tensor."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_k_top_p_(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                 ops=None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Mask, in place, the logits [N, V] outside each row's min-p, top-k and top-p cuts
    (in that order) to -inf; -> [N, 1], each row's smallest value kept (its threshold).

    min_p keeps the values whose probability is at least min_p times the top one
    (apply_min_p); top-k then the values at or above the k-th largest (k <= 0 or >= V:
    all); top-p then the values at or above the first one, from the top, at which the
    probability mass (renormalised over what is kept so far) of the values so far,
    itself included, reaches p; the most likely value always stays. Equal values are
    kept or dropped together. `ops`: the native CPU kernels, whose radix select needs no
    sort and masks each row while it is in cache (~4 ms against ~125 ms for torch's sort
    and ~9 ms for its masked_fill at 128 fp32 rows of a 32k vocabulary on two threads);
    else a sort of each row."""
    if _native_rows(logits, ops) and logits.dtype == torch.float32:
        none = logits.new_empty(0)
        thr = ops.top_k_top_p_mask_(logits, none if k is None else k, none if p is None else p,
                                    none if min_p is None else min_p)
        return thr.unsqueeze(1)
    thr_min = logits.new_full((logits.shape[0], 1), float("-inf"))
    if min_p is not None:  # (apply_min_p, in place)
        thr_min = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
        logits.masked_fill_(logits < thr_min, float("-inf"))
    if k is None and p is None:
        return thr_min
    vocab = logits.shape[-1]
    ordered = logits.sort(dim=-1).values  # ascending: the tail's small masses sum first
    thr = ordered[:, :1]
    if k is not None:
        k = torch.where(k > 0, k, vocab).clamp(max=vocab).long()
        thr = ordered.gather(1, (vocab - k).unsqueeze(1))
    if p is not None:
        below = ordered.masked_fill(ordered < thr, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
        # Past the values whose mass, from the bottom, stays within 1 - p (at most the
        # last: the most likely value stays).
        at = (below <= (1 - p).unsqueeze(1)).sum(dim=1, keepdim=True).clamp_(max=vocab - 1)
        thr = torch.maximum(thr, ordered.gather(1, at))
    logits.masked_fill_(logits < thr, float("-inf"))
    return torch.maximum(thr, thr_min)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None,
                      p: torch.Tensor | None, ops=None) -> torch.Tensor:
    """A copy of logits with top_k_top_p_'s mask."""
    logits = logits.clone()
    top_k_top_p_(logits, k, p, ops)
    return logits


def scaled_logits(logits: torch.Tensor, md: SamplingMetadata, ops=None) -> torch.Tensor:
    """A random row's logits as it draws from them: over its temperature, then min-p,
    top-k and top-p (a new tensor). `ops`: the native CPU kernels (the cuts without a
    sort)."""
    logits = logits / md.temperature.unsqueeze(1)
    if md.min_p is not None or md.top_k is not None or md.top_p is not None:
        # (logits: this function's own)
        top_k_top_p_(logits, md.top_k, md.top_p, ops, min_p=md.min_p)
    return logits


def compute_probs(logits: torch.Tensor, md: SamplingMetadata, ops=None) -> torch.Tensor:
    """The distribution a random row samples from: the softmax of scaled_logits. Shared
    with the rejection sampler, which must verify drafts against exactly the
    distribution the normal sampler would draw from."""
    return scaled_logits(logits, md, ops).softmax(dim=-1)


def uniforms(n: int, generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """[n] float32 in [0, 1): one a row, row r of a seeded request from generators[r]
    only (so its tokens do not depend on what else shares the batch)."""
    u = torch.empty(n, dtype=torch.float32, device=device)
    if len(generators) < n:
        u.uniform_()
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, device=device)
    return u


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One categorical draw per row of probs [N, V] (rows need not sum to 1) by the
    inverse of its cumulative distribution: the first token whose running sum passes a
    uniform share of the row's total. One uniform a row: the exponential race drew V
    (torch's exponential_ took ~59 ms for 128 rows of a 32k vocabulary on two CPU
    threads, against ~2 ms for this cumsum and search).

    Row r of a seeded request draws its uniform from generators[r] only."""
    n, vocab = probs.shape
    u = uniforms(n, generators, probs.device).unsqueeze(1)
    cum = probs.float().cumsum(dim=-1)
    total = cum[:, -1:]
    # The first running sum past the target rises there, so its token has probability
    # (adding a zero leaves a sum as it was); the target stays below the total, where
    # u * total could round up to it (past every token).
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=vocab - 1)


def draw(logits: torch.Tensor, md: SamplingMetadata, ops=None) -> torch.Tensor:
    """[N] token ids: each row drawn from compute_probs's distribution by random_sample's
    rule. `ops`: the native CPU kernels, whose draw_rows takes it from the scaled logits
    themselves (no softmax, cumsum or search: ~0.6 against ~9 ms at 128 fp32 rows of a
    32k vocabulary on two threads)."""
    if _native_rows(logits, ops) and logits.dtype == torch.float32:
        scaled = scaled_logits(logits, md, ops)
        return ops.draw_rows(scaled, uniforms(scaled.shape[0], md.generators, scaled.device))
    return random_sample(compute_probs(logits, md, ops), md.generators)


class Sampler:
    def __init__(self, ops=None):
        """`ops`: the native CPU kernels (the platform's), for the argmaxes, the min-p /
        top-k / top-p cut and the logprobs; None: torch's."""
        self.ops = ops

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] float32 -> sampled token ids [N] (and logprobs when asked)."""
        # Raw logprobs: of the model's distribution, before any processor.
        raw = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if md.grammar_bitmask is not None:  # the grammar first, then the processors
            logits = apply_grammar_bitmask(logits, *md.grammar_bitmask, self.ops)
        if not md.no_processors:
            logits = apply_processors(logits, md)
        sampled = self._sample(logits, md)
        logprobs = (None if raw is None
                    else gather_logprobs(raw, md.max_num_logprobs, sampled, self.ops))
        return SamplerOutput(sampled, logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:
            return argmax_rows(logits, self.ops)
        greedy = None if md.all_random else argmax_rows(logits, self.ops)
        sampled = draw(logits, md, self.ops)
        if greedy is not None:
            sampled = torch.where(md.greedy_mask, greedy, sampled)
        return sampled
