"""Engine logprobs ({token id: Logprob} per position) in the OpenAI API's shapes.

A position is (token id, {id: Logprob} or None); None only for the first
prompt token, which nothing predicts.
"""
from __future__ import annotations

import math


def finite(x: float) -> float:
    """JSON has no -inf: OpenAI reports impossible tokens as -9999.0."""
    x = float(x)
    return x if math.isfinite(x) else -9999.0


def _rank_key(item):
    _, lp = item
    return (lp.rank if lp.rank is not None else math.inf, -lp.logprob)


def sample_positions_of(completion) -> list:
    return list(zip(completion.token_ids, completion.logprobs or ()))


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_text(self, token_id: int, lp=None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id])
        return f"token_id:{token_id}"

    def completion_logprobs(self, positions, num: int, offset: int) -> tuple[dict, int]:
        """Completions' {tokens, token_logprobs, top_logprobs, text_offset}; `offset` is
        the text offset of the first position. Returns it and the next offset."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token_id, top in positions:
            chosen = top.get(token_id) if top else None
            text = self.token_text(token_id, chosen)
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
            if top is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(finite(chosen.logprob) if chosen is not None else None)
            shown: dict[str, float] = {}
            for t, lp in sorted(top.items(), key=_rank_key):
                if t == token_id or lp.rank is None or lp.rank <= num:
                    shown.setdefault(self.token_text(t, lp), finite(lp.logprob))
            top_logprobs.append(shown)
        return ({"tokens": tokens, "token_logprobs": token_logprobs,
                 "top_logprobs": top_logprobs, "text_offset": text_offset}, offset)

    def chat_logprobs(self, positions, num: int) -> list[dict]:
        """Chat's logprobs.content: {token, logprob, bytes, top_logprobs: top-`num`}."""
        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": finite(logprob),
                    "bytes": list(text.encode("utf-8", errors="replace"))}

        content = []
        for token_id, top in positions:
            chosen = top.get(token_id)
            e = entry(self.token_text(token_id, chosen),
                      chosen.logprob if chosen is not None else -math.inf)
            # The sampled token's own entry is not part of the top-N unless it ranks there.
            best = [(t, lp) for t, lp in sorted(top.items(), key=_rank_key)
                    if not (t == token_id and lp.rank is not None and lp.rank > num)][:num]
            e["top_logprobs"] = [entry(self.token_text(t, lp), lp.logprob) for t, lp in best]
            content.append(e)
        return content

    @staticmethod
    def prompt_logprobs_json(plp) -> list | None:
        """vLLM's (non-OpenAI) prompt_logprobs: None, then {token id: {logprob, rank,
        decoded_token}} per prompt position."""
        if plp is None:
            return None
        return [None if top is None else
                {str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                          "decoded_token": lp.decoded_token} for t, lp in top.items()}
                for top in plp]
