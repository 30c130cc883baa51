"""On-device sampling, vectorised over the batch.

Random rows sample by the exponential race (argmax of probs / Exp(1) noise),
which equals a categorical draw. A seeded request draws its noise from its own
generator, one [vocab] row per step, so its tokens do not depend on whatever
else shares the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32; 1.0 on greedy rows (never divides by 0)
    greedy_mask: torch.Tensor  # [N] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [N] int32, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [N] float32; None when no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None,
                      p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus to -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if k is not None:
        k = torch.where(k > 0, k, vocab).clamp(max=vocab).long()
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits [N, V] float32 -> sampled token ids [N] int64."""
        if md.all_greedy:
            return logits.argmax(dim=-1)
        greedy = None if md.all_random else logits.argmax(dim=-1)
        logits = logits / md.temperature.unsqueeze(1)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            noise.exponential_()
        for row, gen in md.generators.items():
            noise[row].exponential_(generator=gen)
        sampled = probs.div_(noise).argmax(dim=-1)
        if greedy is not None:
            sampled = torch.where(md.greedy_mask, greedy, sampled)
        return sampled
