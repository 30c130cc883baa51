"""Engine setup: `EngineArgs` (every engine option, checked), `EngineSetup` (what the
front end and a core process both derive from them), `build_engine_core`, and the
executor backends of data parallelism. A leaf of the engine package: the core process
(core_proc.py) builds its core from here without importing the front end (LLMEngine)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.core.kv_cache_spec import check_kv_cache_dtype
from tokenmill.core.scheduler import SchedulerConfig
from tokenmill import platforms
from tokenmill.engine.engine_core import EngineCore
from tokenmill.limits import RequestLimits
from tokenmill.platforms import DEFAULT_GREEDY_HEAD_MAX_ROWS, Platform, check_cpu_args
from tokenmill.pooling.config import PoolerConfig, resolve_pooling

logger = logging.getLogger(__name__)

DEFAULT_CHUNKED_BATCHED_TOKENS = 2048

# How data-parallel replicas are started (engine/launchers.py).
BACKENDS = ("mp", "ray")


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
    # K/V element type (vLLM's --kv-cache-dtype): "auto" (the model's dtype), "fp8" or
    # "fp8_e4m3" (float8_e4m3fn, saturating at +-448; core/kv_cache_spec.py).
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for
    # Automatic prefix caching (None: on; hybrids snapshot their recurrent state).
    enable_prefix_caching: bool | None = None
    # Hybrid (Gated DeltaNet) prefix caching: a recurrent-state snapshot every this many
    # prompt tokens (whole blocks), and how many snapshot slots (None: 4 per sequence).
    state_snapshot_interval: int = 256
    num_state_snapshots: int | None = None
    # The external KV tier: a KVConnectorConfig, a dict of its fields, or store specs
    # ("cpu", "disk:PATH", "redis://host:port/db"); None: no external tier.
    kv_connector: object = None
    # Schedule step N+1 while step N runs (None: on where it pays, see resolve_async).
    async_scheduling: bool | None = None
    # Caps on what one request may ask for (tokenmill.limits.RequestLimits or a dict of
    # its fields; None: the defaults).
    limits: object = None
    # Which CPU kernels run (tokenmill/platforms/cpu.py decides from these and the CPU):
    # "auto" (native where they build, else PyTorch), "native" (or an error), "torch".
    cpu_kernels: str = "auto"
    # A kernel capability level below the CPU's best (None: the best, or the
    # TOKENMILL_CPU_CAPABILITY environment variable); below avx512, bf16 GEMMs run in
    # fp32 as on such a CPU.
    cpu_capability: str | None = None
    # Rows up to which a widened bf16 Linear takes the packed bf16 kernel (0: never).
    linear_bf16_max_rows: int | None = None  # None: the platform's choice
    # Rows up to which an all-greedy step takes the int8-screened lm_head (0: never).
    greedy_head_max_rows: int = DEFAULT_GREEDY_HEAD_MAX_ROWS
    # The native loop over every decoder layer of a decode step (False: Python layers).
    decode_layers: bool = True
    # Speculative decoding (tokenmill.spec_decode.config.SpeculativeConfig, a dict of
    # its fields or their JSON); None: off.
    speculative_config: object = None
    # The engine core in a process of its own, fed over ZeroMQ (tokenmill.engine.core_proc);
    # False: in this process (the default for the offline LLM; the server decides).
    engine_process: bool = False
    # Engine replicas, each in its own process with its own share of the CPUs; requests
    # go to the least loaded. Implies engine_process.
    data_parallel_size: int = 1
    # How the engine processes start: "mp" (local processes) or "ray" (Ray actors).
    distributed_executor_backend: str = "mp"
    # Ranks the model is sharded over (tokenmill/executor: one process each, gloo).
    tensor_parallel_size: int = 1
    # CUDA: no CUDA graphs, every decode step eager (worker/cuda_graph.py).
    enforce_eager: bool = False
    # Multimodal models: image tokens the encoder may take per step (None: enough for
    # any image that fits the context, max(max_num_batched_tokens, max_model_len)),
    # and encoder output rows kept for reuse (None: twice that).
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    # Offline chat: image_url parts may name file:// images inside this folder (None:
    # never; the server takes --allowed-local-media-path).
    allowed_local_media_path: str | None = None
    # vLLM's --quantization: "int8" / "fp8" quantize an unquantized checkpoint's weights
    # at load (per-channel, activations unquantized: models/quantize_at_load.py); a
    # quantized checkpoint's own method is accepted, another refused. None: as stored.
    quantization: str | None = None
    # vLLM's --reasoning-parser ("qwen3", "deepseek_r1"; tokenmill.parsers): a grammar
    # (JSON schema, tool call) applies only after the reasoning ends; the server also
    # splits the reasoning out of chat answers with it. None: no reasoning parser.
    reasoning_parser: str | None = None
    # Pooling (tokenmill/pooling/config.py): vLLM's --runner ("auto", "generate",
    # "pooling"; --task "embed" is "pooling") and --pooler-config (a dict or its JSON:
    # pooling_type LAST / MEAN / CLS, normalize), over the checkpoint's
    # sentence-transformers files.
    runner: str = "auto"
    pooler_config: object = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise ValueError(f"unknown engine argument {name!r}; known: "
                                 f"{', '.join(sorted(known - {'model'}))}")
        return cls(model=model, **kwargs)

    def validate(self) -> None:
        if self.reasoning_parser is not None:
            from tokenmill.parsers.registry import get_reasoning_parser
            get_reasoning_parser(self.reasoning_parser)  # ValueError listing the names
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching,
                                                                     bool):
            raise ValueError(f"enable_prefix_caching must be True, False or None, "
                             f"got {self.enable_prefix_caching!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.state_snapshot_interval, int) or self.state_snapshot_interval < 1:
            raise ValueError(f"state_snapshot_interval must be an int >= 1, "
                             f"got {self.state_snapshot_interval!r}")
        from tokenmill.kv_connector.config import KVConnectorConfig
        self.kv_connector = KVConnectorConfig.from_any(self.kv_connector)
        self.limits = RequestLimits.from_any(self.limits)
        from tokenmill.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        self.cpu_capability = check_cpu_args(self.cpu_kernels, self.cpu_capability,
                                             self.linear_bf16_max_rows,
                                             self.greedy_head_max_rows, self.decode_layers)
        from tokenmill.models.tensor_parallel import check_tensor_parallel_size
        if check_tensor_parallel_size(self.tensor_parallel_size) > 1:
            if self.kv_connector is not None:
                raise ValueError("tensor_parallel_size > 1 does not support the external KV "
                                 "tier (kv_connector) yet")
            from tokenmill.spec_decode.loading import TP_DRAFT_METHODS
            method = self.speculative_config and self.speculative_config.method
            if method not in (None, "ngram") + TP_DRAFT_METHODS:
                raise ValueError(f"tensor_parallel_size > 1 supports speculative decoding "
                                 f"with speculative_config.method 'ngram', "
                                 f"{', '.join(repr(m) for m in TP_DRAFT_METHODS)} only, not "
                                 f"{method!r}")
        if self.quantization is not None and (not isinstance(self.quantization, str)
                                              or not self.quantization):
            raise ValueError(f"quantization must be a method name or None, "
                             f"got {self.quantization!r}")
        for name in ("block_size", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if not isinstance(self.engine_process, bool):
            raise ValueError(f"engine_process must be True or False, got {self.engine_process!r}")
        dp = self.data_parallel_size
        if not isinstance(dp, int) or isinstance(dp, bool) or not 1 <= dp <= 64:
            raise ValueError(f"data_parallel_size must be an int in [1, 64], got {dp!r}")
        if self.distributed_executor_backend not in BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(BACKENDS)}, got {self.distributed_executor_backend!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        if self.max_num_batched_tokens is not None and (
                not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1):
            raise ValueError(f"max_num_batched_tokens must be a positive int, "
                             f"got {self.max_num_batched_tokens!r}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")


def resolve_async(flag: bool | None, device) -> bool:
    """Async scheduling pays where the forward runs beside the host (a GPU). On a CPU
    the worker thread's intra-op threads and the scheduling thread share the same
    cores: measured on the 2-core bench machine, throughput fell from 336 to 217
    tok/s and single stream from 66 to 45, so it is off there unless asked for.

    With speculative decoding the scheduler reserves draft slots it cannot fill (step
    N's acceptance is unknown when N + 1 is scheduled) and the runner, which runs the
    steps in order, fills them with its own drafts (Scheduler._num_spec_slots,
    ModelRunner._fill_spec_slots). Under tensor parallelism only rank 0 proposes: it
    sends its drafts to the other ranks with each step's sampled tokens
    (executor/multiproc_tp.py), so every rank fills the slots alike."""
    if flag is not None:
        return bool(flag)
    return getattr(device, "type", str(device)) == "cuda"


@dataclass
class EngineSetup:
    """Everything decided from the EngineArgs before the engine core is built: the
    front end and an engine core in its own process derive the same from the same args."""
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    platform: Platform
    tokenizer: object
    eos_token_ids: frozenset[int]
    reasoning_parser: str | None = None  # EngineArgs.reasoning_parser: grammars wait for it
    # "generate" or "pooling" (an embedding engine), and how the model pools.
    runner_type: str = "generate"
    pooler_config: PoolerConfig = PoolerConfig()

    @classmethod
    def from_args(cls, args: EngineArgs) -> "EngineSetup":
        model_config = ModelConfig.from_pretrained(args.model, args.dtype, args.device,
                                                   args.max_model_len, args.quantization)
        tokenizer = load_tokenizer(args.tokenizer or model_config.path)
        max_len = model_config.max_model_len
        batched = args.max_num_batched_tokens
        if batched is None:
            batched = (DEFAULT_CHUNKED_BATCHED_TOKENS if args.enable_chunked_prefill
                       else max(max_len, DEFAULT_CHUNKED_BATCHED_TOKENS))
        if not args.enable_chunked_prefill and batched < max_len:
            raise ValueError(f"max_num_batched_tokens ({batched}) must be >= max_model_len "
                             f"({max_len}) when enable_chunked_prefill is off")
        spec = args.speculative_config
        scheduler_config = SchedulerConfig(args.max_num_seqs, batched, max_len,
                                           args.enable_chunked_prefill,
                                           args.enable_prefix_caching,
                                           spec.num_speculative_tokens if spec else 0,
                                           spec.num_lookahead_tokens if spec else 0)
        scheduler_config.draft_reads_next_token = bool(spec and spec.drafter_reads_next_token)
        scheduler_config.suspend_drafts = bool(spec and spec.method != "ngram" and spec.adaptive)
        enc_budget = args.max_num_encoder_input_tokens or max(batched, max_len)
        scheduler_config.max_num_encoder_input_tokens = enc_budget
        scheduler_config.encoder_cache_size = args.encoder_cache_size or 2 * enc_budget
        scheduler_config.state_snapshot_interval = args.state_snapshot_interval
        cache_config = CacheConfig(args.block_size, args.num_kv_blocks, args.kv_cache_memory,
                                   cache_dtype=args.kv_cache_dtype,
                                   num_state_snapshots=args.num_state_snapshots)
        # Which kernels run: decided here, once, for the whole engine.
        platform = platforms.from_engine_args(args, model_config.device, model_config.dtype)
        if scheduler_config.suspend_drafts:  # the batch from which no request drafts
            limits = [spec.disable_by_batch_size, platform.fast_decode_rows]
            limits = [n for n in limits if n is not None]
            scheduler_config.draft_batch_limit = min(limits) if limits else None
        runner_type, pooler = resolve_pooling(args.runner, args.pooler_config,
                                              model_config.hf_config, model_config.path)
        if runner_type == "pooling" and spec is not None:
            raise ValueError("speculative_config: the pooling runner samples nothing to "
                             "speculate on")
        return cls(model_config, scheduler_config, cache_config, platform, tokenizer,
                   model_config.eos_token_ids(tokenizer), args.reasoning_parser,
                   runner_type=runner_type, pooler_config=pooler)

    def structured_output(self):
        """A grammar manager (xgrammar loads on the first structured request)."""
        from tokenmill.structured_output.manager import StructuredOutputManager
        parser = None
        if self.reasoning_parser is not None:
            from tokenmill.parsers.registry import get_reasoning_parser
            parser = get_reasoning_parser(self.reasoning_parser)
        return StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                       self.eos_token_ids, reasoning_parser=parser)


def load_tokenizer(path: str):
    if not any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        logger.warning("no tokenizer in %s: prompts must be token ids, outputs have no text", path)
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def build_engine_core(args: EngineArgs, setup: EngineSetup | None = None) -> EngineCore:
    """The engine core of `args`, in this process (also the main of a core process)."""
    import torch  # noqa: local so `tokenmill --help` stays fast
    torch.manual_seed(args.seed)
    setup = setup or EngineSetup.from_args(args)
    spec = args.speculative_config
    return EngineCore(setup.model_config, setup.cache_config, setup.scheduler_config,
                      async_scheduling=resolve_async(args.async_scheduling,
                                                     setup.model_config.device),
                      kv_connector_config=args.kv_connector, platform=setup.platform,
                      speculative_config=spec, structured_output=setup.structured_output(),
                      tensor_parallel_size=args.tensor_parallel_size)
