"""LLMEngine: tokenizer, input validation, EngineCore, detokenized outputs."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from tokenmill.core.request import Request, RequestStatus
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine_args import EngineArgs, EngineSetup, build_engine_core
from tokenmill.engine.output_processor import CompletionState, OutputProcessor, RequestState
from tokenmill.errors import ParamError
from tokenmill.limits import RequestLimits
from tokenmill.outputs import RequestMetrics, RequestOutput
from tokenmill.pooling.params import PoolingParams, pooling_sampling_params
from tokenmill.sampling_params import ENGINE_DERIVED, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A request that passed every check, ready for add_request (LLMEngine.prepare_request)."""
    text: str | None
    prompt_token_ids: list[int]
    # resolved: the engine's own copy, with derived fields (PoolingParams: an embedding)
    params: SamplingParams | PoolingParams
    cache_salt: str | None
    mm_features: list | None = None  # its images (sched_output.MultiModalFeature)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        args.validate()
        self.args = args
        self.limits: RequestLimits = args.limits
        setup = EngineSetup.from_args(args)
        self.model_config = setup.model_config
        self.tokenizer = setup.tokenizer
        self.scheduler_config = setup.scheduler_config
        self.cache_config = setup.cache_config
        self.platform = setup.platform
        logger.info("platform: %s", self.platform.describe())
        self.eos_token_ids = setup.eos_token_ids
        # "generate" or "pooling" (embeddings only), and how embedding requests pool.
        self.runner_type, self.pooler_config = setup.runner_type, setup.pooler_config
        logger.info("runner: %s; embeddings: %s", self.runner_type,
                    self.pooler_config.describe())
        if args.engine_process or args.data_parallel_size > 1:
            # The engine core(s) in their own process(es); this one tokenizes,
            # detokenizes and checks stop strings (tokenmill.engine.core_client).
            from tokenmill.engine.core_client import MPEngineCoreClient
            self.engine_core = MPEngineCoreClient(args, setup)
        else:
            self.engine_core = build_engine_core(args, setup)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        from tokenmill.multimodal.inputs import MultiModalProcessor, is_multimodal
        self.mm_processor = (MultiModalProcessor(self.model_config.path,
                                                 self.model_config.hf_config)
                             if is_multimodal(self.model_config.hf_config) else None)

    # ---- requests ------------------------------------------------------------
    def next_request_id(self) -> str:
        return str(next(self._ids))

    def process_prompt(self, prompt, truncate_prompt_tokens: int | None = None,
                       pooling: bool = False) -> tuple:
        """A str, {"prompt": str} or {"prompt_token_ids": [...]} (either dict with an
        optional "multi_modal_data": {"image": an image or a list of them}) -> (text,
        token ids, images as MultiModalFeatures or None), validated.

        `truncate_prompt_tokens` (SamplingParams'): keep the last k tokens; -1: the last
        max_model_len - 1 (the longest prompt that leaves room for an output token).
        `pooling`: an embedding's prompt, which needs no room for output (max_model_len
        tokens fit, and -1 keeps that many)."""
        text = None
        max_len = self.model_config.max_model_len + (1 if pooling else 0)
        keep = self._truncation(truncate_prompt_tokens, prompt, pooling)
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ParamError("prompt", "prompt_token_ids must be a list of ints")
            if keep is not None:
                ids = ids[-keep:]
            if len(ids) >= max_len:  # before looking at a million entries one by one
                raise ParamError("prompt", self._too_long(len(ids), pooling))
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ParamError("prompt", "prompt_token_ids must be a list of ints")
            ids = list(ids)
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
        else:
            raise ParamError("prompt", f"prompt must be a str, {{'prompt': str}} or "
                                       f"{{'prompt_token_ids': list[int]}}, "
                                       f"got {type(prompt).__name__}")
        if text is not None:
            if self.tokenizer is None:
                raise ParamError("prompt",
                                 "prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer.encode(text)
            if keep is not None:
                ids = ids[-keep:]
        if not ids:
            raise ParamError("prompt", "prompt is empty")
        features = None
        mm = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm is not None:
            ids, features = self._process_multimodal(ids, mm)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ParamError("prompt", f"prompt_token_ids: token id {bad[0]} is outside the "
                                       f"vocabulary [0, {vocab})")
        if len(ids) >= max_len:
            raise ParamError("prompt", self._too_long(len(ids), pooling))
        return text, ids, features

    def _too_long(self, n: int, pooling: bool) -> str:
        max_len = self.model_config.max_model_len
        if pooling:
            return f"prompt is {n} tokens long, more than max_model_len={max_len}"
        return (f"prompt is {n} tokens long, which leaves no room for output within "
                f"max_model_len={max_len}")

    def _truncation(self, k: int | None, prompt, pooling: bool = False) -> int | None:
        """How many of the prompt's last tokens truncate_prompt_tokens keeps, or None."""
        if k is None:
            return None
        max_len = self.model_config.max_model_len
        if k > max_len:
            raise ParamError("truncate_prompt_tokens",
                             f"truncate_prompt_tokens ({k}) is greater than "
                             f"max_model_len={max_len}")
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            # Cutting the prompt could split an image's placeholder run.
            raise ParamError("truncate_prompt_tokens", "truncate_prompt_tokens cannot be "
                                                       "combined with multi_modal_data")
        return max_len - (0 if pooling else 1) if k == -1 else k

    def _process_multimodal(self, ids: list[int], mm) -> tuple[list[int], list | None]:
        """The images of a prompt: preprocessed, placeholders expanded (see
        tokenmill/multimodal/inputs.py), each within what one step may encode."""
        if not isinstance(mm, dict) or set(mm) - {"image"}:
            raise ParamError("multi_modal_data", "multi_modal_data must be a dict with the "
                                                 "key 'image' (other modalities: not supported)")
        if self.mm_processor is None:
            raise ParamError("multi_modal_data", "multi_modal_data: this model takes no images")
        if mm.get("image") is None:
            return ids, None
        ids, features = self.mm_processor.process(ids, mm["image"], self.limits)
        sc = self.scheduler_config
        cap = min(sc.max_num_encoder_input_tokens, sc.encoder_cache_size)
        for i, f in enumerate(features):
            if f.length > cap:
                raise ParamError("multi_modal_data.image",
                                 f"multi_modal_data.image[{i}]: the image takes {f.length} "
                                 f"tokens, more than the encoder takes in one step ({cap}: "
                                 f"max_num_encoder_input_tokens / encoder_cache_size)")
        return ids, features or None

    def prepare_request(self, prompt, params: SamplingParams | None = None, *,
                        processed: tuple | None = None) -> PreparedRequest:
        """Every check and all the slow work of adding a request (tokenizing, the params'
        model checks, parsing the grammar and starting its compilation), touching no
        engine state: safe on any thread. ParamError (a ValueError) on bad input.
        PoolingParams: an embedding request (any runner, given a model that loads)."""
        if isinstance(params, PoolingParams):
            return self._prepare_pooling(prompt, params, processed)
        if self.runner_type == "pooling":
            raise ParamError("model", "this model is served by the pooling runner "
                                      "(--runner pooling): it computes embeddings "
                                      "(/v1/embeddings, LLM.embed), not generations")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ParamError(None, f"sampling_params must be a SamplingParams, "
                                   f"got {type(params).__name__}")
        text, ids, *mm = processed if processed is not None else self.process_prompt(
            prompt, params.truncate_prompt_tokens)
        cache_salt = self._cache_salt(prompt)
        params = self._resolve_params(params, len(ids))
        return PreparedRequest(text, ids, params, cache_salt, mm[0] if mm else None)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    *, processed: tuple | None = None,
                    prepared: PreparedRequest | None = None) -> str:
        """Validate and enqueue. Raises ValueError (and changes nothing) on bad input."""
        if prepared is None:
            prepared = self.prepare_request(prompt, params, processed=processed)
        text, ids, params, cache_salt = (prepared.text, prepared.prompt_token_ids,
                                         prepared.params, prepared.cache_salt)
        request_id = request_id if request_id is not None else self.next_request_id()
        if isinstance(params, PoolingParams):
            return self._add_pooling(request_id, prepared)
        if request_id in self.output_processor.requests:
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        processor = self.output_processor
        completions = []
        for i in range(params.n):
            # n = 1 keeps the user's id in the core; n > 1 gives each completion its own.
            core_id = request_id if params.n == 1 else f"{i}_{request_id}"
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                               params.spaces_between_special_tokens)
            completions.append(CompletionState(i, core_id, detok,
                                               logprobs=[] if params.logprobs is not None else None))
        req_state = RequestState(request_id, text, ids, params, completions,
                                 RequestMetrics(time.monotonic()))
        core_requests = []
        for c in completions:
            child = params
            if params.n > 1:
                # Each completion samples alone; seeded ones get seed + index, so the n
                # completions differ and each is reproducible.
                child = params.clone(n=1, seed=None if params.seed is None else params.seed + c.index,
                                     prompt_logprobs=params.prompt_logprobs if c.index == 0 else None)
                self._attach_derived(child, params)
            core_requests.append(Request(
                c.core_id, ids, child, self.eos_token_ids, req_state.metrics.arrival_time,
                share_prompt_with=completions[0].core_id if c.index > 0 else None,
                cache_salt=cache_salt, mm_features=prepared.mm_features))
        for r in core_requests:
            if self.engine_core.has_request(r.request_id):
                raise ParamError("request_id", f"request_id {r.request_id!r} is already in use")
        processor.add_request(req_state)
        for r in core_requests:
            self.engine_core.add_request(r)
        return request_id

    # ---- embedding requests (tokenmill/pooling) --------------------------------
    def _prepare_pooling(self, prompt, params: PoolingParams,
                         processed: tuple | None) -> PreparedRequest:
        """An embedding request's checks; its params resolved with the model's pooler."""
        if params.pooling_type is not None:
            raise ParamError("pooling_type", "pooling_type is the model's (--pooler-config), "
                                             "not a request's")
        if params.dimensions is not None:
            raise ParamError("dimensions", "dimensions: this model does not support "
                                           "matryoshka (truncated) embeddings")
        text, ids, mm = processed if processed is not None else self.process_prompt(
            prompt, params.truncate_prompt_tokens, pooling=True)
        if mm:
            raise ParamError("multi_modal_data", "multi_modal_data: embeddings of images "
                                                 "are not supported")
        cfg = self.pooler_config
        resolved = params.clone(pooling_type=cfg.pooling_type,
                                normalize=cfg.normalize if params.normalize is None
                                else params.normalize)
        return PreparedRequest(text, ids, resolved, self._cache_salt(prompt))

    def _add_pooling(self, request_id: str, prepared: PreparedRequest) -> str:
        """One core request, prefill only: its output is the pooled vector."""
        processor = self.output_processor
        if request_id in processor.requests or request_id in processor.pooling or \
                self.engine_core.has_request(request_id):
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        metrics = RequestMetrics(time.monotonic())
        processor.add_pooling_request(request_id, prepared.text, prepared.prompt_token_ids,
                                      metrics)
        self.engine_core.add_request(Request(
            request_id, prepared.prompt_token_ids, pooling_sampling_params(), frozenset(),
            metrics.arrival_time, cache_salt=prepared.cache_salt,
            pooling_params=prepared.params))
        return request_id

    @staticmethod
    def _cache_salt(prompt) -> str | None:
        """A prompt dict's optional `cache_salt`: requests share cached KV only with
        requests of the same salt (vLLM's field)."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ParamError("cache_salt", "cache_salt must be a non-empty string")
        return salt

    def _resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Checks that need the model or the engine's caps, and the request's own copy
        with derived fields."""
        params.check_limits(self.limits)
        vocab = self.model_config.vocab_size
        max_lp = self.args.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > max_lp:
                raise ParamError(name, f"{name}: {v} requested, but at most "
                                       f"max_logprobs={max_lp} are allowed")
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logit_bias", list(params.logit_bias or ()))):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ParamError(name, f"{name}: token id {bad[0]} is outside the vocabulary "
                                       f"[0, {vocab})")
        if (params.stop or params.bad_words) and self.tokenizer is None:
            field = "stop" if params.stop else "bad_words"
            raise ParamError(field, f"{field}: this model has no tokenizer")
        if params.stop and not params.detokenize:
            raise ParamError("stop", "stop strings need detokenize=True")
        if params.structured_outputs is not None:  # parses the grammar, starts compiling it
            self.engine_core.structured_output.validate(params.structured_outputs)
        # max_tokens past the context is clamped to it (as vLLM); min_tokens with it.
        room = self.model_config.max_model_len - num_prompt_tokens
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        resolved = params.clone(max_tokens=max_tokens,
                                min_tokens=min(params.min_tokens, max_tokens))
        resolved.all_stop_token_ids = params.stop_token_ids_set | (
            frozenset() if params.ignore_eos else self.eos_token_ids)
        if params.bad_words:
            resolved.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        return resolved

    @staticmethod
    def _attach_derived(child: SamplingParams, parent: SamplingParams) -> None:
        for name in ENGINE_DERIVED:
            setattr(child, name, getattr(parent, name))

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word as token ids, alone and after a space (how it appears mid-text)."""
        out = []
        for word in words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core_ids = []
        for rid in request_ids:
            core_ids += self.output_processor.remove_request(rid) or [rid]
        self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the engine core (its process, if it has one); idempotent."""
        self.engine_core.shutdown()

    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.requests) + list(self.output_processor.pooling)

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
        core_outputs = self.engine_core.step()
        outputs, stopped = self.output_processor.process(core_outputs, time.monotonic())
        if self.output_processor.failed:  # their outputs say "error" already
            self.engine_core.fail_requests(self.output_processor.failed, emit=False)
        for core_id, stop in stopped:  # a stop string showed up in the text
            self.engine_core.finish_requests([core_id], RequestStatus.FINISHED_STOPPED, stop)
        return outputs

    @property
    def step_num_new_tokens(self) -> dict[str, int]:
        """New tokens per request id in the last step()."""
        return self.output_processor.num_new_tokens
