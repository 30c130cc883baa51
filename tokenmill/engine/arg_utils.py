"""The engine's command-line flags: argparse builders for every EngineArgs option (and
the request caps), and the flags back to EngineArgs keyword arguments. Shared by the
`tokenmill` command, the server and the benchmarks, next to EngineArgs rather than in
the CLI, so none of them imports another's entry point."""
from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("--model", required=model_required, default=None,
                   help="local HF folder or hub id (default: the built-in demo model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add_quantization_arg(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on for CUDA, off on CPU)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs / prompt_logprobs a request may ask for")
    p.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                   help="multimodal models: image tokens the encoder takes per step "
                        "(default: max(max-num-batched-tokens, max-model-len))")
    p.add_argument("--encoder-cache-size", type=int, default=None,
                   help="multimodal models: encoder output rows kept for reuse "
                        "(default: twice the encoder budget)")
    add_reasoning_parser_arg(p)
    add_kv_cache_args(p)
    add_cpu_platform_args(p)
    add_limit_args(p)
    add_speculative_args(p)
    add_parallel_args(p)
    add_pooling_args(p)


def add_reasoning_parser_arg(p: argparse.ArgumentParser) -> None:
    """vLLM's --reasoning-parser: an engine flag, as grammars wait for the reasoning."""
    from tokenmill.parsers.registry import REASONING_PARSERS
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="the model thinks between <think> tags: chat answers carry the "
                        "thinking in reasoning_content, and a JSON schema or tool grammar "
                        "applies only after it (default: none)")


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    """vLLM's --quantization (also taken by the benchmarks)."""
    from tokenmill.models.quantization import QUANTIZE_AT_LOAD as AT_LOAD
    p.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help=f"quantize an unquantized checkpoint's weights at load: "
                        f"{', '.join(AT_LOAD)} (per-channel weights, activations "
                        f"unquantized); a quantized checkpoint's own method is accepted, "
                        f"another refused (default: the weights as stored)")


def add_pooling_args(p: argparse.ArgumentParser) -> None:
    """vLLM's --runner / --task and --pooler-config (tokenmill/pooling/config.py)."""
    g = p.add_argument_group("pooling (embeddings)")
    g.add_argument("--runner", choices=["auto", "generate", "pooling"], default=None,
                   help="pooling: an embedding engine (/v1/embeddings; generation refused); "
                        "generate: generation only over HTTP; auto: pooling for a checkpoint "
                        "without an LM head (*Model) or with sentence-transformers files, "
                        "else generate (default: auto)")
    g.add_argument("--task", choices=["auto", "generate", "embed"], default=None,
                   help="vLLM's older name for --runner: embed = pooling")
    g.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='how embeddings pool, over the checkpoint\'s sentence-transformers '
                        'files: \'{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": '
                        'true}\' (default: those files, else LAST, normalised)')


def pooling_kwargs(args: argparse.Namespace) -> dict:
    from tokenmill.pooling.config import TASK_RUNNERS
    runner, task = getattr(args, "runner", None), getattr(args, "task", None)
    task = TASK_RUNNERS[task] if task is not None else None
    if runner is not None and task is not None and task != runner:
        raise ValueError(f"--task {args.task} contradicts --runner {runner}")
    return dict(runner=runner or task or "auto",
                pooler_config=getattr(args, "pooler_config", None))


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("processes")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine core in a process of its own, fed over ZeroMQ "
                        "(default: off; `serve` decides where it pays)")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engine replicas, each in its own process with its share of the "
                        "CPUs; requests go to the least loaded")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="how the engine processes start: local processes, or Ray actors "
                        "(a running Ray cluster, or a local one started on demand)")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (fields: method, '
                        'num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, '
                        'disable_by_batch_size, adaptive; default: off)')


def add_kv_cache_dtype_arg(p) -> None:
    from tokenmill.core.kv_cache_spec import KV_CACHE_DTYPES
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="K/V element type: auto (the model's dtype) or fp8 = fp8_e4m3 "
                        "(float8_e4m3fn: twice a bf16 cache's tokens in the same memory, "
                        "values saturating at +-448; default: auto)")


def add_cpu_platform_args(p: argparse.ArgumentParser) -> None:
    """The engine arguments that choose the kernels (tokenmill/platforms/cpu.py), and
    the KV cache's element type the attention kernels read (every bench takes these)."""
    from tokenmill.platforms import cpu as cp
    from tokenmill.kernels import all_levels
    add_kv_cache_dtype_arg(p.add_argument_group("KV cache"))
    g = p.add_argument_group("CPU kernels")
    g.add_argument("--cpu-kernels", choices=cp.CPU_KERNELS, default="auto",
                   help="auto: the native C++ kernels where they build, else PyTorch; native: "
                        "the native kernels or an error; torch: the plain PyTorch path "
                        "everywhere (default: auto)")
    g.add_argument("--cpu-capability", default=None, metavar="LEVEL",
                   help=f"run the native kernels built for LEVEL ({', '.join(all_levels())}), "
                        f"at most what this CPU runs; below avx512 a bf16 model's GEMMs run "
                        f"in fp32 as on such a CPU (default: the best level this CPU runs)")
    g.add_argument("--linear-bf16-max-rows", type=int, default=None, metavar="N",
                   help="a bf16 model's inputs of up to N rows take the packed bf16 kernel, "
                        "larger ones a GEMM over a second copy of the weights (fp32 where "
                        "bf16 is emulated) (0: never; default: every input where the CPU "
                        "has no native bf16, so the packed weights are the only copy; "
                        f"{cp.DEFAULT_NATIVE_BF16_PACKED_ROWS} rows where it has)")
    g.add_argument("--greedy-head-max-rows", type=int,
                   default=cp.DEFAULT_GREEDY_HEAD_MAX_ROWS, metavar="N",
                   help="all-greedy steps of up to N rows take their tokens from the "
                        "int8-screened lm_head, same tokens as the full one (0: never; at most "
                        f"{cp.GREEDY_HEAD_KERNEL_ROWS}; default {cp.DEFAULT_GREEDY_HEAD_MAX_ROWS})")
    g.add_argument("--decode-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="decode steps run every decoder layer in one native call where each "
                        "layer would go native anyway (--no-decode-layers: the Python layers; "
                        "default: on)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying the CUDA graphs "
                        "captured at start-up (no effect on CPU)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N ranks, one process each (rank 0 is the engine "
                        "process), joined by torch.distributed gloo on 127.0.0.1; the heads and "
                        "intermediate sizes must divide by N; with N > 1 the native decode-"
                        "layer loop and the greedy lm_head are off (default: 1)")


def cpu_platform_kwargs(args: argparse.Namespace) -> dict:
    return dict(cpu_kernels=args.cpu_kernels, cpu_capability=args.cpu_capability,
                linear_bf16_max_rows=args.linear_bf16_max_rows,
                greedy_head_max_rows=args.greedy_head_max_rows, decode_layers=args.decode_layers,
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                enforce_eager=getattr(args, "enforce_eager", False),
                kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """One flag per field of RequestLimits (`--max-n`, ...): caps on what one request
    may ask for. Unset: the RequestLimits default."""
    from dataclasses import fields

    from tokenmill.limits import RequestLimits
    g = p.add_argument_group("request limits")
    for f in fields(RequestLimits):
        g.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None,
                       metavar="SECONDS" if isinstance(f.default, float) else "N",
                       help=f"default {f.default}")


def limit_kwargs(args: argparse.Namespace) -> dict:
    """{"limits": {the caps given}} for EngineArgs, or {} when none was."""
    from dataclasses import fields

    from tokenmill.limits import RequestLimits
    given = {f.name: getattr(args, f.name) for f in fields(RequestLimits)
             if getattr(args, f.name, None) is not None}
    return {"limits": given} if given else {}


def add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="automatic prefix caching (default: on; hybrid "
                                      "models snapshot their recurrent state)")
    p.add_argument("--state-snapshot-interval", type=int, default=None,
                   help="hybrid prefix caching: a recurrent-state snapshot every this many "
                        "prompt tokens, in whole blocks (default 256)")
    p.add_argument("--num-state-snapshots", type=int, default=None,
                   help="hybrid prefix caching: recurrent-state snapshot slots (default: 4 "
                        "per sequence, at most a quarter of the KV cache budget)")
    p.add_argument("--kv-store", action="append", default=None, metavar="STORE",
                   help="an external KV store, searched in the order given: cpu, disk:PATH "
                        "or redis://HOST:PORT/DB (repeat for several)")
    p.add_argument("--kv-cpu-bytes", type=int, default=None,
                   help="LRU byte budget of the cpu KV store (default 1 GiB)")
    p.add_argument("--kv-disk-bytes", type=int, default=None,
                   help="LRU byte budget of each disk:PATH KV store, per model and KV "
                        "geometry (default 10 GiB): least recently used entries are "
                        "deleted first")
    p.add_argument("--kv-model-id", default=None,
                   help="the model identity in external KV keys (default: a fingerprint "
                        "of the checkpoint files)")


def kv_cache_kwargs(args: argparse.Namespace) -> dict:
    connector = None
    if getattr(args, "kv_store", None):
        connector = {"stores": args.kv_store}
        if args.kv_cpu_bytes is not None:
            connector["cpu_bytes"] = args.kv_cpu_bytes
        if args.kv_disk_bytes is not None:
            connector["disk_bytes"] = args.kv_disk_bytes
        if args.kv_model_id is not None:
            connector["model_id"] = args.kv_model_id
    out = dict(enable_prefix_caching=getattr(args, "enable_prefix_caching", None),
               kv_connector=connector)
    if getattr(args, "state_snapshot_interval", None) is not None:
        out["state_snapshot_interval"] = args.state_snapshot_interval
    if getattr(args, "num_state_snapshots", None) is not None:
        out["num_state_snapshots"] = args.num_state_snapshots
    return out


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, seed=args.seed,
                quantization=getattr(args, "quantization", None),
                reasoning_parser=getattr(args, "reasoning_parser", None),
                max_model_len=args.max_model_len, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_chunked_prefill=not args.no_chunked_prefill,
                max_logprobs=args.max_logprobs, async_scheduling=args.async_scheduling,
                max_num_encoder_input_tokens=getattr(args, "max_num_encoder_input_tokens", None),
                encoder_cache_size=getattr(args, "encoder_cache_size", None),
                speculative_config=getattr(args, "speculative_config", None),
                engine_process=bool(getattr(args, "engine_process", None)),
                data_parallel_size=getattr(args, "data_parallel_size", 1),
                distributed_executor_backend=getattr(args, "distributed_executor_backend", "mp"),
                **kv_cache_kwargs(args), **cpu_platform_kwargs(args), **limit_kwargs(args),
                **pooling_kwargs(args))


def resolve_model(name: str | None) -> str:
    if name:
        return name
    from tokenmill.demo_model import ensure_demo_model
    return ensure_demo_model()
