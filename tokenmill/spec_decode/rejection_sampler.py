"""Lossless verification of draft tokens (speculative decoding).

Each request brings k >= 0 drafts and k + 1 rows of target logits: row j scores
the token after draft j - 1 (so it verifies draft j) and the last row is the
bonus position. Greedy requests accept drafts while they equal the argmax.
Random requests use the rule of Leviathan et al. / Chen et al. (2023): with p
the target distribution (the normal sampler's transform: temperature, min_p,
top-k / top-p) and q the draft's, accept draft d with probability
min(1, p(d) / q(d)); at the first rejection draw from normalize(max(p - q, 0)),
and when every draft is accepted draw from the bonus row's p. Every emitted
token is then distributed exactly as plain sampling from the target.
Deterministic drafters (n-gram) have no q: it is one-hot on the draft, so the
acceptance probability is p(d) and the recovery distribution is p without d.

Randomness follows the normal sampler: a seeded request draws its uniforms,
then the uniform of its last token's draw, from its own generator, so its tokens
do not depend on the batch, and a request with no drafts draws exactly what
Sampler would.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.sample.sampler import (SamplingMetadata, argmax_rows, compute_probs,
                                      random_sample)


@dataclass
class RejectionOutput:
    token_ids: torch.Tensor  # [R, max_k + 1] long: the tokens each request emits, -1 padded
    num_emitted: torch.Tensor  # [R] long: 1 + accepted drafts (always >= 1)
    num_accepted: torch.Tensor  # [R] long: accepted drafts


def _check_inputs(logits, cu_num_logits, draft_token_ids, md, draft_probs) -> int:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if cu_num_logits.dim() != 1 or cu_num_logits.numel() < 1:
        raise ValueError("cu_num_logits must be [R + 1]")
    num_reqs = cu_num_logits.numel() - 1
    num_rows = logits.shape[0]
    cu = cu_num_logits.tolist()
    if cu[0] != 0 or cu[-1] != num_rows:
        raise ValueError(f"cu_num_logits must run from 0 to the {num_rows} logits rows, "
                         f"got {cu[0]} .. {cu[-1]}")
    if any(b - a < 1 for a, b in zip(cu, cu[1:])):
        raise ValueError("every request needs at least one logits row (its bonus position)")
    if draft_token_ids.shape != (num_rows - num_reqs,):
        raise ValueError(f"{num_reqs} requests over {num_rows} rows have "
                         f"{num_rows - num_reqs} drafts, got draft_token_ids of shape "
                         f"{tuple(draft_token_ids.shape)}")
    if draft_probs is not None and draft_probs.shape != (num_rows - num_reqs, logits.shape[1]):
        raise ValueError(f"draft_probs must be [{num_rows - num_reqs}, {logits.shape[1]}], "
                         f"got {tuple(draft_probs.shape)}")
    for name in ("temperature", "greedy_mask", "top_k", "top_p", "min_p"):
        t = getattr(md, name)
        if t is not None and t.shape[0] != num_reqs:
            raise ValueError(f"md.{name} has {t.shape[0]} rows for {num_reqs} requests")
    if any(not 0 <= r < num_reqs for r in md.generators):
        raise ValueError("md.generators names a request outside the batch")
    return num_reqs


class RejectionSampler:
    def __init__(self, ops=None):
        """`ops`: the native CPU kernels (the platform's): the argmaxes and the top-k /
        top-p cut the Sampler takes. None: torch's."""
        self.ops = ops

    def __call__(self, logits: torch.Tensor, cu_num_logits: torch.Tensor,
                 draft_token_ids: torch.Tensor, md: SamplingMetadata,
                 draft_probs: torch.Tensor | None = None) -> RejectionOutput:
        """Verify each request's drafts; see the module docstring for the rule."""
        num_reqs = _check_inputs(logits, cu_num_logits, draft_token_ids, md, draft_probs)
        dev = logits.device
        if draft_probs is not None:
            draft_probs = draft_probs.to(dev)
        cu = cu_num_logits.to(dev).long()
        num_drafts = cu.diff() - 1  # k_i
        reqs = torch.arange(num_reqs, device=dev)
        max_k = int(num_drafts.max()) if num_reqs else 0
        drafts = draft_token_ids.to(dev).long()
        # Draft d of request i sits at flat index d and is verified by logits row d + i.
        draft_req = reqs.repeat_interleave(num_drafts)
        draft_rows = torch.arange(drafts.numel(), device=dev) + draft_req

        greedy_tok = None if md.all_random else argmax_rows(logits, self.ops)
        probs = None
        if md.all_greedy:
            accept = greedy_tok[draft_rows] == drafts
        else:
            # Per-row copy of the requests' sampling parameters (the generators stay per request).
            row_req = reqs.repeat_interleave(num_drafts + 1)
            rows_md = replace(md, generators={}, **{
                name: getattr(md, name)[row_req]
                for name in ("temperature", "greedy_mask", "top_k", "top_p", "min_p")
                if getattr(md, name) is not None})
            probs = compute_probs(logits, rows_md, self.ops)
            p_d = probs[draft_rows, drafts]
            q_d = (torch.ones_like(p_d) if draft_probs is None
                   else draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1))
            # u < p/q accepts with probability min(1, p/q); written without the division,
            # so a draft the drafter gave no mass (q = 0) is rejected rather than NaN.
            accept = self._uniforms(drafts.numel(), num_drafts, md.generators, dev) * q_d < p_d
            if not md.all_random:
                greedy_d = md.greedy_mask.to(dev)[draft_req]
                accept = torch.where(greedy_d, greedy_tok[draft_rows] == drafts, accept)

        # Padded [R, max_k] views: mask fills in request order, as the drafts are flattened.
        slot = torch.arange(max_k, device=dev)
        has_slot = slot < num_drafts.unsqueeze(1)
        accept_2d = torch.zeros(num_reqs, max_k, dtype=torch.bool, device=dev)
        accept_2d[has_slot] = accept
        drafts_2d = torch.full((num_reqs, max_k), -1, dtype=torch.long, device=dev)
        drafts_2d[has_slot] = drafts
        # Accepted = length of the all-accepted prefix: verification stops at the first rejection.
        num_accepted = accept_2d.long().cumprod(dim=1).sum(dim=1)

        # One more token per request, from the row where verification stopped: the
        # first rejected draft's row (recovery), or the bonus row when all passed.
        stop_rows = cu[:-1] + num_accepted
        if md.all_greedy:
            last = greedy_tok[stop_rows]
        else:
            rejected = num_accepted < num_drafts
            # Flat index of the rejected draft; clamped (and unused) for bonus rows.
            rej_draft = (stop_rows - reqs).clamp(max=max(drafts.numel() - 1, 0))
            p = probs[stop_rows]
            if drafts.numel():
                q = None if draft_probs is None else draft_probs[rej_draft]
                p = torch.where(rejected.unsqueeze(1),
                                recovery_probs(p, drafts[rej_draft], q), p)
            last = random_sample(p, md.generators)
            if not md.all_random:
                last = torch.where(md.greedy_mask.to(dev), greedy_tok[stop_rows], last)

        token_ids = torch.cat([drafts_2d, drafts_2d.new_full((num_reqs, 1), -1)], dim=1)
        token_ids[:, :max_k].masked_fill_(slot >= num_accepted.unsqueeze(1), -1)
        token_ids.scatter_(1, num_accepted.unsqueeze(1), last.unsqueeze(1))
        return RejectionOutput(token_ids, num_accepted + 1, num_accepted)

    @staticmethod
    def _uniforms(n: int, num_drafts: torch.Tensor, generators: dict[int, torch.Generator],
                  dev: torch.device) -> torch.Tensor:
        """U[0, 1) per draft; a seeded request's come from its own generator, before its
        last token's draw, and a request without drafts draws none (its stream stays
        Sampler's)."""
        u = torch.empty(n, device=dev)
        if len(generators) < num_drafts.numel():  # as Sampler: the global RNG only if used
            u.uniform_()
        if generators:
            starts = (num_drafts.cumsum(0) - num_drafts).tolist()
            ks = num_drafts.tolist()
            for req, gen in generators.items():
                if ks[req]:
                    u[starts[req]:starts[req] + ks[req]] = torch.rand(
                        ks[req], generator=gen, device=dev)
        return u


def recovery_probs(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """Unnormalised max(p - q, 0) after draft `draft` was rejected (q None: one-hot on it).

    Left unnormalised: random_sample draws from a row's own total. A row
    that is all zero (p == q up to rounding) falls back to p."""
    if q is None:
        res = p.scatter(1, draft.unsqueeze(1), 0.0)
    else:
        res = (p - q).clamp_min_(0.0)
    empty = res.sum(dim=1, keepdim=True) <= 0
    return torch.where(empty, p, res)
