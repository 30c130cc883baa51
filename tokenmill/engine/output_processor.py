"""From EngineCoreOutputs to RequestOutputs: detokenize, stop strings, logprobs, n.

One user request owns n completions; each completion is one request of the
engine core. Per step, the processor appends the new tokens of each
completion, decodes them, looks for stop strings in the new text (a stop
string may span tokens), turns logprob rows into {token id: Logprob} dicts and
builds the RequestOutput its output_kind asks for. Completions that hit a stop
string are reported back so the engine finishes them in the core. An embedding request
has no tokens: its one output carries the pooled vector (EmbeddingRequestOutput).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tokenmill import faults
from tokenmill.core.sched_output import LogprobsLists
from tokenmill.core.scheduler import EngineCoreOutput
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                               Logprob, RequestMetrics, RequestOutput)
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last `num_new_chars` of text:
    (its start, the string), or None. Earlier text was searched on earlier calls."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


@dataclass
class CompletionState:
    index: int
    core_id: str  # the engine core's request id for this completion
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # How much of each the last DELTA output already carried.
    sent_tokens: int = 0
    sent_text: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PoolingRequestState:
    """An embedding request: one core request of the same id, one final output."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    error: str | None = None  # why a completion finished with "error"

    @property
    def finished(self) -> bool:
        comps = self.completions
        if len(comps) == 1:  # (n = 1, most requests: no generator per call)
            return comps[0].finished
        return all(c.finished for c in comps)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.core_to_request: dict[str, tuple[RequestState, CompletionState]] = {}
        self._token_text: dict[int, str] = {}  # decoded text of single tokens, for logprobs
        # New tokens per request in the last process() call (for serving metrics).
        self.num_new_tokens: dict[str, int] = {}
        # Completions whose processing failed in the last process() call: core id ->
        # (reason, message); the engine fails them in the core.
        self.failed: dict[str, tuple[str, str]] = {}
        self.pooling: dict[str, PoolingRequestState] = {}  # embedding requests

    def add_pooling_request(self, request_id: str, prompt: str | None,
                            prompt_token_ids: list[int], metrics: RequestMetrics) -> None:
        self.pooling[request_id] = PoolingRequestState(request_id, prompt, prompt_token_ids,
                                                       metrics)

    def add_request(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for c in state.completions:
            self.core_to_request[c.core_id] = (state, c)

    def remove_request(self, request_id: str) -> list[str]:
        """Forget a request; return its completions' core ids."""
        if self.pooling.pop(request_id, None) is not None:
            return [request_id]
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        core_ids = []
        for c in state.completions:
            # A finished completion's core id ("{i}_{id}") may since belong to a
            # new request: leave that one alone.
            entry = self.core_to_request.get(c.core_id)
            if entry is not None and entry[0] is state:
                del self.core_to_request[c.core_id]
                core_ids.append(c.core_id)
        return core_ids

    # ---- one step ------------------------------------------------------------
    def process(self, core_outputs: list[EngineCoreOutput], now: float
                ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the RequestOutputs to hand out and the (core id, stop string)
        pairs of completions that a stop string finished."""
        touched: dict[str, tuple[RequestState, list[CompletionState]]] = {}
        stopped: list[tuple[str, str]] = []
        self.num_new_tokens = {}
        self.failed = {}
        outputs: list = []
        for out in core_outputs:
            pooled = self.pooling.get(out.request_id)
            if pooled is not None:
                if out.finished:
                    outputs.append(self._pooled_output(pooled, out, now))
                continue
            entry = self.core_to_request.get(out.request_id)
            if entry is None:
                continue
            state, comp = entry
            if comp.finished:
                continue
            try:
                self._process_one(state, comp, out, now, stopped)
            except Exception as e:  # noqa: BLE001 - this completion fails, the rest go on
                logger.exception("request %s: processing its output failed", comp.core_id)
                comp.finish_reason, comp.stop_reason = "error", None
                state.error = f"processing this request's output failed ({type(e).__name__})"
                self.failed[comp.core_id] = ("output", state.error)
            entry = touched.get(state.request_id)
            if entry is None:
                touched[state.request_id] = (state, [comp])
            elif all(c is not comp for c in entry[1]):  # (two outputs of one request)
                entry[1].append(comp)

        for state, comps in touched.values():
            try:
                out = self._make_output(state, comps)
            except Exception as e:  # noqa: BLE001 - this request fails, the rest go on
                logger.exception("request %s: building its output failed", state.request_id)
                out = self._error_output(state, f"building this request's output failed "
                                                f"({type(e).__name__})")
            if state.finished:
                state.metrics.finished_time = now
                self.remove_request(state.request_id)
            if out is not None:
                outputs.append(out)
        return outputs, stopped

    def _pooled_output(self, state: PoolingRequestState, out: EngineCoreOutput,
                       now: float) -> EmbeddingRequestOutput:
        """An embedding request's one output: its vector, or its error."""
        del self.pooling[state.request_id]
        state.metrics.finished_time = now
        error = out.error
        if out.pooled is None and error is None:  # (finished without a vector: aborted)
            error = f"the request finished without an embedding ({out.finish_reason})"
        vector = out.pooled.tolist() if out.pooled is not None else []
        return EmbeddingRequestOutput(state.request_id, EmbeddingOutput(vector),
                                      state.prompt_token_ids, True, state.prompt,
                                      state.metrics, error)

    def _error_output(self, state: RequestState, message: str) -> RequestOutput:
        """A final output for a request whose output could not be built: every
        completion still running fails (and is failed in the core)."""
        state.error = message
        for c in state.completions:
            if not c.finished:
                c.finish_reason = "error"
                self.failed[c.core_id] = ("output", message)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             [CompletionOutput(c.index, "", [], None, None, c.finish_reason,
                                               c.stop_reason) for c in state.completions],
                             True, metrics=state.metrics, error=message)

    def _process_one(self, state: RequestState, comp: CompletionState, out: EngineCoreOutput,
                     now: float, stopped: list) -> None:
        """One completion's new tokens: text, stop strings, logprobs."""
        if state.metrics.first_token_time is None and out.new_token_ids:
            state.metrics.first_token_time = now
        self.num_new_tokens[state.request_id] = (
            self.num_new_tokens.get(state.request_id, 0) + len(out.new_token_ids))
        comp.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and comp.logprobs is not None:
            self._append_logprobs(comp, state.params.logprobs, out.new_logprobs,
                                  state.params.detokenize)
        if out.prompt_logprobs is not None and comp.index == 0:
            state.prompt_logprobs = self._prompt_logprobs(state.params.prompt_logprobs,
                                                          out.prompt_logprobs,
                                                          state.params.detokenize)
        if out.finished:
            comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
            if out.error is not None:
                state.error = out.error
        if comp.detokenizer is not None:
            if faults.ARMED and faults.fires("detokenizer", state.request_id,
                                             state.prompt_token_ids):
                raise faults.InjectedFault(f"detokenizer of {state.request_id}")
            text_ids = out.new_token_ids
            if out.finish_reason == "stop" and not state.params.include_stop_str_in_output:
                # Ended by EOS or a stop token id: like vLLM, that token stays in
                # token_ids but its text is not part of the output.
                text_ids = text_ids[:-1]
            new_text = comp.detokenizer.update(text_ids)
            if comp.finished:
                new_text += comp.detokenizer.finish()
            comp.text += new_text
            # As vLLM: no stop string counts before min_tokens tokens (like EOS).
            if state.params.stop and new_text and \
                    len(comp.token_ids) > state.params.min_tokens:
                hit = find_stop_string(comp.text, len(new_text), state.params.stop)
                if hit is not None:
                    start, stop = hit
                    end = start + len(stop) if state.params.include_stop_str_in_output \
                        else start
                    comp.text = comp.text[:end]
                    if not comp.finished:
                        stopped.append((comp.core_id, stop))
                    comp.finish_reason, comp.stop_reason = "stop", stop

    # ---- logprobs ------------------------------------------------------------
    def _token_texts(self, ids) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(ids)
        missing = [t for t in dict.fromkeys(ids) if t not in self._token_text]
        if missing:
            for t, text in zip(missing, self.tokenizer.batch_decode([[t] for t in missing])):
                self._token_text[t] = text
        return [self._token_text[t] for t in ids]

    def _logprob_dicts(self, k: int, rows: LogprobsLists,
                       detokenize: bool = True) -> list[dict[int, Logprob]]:
        """One dict per row: the top-k tokens (rank 1..k) plus the chosen token.
        Without detokenize, decoded_token is None (as vLLM)."""
        ids = rows.token_ids[:, :1 + k].tolist()
        lps = rows.logprobs[:, :1 + k].tolist()
        ranks = rows.ranks.tolist()
        flat = [t for row in ids for t in row]
        texts = self._token_texts(flat) if detokenize else [None] * len(flat)
        out, pos = [], 0
        for row_ids, row_lps, rank in zip(ids, lps, ranks):
            row_texts = texts[pos:pos + len(row_ids)]
            pos += len(row_ids)
            d = {row_ids[0]: Logprob(row_lps[0], rank, row_texts[0])}
            for j in range(1, len(row_ids)):
                if row_ids[j] != row_ids[0]:
                    d[row_ids[j]] = Logprob(row_lps[j], j, row_texts[j])
            out.append(d)
        return out

    def _append_logprobs(self, comp: CompletionState, k: int, rows: LogprobsLists,
                         detokenize: bool = True) -> None:
        comp.logprobs.extend(self._logprob_dicts(k, rows, detokenize))
        comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + float(
            rows.logprobs[:, 0].sum())

    def _prompt_logprobs(self, k: int, rows: LogprobsLists, detokenize: bool = True) -> list:
        return [None] + self._logprob_dicts(k, rows, detokenize)

    # ---- outputs -------------------------------------------------------------
    def _make_output(self, state: RequestState, comps: list[CompletionState]
                     ) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        hold = state.params.output_text_buffer_length
        if kind == RequestOutputKind.DELTA:
            if len(comps) > 1:
                comps = sorted(comps, key=lambda c: c.index)
            completions = [self._delta(c, hold) for c in comps]
            prompt_logprobs = None
            if not state.prompt_logprobs_sent and state.prompt_logprobs is not None:
                prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        else:
            completions = [self._cumulative(c, hold) for c in state.completions]
            prompt_logprobs = state.prompt_logprobs
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished, prompt_logprobs=prompt_logprobs, metrics=state.metrics,
                             error=state.error)

    @staticmethod
    def _visible(c: CompletionState, hold: int) -> str:
        # While running, the last `hold` chars may still become the start of a stop string.
        return c.text if c.finished or not hold else c.text[:max(0, len(c.text) - hold)]

    def _cumulative(self, c: CompletionState, hold: int) -> CompletionOutput:
        return CompletionOutput(c.index, self._visible(c, hold), list(c.token_ids),
                                c.cumulative_logprob,
                                list(c.logprobs) if c.logprobs is not None else None,
                                c.finish_reason, c.stop_reason)

    def _delta(self, c: CompletionState, hold: int) -> CompletionOutput:
        text = self._visible(c, hold)
        delta_text = text[c.sent_text:]
        tokens = c.token_ids[c.sent_tokens:]
        logprobs = c.logprobs[c.sent_tokens:] if c.logprobs is not None else None
        c.sent_text, c.sent_tokens = max(c.sent_text, len(text)), len(c.token_ids)
        return CompletionOutput(c.index, delta_text, tokens, c.cumulative_logprob, logprobs,
                                c.finish_reason, c.stop_reason)
