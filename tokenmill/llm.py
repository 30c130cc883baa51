"""The offline API, call-compatible with vLLM's LLM for generate(), chat() and embed()."""
from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from tokenmill.engine.llm_engine import EngineArgs, LLMEngine
from tokenmill.multimodal.media import extract_images
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.pooling.params import PoolingParams
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """`model`: a local HF folder or hub id; None serves the built-in demo model.

        With engine_process=True, data_parallel_size > 1 or tensor_parallel_size > 1 the
        engine starts processes with multiprocessing's spawn method, which imports the
        calling script again: a script needs the `if __name__ == "__main__":` guard."""
        if model is None:
            from tokenmill.demo_model import ensure_demo_model
            model = ensure_demo_model()
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model, **kwargs))

    def shutdown(self) -> None:
        """Stop the engine (and its processes, if it has any) now rather than at exit."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        engine = self.llm_engine
        # Validate everything first: a bad prompt raises before anything runs.
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        processed = [engine.process_prompt(p, sp.truncate_prompt_tokens)
                     for p, sp in zip(prompts, params)]
        # generate() returns each request once, finished: ask the engine for just that.
        params = [sp if sp.output_kind == RequestOutputKind.FINAL_ONLY
                  else sp.clone(output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        ids = []
        try:
            for prompt, sp, proc in zip(prompts, params, processed):
                ids.append(engine.add_request(None, prompt, sp, processed=proc))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             tools: list[dict] | None = None, tool_choice=None,
             chat_template_kwargs: dict | None = None, **template_kwargs) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them.

        `tools` (OpenAI's shape) go to the chat template; assistant turns may carry
        `tool_calls` and `role: "tool"` results follow them. `tool_choice` "required" or a
        named function ({"type": "function", "function": {"name": ...}}) forces the call
        with a grammar: the text is then the JSON list [{"name", "parameters"}] or the
        function's arguments. "auto" / "none" render the tools only (no parsing here)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        engine = self.llm_engine
        if tools or tool_choice is not None:
            from tokenmill.entrypoints.openai.tools import check_tools, tool_plan
            if tools:
                check_tools(tools)
                template_kwargs["tools"] = tools
            if tool_choice not in (None, "auto", "none"):
                grammar = tool_plan(tools, tool_choice, None, False, None).grammar()
                if isinstance(sampling_params, Sequence):
                    sampling_params = [sp.clone(structured_outputs=grammar)
                                       for sp in sampling_params]
                else:
                    sampling_params = (sampling_params or SamplingParams()).clone(
                        structured_outputs=grammar)
        template_kwargs.update(chat_template_kwargs or {})
        prompts = []
        for conv in conversations:
            if any(m.get("tool_calls") for m in conv):
                from tokenmill.entrypoints.openai.tools import template_messages
                conv = template_messages(conv)
            prompt = {"prompt_token_ids": engine.apply_chat_template(
                conv, add_generation_prompt, chat_template, **template_kwargs)}
            # OpenAI content parts: image_url (data: / file:// URLs), or image objects
            images = extract_images(conv, engine.limits, engine.args.allowed_local_media_path)
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (a str, {"prompt": str}, {"prompt_token_ids": [...]}, or
        a list of them), pooled as the model's pooler config says (last-token, mean or
        CLS, optionally normalised: tokenmill/pooling/config.py). Works on any model
        tokenmill loads, beside generate() on the same instance."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"pooling_params: got {len(params)} for {len(prompts)} "
                                 f"prompts")
        for pp in params:
            if not isinstance(pp, PoolingParams):
                raise ValueError(f"pooling_params must be PoolingParams, got "
                                 f"{type(pp).__name__}")
        engine = self.llm_engine
        prepared = [engine.prepare_request(p, pp) for p, pp in zip(prompts, params)]
        ids = []
        try:
            for prep in prepared:
                ids.append(engine.add_request(None, None, prepared=prep))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        order = {rid: i for i, rid in enumerate(request_ids)}
        results: list[RequestOutput | None] = [None] * len(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        start = time.perf_counter()
        out_tokens = in_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
                        if isinstance(out, EmbeddingRequestOutput):  # (embed(): prompts only)
                            in_tokens += len(out.prompt_token_ids)
                            rate = f"input {in_tokens / (time.perf_counter() - start):.1f} tok/s"
                        else:
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                            rate = f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s"
                        bar.set_postfix_str(rate, refresh=False)
        except BaseException:
            engine.abort_request([rid for rid, i in order.items() if results[i] is None])
            raise
        finally:
            bar.close()
        return results
