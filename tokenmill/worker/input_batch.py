"""The persistent batch: one row per live request, kept across steps.

Rows are added, removed, condensed and swapped; every per-row field moves
together, so a row index names one request in every array at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.sample.sampler import Penalties, SamplingMetadata
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    """What the runner keeps for a request between steps (also while it is out of the batch)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[list[int]]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs filled chunk by chunk ([P - 1] positions), until sent once.
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    prompt_logprobs_sent: bool = False
    # Multimodal: its images (sched_output.MultiModalFeature), and under M-RoPE the
    # prompt's position ids [3, P] (None: text only) and the delta later tokens add.
    mm_features: list | None = None
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    # An embedding request (pooling/params.PoolingParams) and its pooling so far
    # (worker/pooler.PoolingState, made at its first chunk); None: it generates.
    pooling_params: object = None
    pooler: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_sizes: list[int],
                 device: torch.device, vocab_size: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.vocab_size = vocab_size
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1: none asked
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # Rows whose request needs a logits processor (looked up in `params` then).
        self.needs_processors = np.zeros(max_num_reqs, dtype=bool)
        # Rows whose request samples under a grammar (its bitmask is filled after the
        # forward: the step must keep its logits).
        self.has_grammar = np.zeros(max_num_reqs, dtype=bool)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.generators: dict[int, torch.Generator] = {}
        self.seeds: dict[int, int] = {}
        self.block_tables = [BlockTable(max_num_reqs, -(-max_model_len // bs), bs)
                             for bs in block_sizes]
        self._num_reqs = 0  # rows [0, _num_reqs) are in use after condense()
        # A removal left a hole below the last row in use: condense() has work to do.
        self._has_holes = False
        # all_plain_greedy()'s answer until a row is added, removed or moved (None: ask).
        self._plain_greedy: bool | None = None

    # ---- membership ------------------------------------------------------------
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        row = self._first_free_row()
        self._plain_greedy = None
        rid = state.req_id
        self.req_ids[row] = rid
        self.req_id_to_index[rid] = row
        n_prompt = len(state.prompt_token_ids)
        n_tokens = state.num_tokens
        if n_tokens > self.max_model_len:
            raise RuntimeError(f"request {rid} has {n_tokens} tokens > max_model_len")
        self.token_ids_cpu[row, :n_prompt] = state.prompt_token_ids
        self.token_ids_cpu[row, n_prompt:n_tokens] = state.output_token_ids
        self.num_prompt_tokens[row] = n_prompt
        self.num_tokens_no_spec[row] = n_tokens
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        sp = state.sampling_params
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k
        self.min_p[row] = sp.min_p
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.min_tokens[row] = sp.min_tokens
        self.needs_processors[row] = sp.needs_processors
        self.has_grammar[row] = getattr(sp, "structured_outputs", None) is not None
        self.params[row] = sp
        if state.generator is not None:
            self.generators[row] = state.generator
            self.seeds[row] = sp.seed
        for table, ids in zip(self.block_tables, state.block_ids):
            table.add_row(ids, row)
        return row

    def _first_free_row(self) -> int:
        if not self._has_holes:  # rows [0, num_reqs) in use: the next one is free
            row = len(self.req_id_to_index)
            if row < self.max_num_reqs and self.req_ids[row] is None:
                return row
        for row in range(self.max_num_reqs):
            if self.req_ids[row] is None:
                return row
        raise RuntimeError("the input batch is full (max_num_seqs rows)")

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._has_holes = True
        self._plain_greedy = None
        self.req_ids[row] = None
        self.params[row] = None
        self.needs_processors[row] = False
        self.has_grammar[row] = False
        self.generators.pop(row, None)
        self.seeds.pop(row, None)
        for table in self.block_tables:
            table.clear_row(row)
        return row

    def condense(self) -> None:
        """Move the last rows into holes so rows [0, num_reqs) are dense."""
        if not self._has_holes:  # nothing was removed since the last condense()
            return
        self._has_holes = False
        n = self.num_reqs()
        holes = [r for r in range(n) if self.req_ids[r] is None]
        tail = [r for r in range(self.max_num_reqs - 1, n - 1, -1) if self.req_ids[r] is not None]
        for dst, src in zip(holes, tail):
            self._move(src, dst)

    def _move(self, src: int, dst: int) -> None:
        self._plain_greedy = None
        rid = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = rid, None
        self.req_id_to_index[rid] = dst
        n = self.num_tokens_no_spec[src]
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        for arr in self._per_row_arrays():
            arr[dst] = arr[src]
        self.params[dst], self.params[src] = self.params[src], None
        self.needs_processors[src] = False
        self.has_grammar[src] = False
        for d in (self.generators, self.seeds):
            if src in d:
                d[dst] = d.pop(src)
        for table in self.block_tables:
            table.move_row(src, dst)
            table.clear_row(src)

    def swap_states(self, a: int, b: int) -> None:
        self._plain_greedy = None
        ra, rb = self.req_ids[a], self.req_ids[b]
        self.req_ids[a], self.req_ids[b] = rb, ra
        self.req_id_to_index[rb], self.req_id_to_index[ra] = a, b
        n = max(self.num_tokens_no_spec[a], self.num_tokens_no_spec[b])
        self.token_ids_cpu[[a, b], :n] = self.token_ids_cpu[[b, a], :n]
        for arr in self._per_row_arrays():
            arr[[a, b]] = arr[[b, a]]
        self.params[a], self.params[b] = self.params[b], self.params[a]
        for d in (self.generators, self.seeds):
            va, vb = d.pop(a, None), d.pop(b, None)
            if va is not None:
                d[b] = va
            if vb is not None:
                d[a] = vb
        for table in self.block_tables:
            table.swap_row(a, b)

    def _per_row_arrays(self):
        return (self.num_tokens_no_spec, self.num_prompt_tokens, self.num_computed_tokens_cpu,
                self.temperature, self.top_p, self.top_k, self.min_p, self.presence_penalty,
                self.frequency_penalty, self.repetition_penalty, self.num_logprobs,
                self.min_tokens, self.needs_processors, self.has_grammar)

    def token_id(self, row: int, col: int) -> int:
        return int(self.token_ids_cpu[row, col])

    # ---- sampling ------------------------------------------------------------
    def all_plain_greedy(self) -> bool:
        """Every row takes the argmax of its raw logits: greedy, no logprobs, no processors,
        no grammar. (Kept until a row is added, removed or moved: asked twice a step.)"""
        if self._plain_greedy is not None:
            return self._plain_greedy
        n = self.num_reqs()
        self._plain_greedy = bool((self.temperature[:n] < 1e-5).all() and (self.num_logprobs[:n] < 0).all()
                    and not self.needs_processors[:n].any() and not self.has_grammar[:n].any())
        return self._plain_greedy

    def make_sampling_metadata(self) -> SamplingMetadata:
        n = self.num_reqs()
        temp = self.temperature[:n]
        greedy = temp < 1e-5
        top_k = self.top_k[:n]
        top_p = self.top_p[:n]
        min_p = self.min_p[:n]
        num_logprobs = self.num_logprobs[:n]
        dev = self.device
        all_greedy = bool(greedy.all())
        if all_greedy:  # argmax only: none of the per-row sampling tensors are read
            md = SamplingMetadata(temperature=None, greedy_mask=None, all_greedy=True,
                                  all_random=False, top_k=None, top_p=None,
                                  generators=dict(self.generators), min_p=None)
        else:
            md = SamplingMetadata(
                temperature=torch.from_numpy(np.where(greedy, 1.0, temp).astype(np.float32)).to(dev),
                greedy_mask=torch.from_numpy(greedy).to(dev),
                all_greedy=False,
                all_random=not bool(greedy.any()),
                top_k=torch.from_numpy(top_k.copy()).to(dev) if (top_k > 0).any() else None,
                top_p=torch.from_numpy(top_p.copy()).to(dev) if (top_p < 1.0).any() else None,
                generators=dict(self.generators),
                min_p=torch.from_numpy(min_p.copy()).to(dev) if (min_p > 0).any() else None,
            )
        md.max_num_logprobs = int(num_logprobs.max()) if (num_logprobs >= 0).any() else None
        rows = np.nonzero(self.needs_processors[:n])[0]
        if rows.size:
            self._add_processors(md, rows)
        return md

    def _add_processors(self, md: SamplingMetadata, rows: np.ndarray) -> None:
        """Host side of the logits processors, for the few rows that use them.

        Only sparse (row, token) lists and padded token histories cross to the
        device; the [N, vocab] work happens there.
        """
        dev = self.device
        allowed_rows, allowed_which, allowed_toks = [], [], []
        blocked_rows, blocked_toks = [], []
        bias_rows, bias_toks, bias_vals = [], [], []
        for r in rows.tolist():
            sp = self.params[r]
            n_prompt = int(self.num_prompt_tokens[r])
            n_out = int(self.num_tokens_no_spec[r]) - n_prompt
            if sp.allowed_token_ids:
                allowed_which += [len(allowed_rows)] * len(sp.allowed_token_ids)
                allowed_rows.append(r)
                allowed_toks += sp.allowed_token_ids
            if n_out < sp.min_tokens:
                stops = (sp.all_stop_token_ids if sp.all_stop_token_ids is not None
                         else sp.stop_token_ids_set)
                blocked_rows += [r] * len(stops)
                blocked_toks += stops
            for word in sp.bad_words_token_ids or ():
                # Ban the word's last token when the output ends with the rest of it.
                prefix = word[:-1]
                if len(prefix) > n_out:
                    continue
                tail = self.token_ids_cpu[r, n_prompt + n_out - len(prefix):n_prompt + n_out]
                if np.array_equal(tail, prefix):
                    blocked_rows.append(r)
                    blocked_toks.append(word[-1])
            if sp.logit_bias:
                bias_rows += [r] * len(sp.logit_bias)
                bias_toks += sp.logit_bias.keys()
                bias_vals += sp.logit_bias.values()

        def longs(x):
            return torch.tensor(x, dtype=torch.long, device=dev)

        if allowed_rows:
            md.allowed_token_ids = (longs(allowed_rows), longs(allowed_which), longs(allowed_toks))
        if blocked_rows:
            md.blocked = (longs(blocked_rows), longs(blocked_toks))
        if bias_rows:
            md.logit_bias = (longs(bias_rows), longs(bias_toks),
                             torch.tensor(bias_vals, dtype=torch.float32, device=dev))
        pen = rows[(self.presence_penalty[rows] != 0) | (self.frequency_penalty[rows] != 0)
                   | (self.repetition_penalty[rows] != 1)]
        if pen.size:
            md.penalties = self._penalties(pen)

    def _penalties(self, rows: np.ndarray) -> Penalties:
        """Prompt and output token ids of `rows`, padded with vocab_size (a dump column)."""
        pad = self.vocab_size
        n_prompt = self.num_prompt_tokens[rows]
        n_total = self.num_tokens_no_spec[rows]
        width = int(n_total.max())
        hist = self.token_ids_cpu[rows, :width].astype(np.int64)
        col = np.arange(width)
        prompt = np.where(col < n_prompt[:, None], hist, pad)[:, :int(n_prompt.max())]
        out_len = n_total - n_prompt
        out_width = max(int(out_len.max()), 1)
        # Output token j of row i sits at column n_prompt[i] + j.
        idx = np.minimum(n_prompt[:, None] + np.arange(out_width), width - 1)
        output = np.where(np.arange(out_width) < out_len[:, None],
                          np.take_along_axis(hist, idx, axis=1), pad)
        dev = self.device

        def f32(a):
            return torch.from_numpy(a.astype(np.float32)).to(dev)

        return Penalties(torch.from_numpy(rows.astype(np.int64)).to(dev),
                         f32(self.presence_penalty[rows]), f32(self.frequency_penalty[rows]),
                         f32(self.repetition_penalty[rows]),
                         torch.from_numpy(prompt).to(dev), torch.from_numpy(output).to(dev))
