"""LLMEngine: tokenizer, input validation, EngineCore, detokenized outputs."""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, fields

from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import SchedulerConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine_core import EngineCore
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_CHUNKED_BATCHED_TOKENS = 2048


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: object = "auto"
    device: object = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise ValueError(f"unknown engine argument {name!r}; known: "
                                 f"{', '.join(sorted(known - {'model'}))}")
        return cls(model=model, **kwargs)

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.max_num_batched_tokens is not None and (
                not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1):
            raise ValueError(f"max_num_batched_tokens must be a positive int, "
                             f"got {self.max_num_batched_tokens!r}")


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None


class LLMEngine:
    def __init__(self, args: EngineArgs):
        args.validate()
        import torch  # noqa: local so `tokenmill --help` stays fast
        torch.manual_seed(args.seed)
        self.args = args
        self.model_config = ModelConfig.from_pretrained(args.model, args.dtype, args.device,
                                                        args.max_model_len)
        self.tokenizer = self._load_tokenizer(args.tokenizer or self.model_config.path)
        max_len = self.model_config.max_model_len
        batched = args.max_num_batched_tokens
        if batched is None:
            batched = (DEFAULT_CHUNKED_BATCHED_TOKENS if args.enable_chunked_prefill
                       else max(max_len, DEFAULT_CHUNKED_BATCHED_TOKENS))
        if not args.enable_chunked_prefill and batched < max_len:
            raise ValueError(f"max_num_batched_tokens ({batched}) must be >= max_model_len "
                             f"({max_len}) when enable_chunked_prefill is off")
        self.scheduler_config = SchedulerConfig(args.max_num_seqs, batched, max_len,
                                                args.enable_chunked_prefill)
        self.cache_config = CacheConfig(args.block_size, args.num_kv_blocks, args.kv_cache_memory)
        self.engine_core = EngineCore(self.model_config, self.cache_config, self.scheduler_config)
        self.eos_token_ids = self.model_config.eos_token_ids(self.tokenizer)
        self._states: dict[str, _RequestState] = {}
        self._ids = itertools.count()

    @staticmethod
    def _load_tokenizer(path: str):
        if not any(os.path.exists(os.path.join(path, f))
                   for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            logger.warning("no tokenizer in %s: prompts must be token ids, outputs have no text", path)
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)

    # ---- requests ------------------------------------------------------------
    def next_request_id(self) -> str:
        return str(next(self._ids))

    def process_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A str, {"prompt": str} or {"prompt_token_ids": [...]} -> (text, token ids), validated."""
        text = None
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            ids = list(ids)
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
        else:
            raise ValueError(f"prompt must be a str, {{'prompt': str}} or "
                             f"{{'prompt_token_ids': list[int]}}, got {type(prompt).__name__}")
        if text is not None:
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        max_len = self.model_config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt is {len(ids)} tokens long, which leaves no room for output "
                             f"within max_model_len={max_len}")
        return text, ids

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    *, processed: tuple | None = None) -> str:
        """Validate and enqueue. Raises ValueError (and changes nothing) on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = processed if processed is not None else self.process_prompt(prompt)
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.max_tokens is None:
            params = params.clone()
            params.max_tokens = self.model_config.max_model_len - len(ids)
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary")
        req = Request(request_id, ids, params, self.eos_token_ids)
        detok = (IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
                 if self.tokenizer is not None else None)
        self._states[request_id] = _RequestState(request_id, text, ids, params, detok,
                                                 RequestMetrics(req.arrival_time), [])
        self.engine_core.add_request(req)
        return request_id

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.engine_core.abort_requests(request_ids)
        for rid in request_ids:
            self._states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def unfinished_request_ids(self) -> list[str]:
        return list(self._states)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> list[int]:
        """A conversation -> prompt token ids through the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ---- one step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for out in self.engine_core.step():
            st = self._states.get(out.request_id)
            if st is None:
                continue
            if st.metrics.first_token_time is None:
                st.metrics.first_token_time = now
            st.token_ids.extend(out.new_token_ids)
            if st.detokenizer is not None:
                st.detokenizer.update(out.new_token_ids)
            if out.finished:
                st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
                st.metrics.finished_time = now
                del self._states[out.request_id]
            outputs.append(self._make_output(st))
        return outputs

    @staticmethod
    def _make_output(st: _RequestState) -> RequestOutput:
        text = st.detokenizer.text if st.detokenizer is not None else ""
        completion = CompletionOutput(0, text, list(st.token_ids), finish_reason=st.finish_reason,
                                      stop_reason=st.stop_reason)
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, [completion],
                             st.finish_reason is not None, metrics=st.metrics)
