"""`tokenmill bench throughput`: offline throughput, tokenmill vs HF generate, in one run.

Both sides run the same seeded workload (random token-id prompts, greedy,
ignore_eos, per-request output lengths) on the same weights and dtype:

- tokenmill: one `LLM.generate` call over every request (continuous batching).
- HF transformers: `model.generate` on static batches in workload order, left
  padded. A static batch runs until its longest request is done, so every row
  generates the batch maximum; only each request's own length counts as output.

Output tok/s = counted output tokens / wall seconds of the timed part.

`--structured json` adds, on the same LLM, the workload with every request
constrained to BENCH_JSON_SCHEMA (greedy; a request ends at its max_tokens or
when its JSON is complete, which then must parse), then the unstructured
workload once more, and prints structured / that second unstructured run (both
warm; the first timed run also pays first-touch costs). A model folder without
a tokenizer borrows the demo model's (its 4096 tokens; the rest of the
vocabulary is never allowed by a grammar); both runs skip detokenizing.

Longer than 500 lines on purpose: one command, its workload and its three baselines
in one file, so what is compared with what reads in one place.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

BENCH_MODEL_NAME = "bench-qwen3-512"
BENCH_MODEL_CONFIG = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    head_dim=64, intermediate_size=1536, vocab_size=32000, tie_word_embeddings=False,
    max_position_embeddings=2048)
# nano-vllm's benchmark model: Qwen3-0.6B's architecture (random weights here).
QWEN3_0_6B_CONFIG = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
# Built-in benchmark models (random bf16 weights, built locally once): name ->
# (transformers config class, model class, config). The hybrid is the dense
# model's size class with three Gated DeltaNet layers per full-attention layer.
BENCH_MODELS = {
    BENCH_MODEL_NAME: ("Qwen3Config", "Qwen3ForCausalLM", BENCH_MODEL_CONFIG),
    "bench-qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_0_6B_CONFIG),
    "bench-qwen3.5-512": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        BENCH_MODEL_CONFIG, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention",
                     "full_attention"] * 2)),
    # DeepSeek-V2 in the same size class: MLA (a 128 + 32 latent per token instead of
    # K and V per head), 16 routed experts (4 per token) + 1 shared, a dense first layer;
    # long enough for `bench window`'s 8k context.
    "bench-deepseek-v2-512": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        BENCH_MODEL_CONFIG, max_position_embeddings=16384, num_key_value_heads=8,
        q_lora_rank=None, kv_lora_rank=128,
        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=384,
        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0)),
    # Gemma 3 in the same size class: five local (sliding, window 1024) layers per
    # global one, Gemma's norms and gelu MLP, tied embeddings; long enough for the
    # long-context `bench window` (8k of context).
    "bench-gemma3-512": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        BENCH_MODEL_CONFIG, tie_word_embeddings=True, max_position_embeddings=16384,
        query_pre_attn_scalar=64, sliding_window=1024, sliding_window_pattern=6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)),
}
DTYPES = ("bfloat16", "float16", "float32")
PAD_TOKEN_ID = 0
# `--structured json`: the schema every request's output must match in the structured run.
BENCH_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "kind": {"type": "string", "enum": ["mill", "barn", "river", "road"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "string"},
    },
    "required": ["id", "name", "kind", "tags", "notes"],
}


# ---- arguments -----------------------------------------------------------------
def int_range(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B), both inclusive, 1 <= A <= B."""
    parts = text.split(":")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected A:B with integers 1 <= A <= B (e.g. 32:512), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B, got {text!r}")
    return lo, hi


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"local HF model folder, or a built-in benchmark model "
                        f"({', '.join(BENCH_MODELS)}; random weights, built once into "
                        f"$TOKENMILL_CACHE or ~/.cache/tokenmill; NAME-VARIANT, VARIANT one "
                        f"of {', '.join(QUANTIZED_VARIANTS)}: its GPTQ copy). "
                        f"Default: {BENCH_MODEL_NAME}")
    p.add_argument("--num-prompts", type=positive_int, default=128)
    p.add_argument("--input-len", type=int_range, default=(32, 512), metavar="A:B",
                   help="prompt lengths, uniform integers in [A, B] (default 32:512)")
    p.add_argument("--output-len", type=int_range, default=(32, 256), metavar="A:B",
                   help="output lengths, uniform integers in [A, B] (default 32:256)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    from tokenmill.engine.arg_utils import add_quantization_arg
    add_quantization_arg(p)
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or auto (CUDA where torch sees a GPU; default auto)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV cache block (default: the engine's)")
    p.add_argument("--output-json", default=None, metavar="PATH")
    p.add_argument("--skip-hf", action="store_true", help="skip the HF generate baseline")
    p.add_argument("--hf-num-prompts", type=positive_int, default=None, metavar="N",
                   help="run the HF baseline on the first N requests only (default: all)")
    p.add_argument("--hf-batch-size", type=positive_int, default=32)
    p.add_argument("--skip-hf-cb", action="store_true",
                   help="skip the HF continuous batching baseline (transformers generate_batch)")
    p.add_argument("--hf-cb-num-prompts", type=positive_int, default=None, metavar="N",
                   help="run the HF continuous batching baseline on the first N requests only "
                        "(default: --hf-num-prompts, else all)")
    p.add_argument("--skip-roofline", action="store_true",
                   help="skip the peak GEMM measurement and the roofline ratios")
    p.add_argument("--structured", choices=("json",), default=None,
                   help="also run the same workload with every request's output constrained "
                        "to a JSON schema (structured output) and print structured / "
                        "unstructured. A model without a tokenizer borrows the demo model's")
    p.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="N",
                   help="run tokenmill as N engine replicas (one process each, an equal share "
                        "of the CPUs), then as one replica on one share and as one replica "
                        "on every CPU, and print the ratios")
    from tokenmill.engine.arg_utils import add_cpu_platform_args
    add_cpu_platform_args(p)


# ---- the benchmark model -------------------------------------------------------
def cache_root() -> str:
    return os.environ.get("TOKENMILL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "tokenmill")


def _is_saved_model(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path))


# Integer-quantized copies of the benchmark models, "<bench model>-<variant>": the bf16
# model's weights quantized by tokenmill's own GPTQ writer (round to nearest,
# symmetric; models/quant_formats), written once beside it. gptq-int4 has llama.cpp
# Q4_0's 32-weight groups, gptq-int8 one scale per row (Q8_0's are per 32 weights).
QUANTIZED_VARIANTS = {
    "gptq-int4": dict(bits=4, group_size=32),
    "gptq-int4-g128": dict(bits=4, group_size=128),
    "gptq-int8": dict(bits=8, group_size=-1),
}


def quantized_variant(name: str) -> tuple[str, str] | None:
    """(base bench model, variant) of a quantized bench model's name, else None."""
    for variant in QUANTIZED_VARIANTS:
        base = name.removesuffix("-" + variant)
        if base != name and base in BENCH_MODELS:
            return base, variant
    return None


def is_bench_model(name: str) -> bool:
    return name in BENCH_MODELS or quantized_variant(name) is not None


def hf_baseline_path(name: str, path: str) -> str:
    """The checkpoint the HF baseline runs: a quantized bench model's bf16 base (HF
    transformers loads GPTQ only through optional packages), else `path`."""
    found = quantized_variant(name)
    return ensure_bench_model(found[0]) if found is not None else path


def ensure_bench_model(name: str = BENCH_MODEL_NAME) -> str:
    """Build a random-weight benchmark model (or a quantized copy of one) once; later
    runs reuse the folder."""
    path = os.path.join(cache_root(), name)
    if os.path.isdir(path) and _is_saved_model(path):
        return path
    found = quantized_variant(name)
    if found is not None:
        from tokenmill.models.quant_formats import write_gptq_checkpoint
        base, variant = found
        logger.info("writing the %s copy of %s in %s", variant, base, path)
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_root())
        try:
            write_gptq_checkpoint(ensure_bench_model(base), tmp, sym=True,
                                  return_dequantized=False, **QUANTIZED_VARIANTS[variant])
            os.rename(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not _is_saved_model(path):
                raise
        return path
    import torch
    import transformers

    config_cls, model_cls, config = BENCH_MODELS[name]
    logger.info("building the benchmark model in %s", path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
    model = model.to(torch.bfloat16)
    # Save beside the target and rename: a reader never sees a half-written folder.
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=os.path.dirname(path))
    try:
        model.save_pretrained(tmp)
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_saved_model(path):  # not a lost race with another run: a real error
            raise
    return path


def read_model_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"--model {path!r} is not a local folder (this benchmark never downloads)")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise ValueError(f"--model folder {path!r} has no config.json")
    with open(cfg) as f:
        return json.load(f)


# ---- the workload --------------------------------------------------------------
@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int) -> "Workload":
        return Workload(self.prompts[:n], self.output_lens[:n])


def make_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int) -> Workload:
    import numpy as np
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_prompts)
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in in_lens]
    return Workload(prompts, [int(n) for n in out_lens])


# ---- tokenmill -----------------------------------------------------------------
def _tokenmill_generate(llm, workload: Workload, structured: dict | None = None):
    """`structured`: extra SamplingParams of the --structured runs (both of them)."""
    from tokenmill import SamplingParams
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **(structured or {}))
              for n in workload.output_lens]
    return llm.generate(prompts, params, use_tqdm=False)


def run_tokenmill(model_path: str, workload: Workload, warmup: Workload, args,
                  max_model_len: int, **engine_kwargs):
    """-> (LLM, output tok/s, seconds, generated token ids per request)."""
    from tokenmill import LLM
    engine_kwargs.setdefault("device", getattr(args, "device", "auto"))
    engine_kwargs.setdefault("quantization", getattr(args, "quantization", None))
    if getattr(args, "block_size", None) is not None:
        engine_kwargs.setdefault("block_size", args.block_size)
    llm = LLM(model_path, dtype=args.dtype, seed=args.seed, max_model_len=max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              **platform_kwargs(args), **engine_kwargs)
    if getattr(args, "structured", None):  # the structured run's workload, minus the grammar
        return run_timed(llm, workload, warmup, {"detokenize": False})
    _tokenmill_generate(llm, warmup)  # first-call costs (allocator, kernels) stay untimed
    start = time.perf_counter()
    outputs = _tokenmill_generate(llm, workload)
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return llm, sum(len(t) for t in token_ids) / seconds, seconds, token_ids


def run_dp_baselines(model_path: str, workload: Workload, warmup: Workload, args,
                     max_model_len: int, dp: int, dp_tok_s: float, dp_ids) -> dict:
    """tokenmill with one replica, on one replica's share of the CPUs (DP's scaling) and
    on all of them (what DP gains over not using it); the same greedy tokens."""
    from tokenmill.engine.launchers import cpu_shares
    cpus, threads = cpu_shares(dp)[0]
    out = {"data_parallel_size": dp, "tok_s": dp_tok_s, "replica_cpus": cpus}
    for key, pin in (("one_share", cpus), ("all_cpus", None)):
        with pinned(pin, threads):
            llm, tok_s, seconds, ids = run_tokenmill(model_path, workload, warmup, args,
                                                     max_model_len)
        del llm
        gc.collect()
        if ids != dp_ids:
            logger.warning("DP=%d and DP=1 (%s) disagree on some greedy tokens", dp, key)
        logger.info("tokenmill, one replica (%s): %.1f output tok/s (%.1f s)", key, tok_s,
                    seconds)
        out[key] = {"tok_s": tok_s, "ratio": dp_tok_s / tok_s}
    return out


@contextlib.contextmanager
def pinned(cpus, threads):
    """This process (and the threads it starts) on `cpus` with `threads` intra-op
    threads, restored after; None: as it is."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    import torch
    old_cpus, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old_cpus)
        torch.set_num_threads(old_threads)


def format_data_parallel(dp: dict) -> str:
    n = dp["data_parallel_size"]
    return "\n".join([
        f"data parallel: {n} replicas, {dp['tok_s']:.1f} output tok/s",
        f"  / one replica on one replica's CPUs {dp['replica_cpus']}: "
        f"{dp['one_share']['tok_s']:.1f} tok/s -> {dp['one_share']['ratio']:.2f}x",
        f"  / one replica on every CPU: {dp['all_cpus']['tok_s']:.1f} tok/s -> "
        f"{dp['all_cpus']['ratio']:.2f}x"])


def platform_kwargs(args) -> dict:
    """The CPU kernel engine arguments of a bench command (defaults where it has none)."""
    if not hasattr(args, "cpu_kernels"):
        return {}
    from tokenmill.engine.arg_utils import cpu_platform_kwargs
    return cpu_platform_kwargs(args)


def format_platform(platform: dict) -> str:
    """The text output's line on the kernels that ran (platform: CpuPlatform.as_dict())."""
    return f"platform: {platform['description']}"


def checkpoint_bytes(path: str) -> int | None:
    """Bytes of the checkpoint's weight files (*.safetensors, else *.bin), None if none."""
    for ext in (".safetensors", ".bin"):
        files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(ext)]
        if files:
            return sum(os.path.getsize(f) for f in files)
    return None


def weight_facts(llm, args) -> dict:
    """--quantization, and what the engine keeps of the weights (None where the model
    lives in other processes: data parallel, an engine process): the model's resident
    bytes plus the greedy lm_head's int8 screen, against the checkpoint's bytes."""
    from tokenmill.models.quantization import quantization_method
    from tokenmill.models.quantize_at_load import resident_weight_bytes
    runner = getattr(llm.llm_engine.engine_core, "runner", None)
    model = getattr(runner, "model", None)
    at_load = getattr(args, "quantization", None)
    stored = quantization_method(llm.llm_engine.model_config.hf_config)
    resident = None
    if model is not None:
        resident = resident_weight_bytes(model)
        head = getattr(runner, "greedy_head", None)
        if head is not None:  # a copy of the lm_head in int8, beside the model's
            resident += sum(t.nbytes for t in (head.q, head.scale, head.coef, head.l1))
    ckpt = checkpoint_bytes(llm.llm_engine.model_config.path)
    return {"quantization": at_load or (stored[1] if stored else None),
            "quantized_at_load": bool(at_load),
            "resident_weight_bytes": resident, "checkpoint_bytes": ckpt,
            "resident_over_checkpoint": (resident / ckpt if resident is not None and ckpt
                                         else None)}


def format_weights(facts: dict) -> str:
    """The text output's line on the weights: as stored (quantized or not), or
    quantized at load; resident bytes against the checkpoint's."""
    how = "--quantization" if facts.get("quantized_at_load") else "the checkpoint's"
    kind = (f"{facts['quantization']} ({how})" if facts["quantization"]
            else "as stored")
    size = facts["resident_weight_bytes"]
    text = f"weights: {kind}" + ("" if size is None else f", {size / 2**20:.1f} MiB resident")
    if facts.get("resident_over_checkpoint") is not None:
        text += (f" ({facts['resident_over_checkpoint']:.2f}x the checkpoint's "
                 f"{facts['checkpoint_bytes'] / 2**20:.1f} MiB)")
    return text


def run_timed(llm, workload: Workload, warmup: Workload, structured: dict):
    """One untimed warmup and one timed run with these extra SamplingParams."""
    _tokenmill_generate(llm, warmup, structured)  # (also compiles the schema, untimed)
    start = time.perf_counter()
    outputs = _tokenmill_generate(llm, workload, structured)
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return llm, sum(len(t) for t in token_ids) / seconds, seconds, token_ids


def bench_tokenizer(model_path: str) -> str | None:
    """A tokenizer for --structured (a grammar needs one): the model's, else the demo's."""
    if any(os.path.exists(os.path.join(model_path, f))
           for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from tokenmill.demo_model import ensure_demo_model
    return ensure_demo_model()


def run_structured(llm, workload: Workload, warmup: Workload, kind: str):
    """The same workload, every output constrained (greedy; a request ends at its
    max_tokens or when its JSON is complete). -> (tok/s, s, tokens, number complete)."""
    from tokenmill import StructuredOutputsParams
    assert kind == "json"
    sop = StructuredOutputsParams(json=BENCH_JSON_SCHEMA, disable_any_whitespace=True)
    _, tok_s, seconds, token_ids = run_timed(
        llm, workload, warmup, {"detokenize": False, "structured_outputs": sop})
    tok = llm.get_tokenizer()
    complete = 0
    for ids, n in zip(token_ids, workload.output_lens):
        if len(ids) < n:  # ended by its grammar: must be valid JSON
            text = tok.decode(ids, skip_special_tokens=True)
            json.loads(text)
            complete += 1
    return tok_s, seconds, sum(len(t) for t in token_ids), complete


def check_lengths(token_ids: list[list[int]], workload: Workload) -> str | None:
    """An error message when a request did not get exactly its max_tokens."""
    generated = sum(len(t) for t in token_ids)
    if generated == workload.total_output_tokens:
        return None
    wrong = [i for i, (t, n) in enumerate(zip(token_ids, workload.output_lens)) if len(t) != n]
    return (f"tokenmill generated {generated} tokens, the workload asks for "
            f"{workload.total_output_tokens}; wrong lengths in requests {wrong[:8]}")


# ---- HF transformers generate --------------------------------------------------
def _left_pad(prompts: list[list[int]], device):
    import torch
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _hf_generate_batch(model, prompts: list[list[int]], num_new: int):
    """Greedy, exactly num_new tokens per row (EOS cannot stop a row early)."""
    import torch
    ids, mask = _left_pad(prompts, model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=num_new, min_new_tokens=num_new,
                             pad_token_id=PAD_TOKEN_ID)
    out = out[:, ids.shape[1]:].cpu()  # to the host: the timer then covers device work too
    if out.shape[1] != num_new:
        raise RuntimeError(f"HF generate made {out.shape[1]} tokens per row, expected {num_new}")
    return out


def run_hf(model_path: str, workload: Workload, warmup: Workload, dtype: str, device,
           batch_size: int):
    """-> (useful output tok/s, seconds, generated token ids, generated tokens incl. waste)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    _hf_generate_batch(model, warmup.prompts, max(warmup.output_lens))
    batches = [range(i, min(i + batch_size, len(workload.prompts)))
               for i in range(0, len(workload.prompts), batch_size)]
    token_ids: list[list[int]] = []
    generated = 0
    start = time.perf_counter()
    for rows in batches:
        lens = [workload.output_lens[i] for i in rows]
        out = _hf_generate_batch(model, [workload.prompts[i] for i in rows], max(lens))
        generated += out.numel()
        token_ids += [out[r, :n].tolist() for r, n in enumerate(lens)]
    seconds = time.perf_counter() - start
    return workload.total_output_tokens / seconds, seconds, token_ids, generated


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of each output that matches before the first divergence."""
    shares = []
    for x, y in zip(a, b):
        same = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        shares.append(same / max(len(x), 1))
    return sum(shares) / max(len(shares), 1)


# ---- HF continuous batching and the roofline -----------------------------------
def run_extra_baselines(args, model_path: str, workload: Workload, warmup: Workload, device,
                        tm_ids: list[list[int]], tm_seconds: float, hf: tuple | None,
                        hf_n: int, gemm_dtype: str | None = None) -> dict:
    """HF continuous batching (unless --skip-hf-cb) and the roofline (unless
    --skip-roofline). -> the extra --output-json fields (keys hf_cb_*, roofline).
    `gemm_dtype`: what tokenmill's GEMMs ran in (its platform's; None: --dtype)."""
    extra: dict = {"bench": "throughput", "hf_cb_tok_s": None, "ratio_hf_cb": None,
                   "hf_cb_seconds": None, "hf_cb_greedy_agreement": None,
                   "hf_cb_num_prompts": None, "hf_cb_error": None, "roofline": None}
    if not args.skip_hf_cb:
        from tokenmill.bench.hf_cb import run_hf_cb
        from tokenmill.engine.engine_args import DEFAULT_CHUNKED_BATCHED_TOKENS
        n = args.hf_cb_num_prompts or args.hf_num_prompts or args.num_prompts
        cb_work = workload.head(n)
        extra["hf_cb_num_prompts"] = n
        try:
            tok_s, seconds, ids = run_hf_cb(
                model_path, cb_work.prompts, cb_work.output_lens, warmup.prompts,
                warmup.output_lens, args.dtype, device,
                args.max_num_batched_tokens or DEFAULT_CHUNKED_BATCHED_TOKENS, args.max_num_seqs)
        except Exception as e:  # an external library's baseline: report it, keep the rest
            logger.error("HF continuous batching failed: %s: %s", type(e).__name__, e)
            extra["hf_cb_error"] = f"{type(e).__name__}: {e}"
        else:
            agreement = greedy_agreement(tm_ids[:n], ids)
            tm_tok_s = workload.total_output_tokens / tm_seconds
            logger.info("HF continuous batching: %.1f output tok/s (%.1f s, %d requests); "
                        "greedy agreement with tokenmill %.1f%%", tok_s, seconds, n,
                        100 * agreement)
            extra.update(hf_cb_tok_s=tok_s, ratio_hf_cb=tm_tok_s / tok_s, hf_cb_seconds=seconds,
                         hf_cb_greedy_agreement=agreement)
    if not args.skip_roofline:
        from tokenmill.bench import roofline as rl
        peaks = rl.measure_peaks(model_path, device, rl.PEAK_DTYPES + (args.dtype,))
        runs = {"tokenmill": (workload, tm_seconds)}
        if hf is not None:
            runs["HF generate"] = (workload.head(hf_n), hf[1])
        if extra["hf_cb_seconds"]:
            runs["HF continuous batching"] = (workload.head(extra["hf_cb_num_prompts"]),
                                              extra["hf_cb_seconds"])
        runs = {k: ([len(p) for p in w.prompts], w.output_lens, s) for k, (w, s) in runs.items()}
        extra["roofline"] = rl.roofline(rl.count_model_flops(model_path), peaks, runs,
                                        gemm_dtype or args.dtype)
    return extra


# ---- report --------------------------------------------------------------------
def format_table(tm_tok_s: float, hf_tok_s: float | None,
                 hf_cb_tok_s: float | None = None) -> str:
    """Output tok/s per system and tokenmill's ratio to each baseline."""
    rows = [("tokenmill", f"{tm_tok_s:.1f}", "")]
    for name, tok_s in (("HF generate", hf_tok_s), ("HF continuous batching", hf_cb_tok_s)):
        rows.append((name, f"{tok_s:.1f}" if tok_s else "skipped",
                     f"{tm_tok_s / tok_s:.2f}x" if tok_s else "-"))
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'':<{width}}  output tok/s  tokenmill / this"]
    lines += [f"{name:<{width}}  {value:>12}  {ratio:>16}" for name, value, ratio in rows]
    return "\n".join(lines)


def format_structured(kind: str, plain_tok_s: float, structured_tok_s: float) -> str:
    """Structured vs the unstructured run right after it (both warm)."""
    rows = [("unstructured (warm)", f"{plain_tok_s:.1f}"),
            (f"structured ({kind})", f"{structured_tok_s:.1f}"),
            ("structured / unstructured", f"{structured_tok_s / plain_tok_s:.2f}")]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':<{width}}  output tok/s"]
    lines += [f"{name:<{width}}  {value:>12}" for name, value in rows]
    return "\n".join(lines)


def _fmt_range(r: tuple[int, int]) -> str:
    return f"{r[0]}:{r[1]}"


def validate_args(args: argparse.Namespace, hf_config: dict) -> int:
    """-> max_model_len: room for the longest prompt plus the longest output."""
    if args.hf_num_prompts is not None and args.hf_num_prompts > args.num_prompts:
        raise ValueError(f"--hf-num-prompts ({args.hf_num_prompts}) exceeds --num-prompts "
                         f"({args.num_prompts})")
    if getattr(args, "hf_cb_num_prompts", None) and args.hf_cb_num_prompts > args.num_prompts:
        raise ValueError(f"--hf-cb-num-prompts ({args.hf_cb_num_prompts}) exceeds --num-prompts "
                         f"({args.num_prompts})")
    max_model_len = args.input_len[1] + args.output_len[1]
    limit = hf_config.get("max_position_embeddings", 2048)
    if max_model_len > limit:
        raise ValueError(f"longest prompt + output ({max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({limit})")
    return max_model_len


def build_result(args, model_path: str, device, max_model_len: int, workload: Workload,
                 tm: tuple[float, float], hf: tuple | None, hf_n: int) -> dict:
    """The --output-json document. tm = (tok/s, s); hf = (tok/s, s, generated, agreement)."""
    from tokenmill.engine.engine_args import EngineArgs
    hf_tok_s, hf_seconds, hf_generated, agreement = hf or (None, None, None, None)
    return {
        "tokenmill_tok_s": tm[0],
        "hf_generate_tok_s": hf_tok_s,
        "ratio": tm[0] / hf_tok_s if hf_tok_s else None,
        "tokenmill_seconds": tm[1],
        "hf_generate_seconds": hf_seconds,
        "greedy_agreement": agreement,
        "workload": {
            "model": model_path, "dtype": args.dtype, "device": str(device),
            "seed": args.seed, "num_prompts": args.num_prompts,
            "input_len": _fmt_range(args.input_len), "output_len": _fmt_range(args.output_len),
            "total_prompt_tokens": workload.total_prompt_tokens,
            "total_output_tokens": workload.total_output_tokens,
            "max_model_len": max_model_len, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": getattr(args, "block_size", None) or EngineArgs.block_size,
            "hf_skipped": hf is None, "hf_num_prompts": hf_n,
            "hf_batch_size": args.hf_batch_size,
            "hf_output_tokens": workload.head(hf_n).total_output_tokens,
            # Static batching pads every row to its batch's longest output: the waste.
            "hf_generated_tokens": hf_generated,
        },
    }


def run_throughput_bench(args: argparse.Namespace) -> int:
    name = args.model or BENCH_MODEL_NAME
    model_path = ensure_bench_model(name) if is_bench_model(name) else name
    hf_config = read_model_config(model_path)
    max_model_len = validate_args(args, hf_config)
    vocab = hf_config["vocab_size"]
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    # Short requests, from another seed, to warm both sides up untimed.
    warmup = make_workload(4, (16, 32), (4, 8), vocab, args.seed + 1)
    logger.info("workload: %d requests, %d prompt tokens, %d output tokens",
                args.num_prompts, workload.total_prompt_tokens, workload.total_output_tokens)

    extra = {}
    if getattr(args, "structured", None):
        tokenizer = bench_tokenizer(model_path)
        if tokenizer is not None:
            extra["tokenizer"] = tokenizer
    dp = getattr(args, "data_parallel_size", 1)
    if dp > 1:
        extra["data_parallel_size"] = dp
    llm, tm_tok_s, tm_seconds, tm_ids = run_tokenmill(model_path, workload, warmup, args,
                                                      max_model_len, **extra)
    device = llm.llm_engine.model_config.device
    platform = llm.llm_engine.platform.as_dict()
    weights = weight_facts(llm, args)
    error = check_lengths(tm_ids, workload)
    if error:
        logger.error(error)
        return 1
    logger.info("tokenmill: %.1f output tok/s (%.1f s)", tm_tok_s, tm_seconds)
    structured = None
    if getattr(args, "structured", None):
        try:
            structured = run_structured(llm, workload, warmup, args.structured)
        except ValueError as e:  # a grammar-ended output that does not parse
            logger.error("structured output is not valid JSON: %s", e)
            return 1
        logger.info("tokenmill --structured %s: %.1f output tok/s (%.1f s, %d tokens, %d of %d "
                    "requests ended by their grammar)", args.structured, structured[0],
                    structured[1], structured[2], structured[3], args.num_prompts)
        # The first timed run also pays first-touch costs (KV cache pages, allocator
        # growth): compare with an unstructured run after it, as warm as the structured one.
        _, warm_tok_s, warm_seconds, _ = run_timed(llm, workload, warmup, {"detokenize": False})
        logger.info("tokenmill unstructured again: %.1f output tok/s (%.1f s)", warm_tok_s,
                    warm_seconds)
        structured = structured + (warm_tok_s,)
    if dp > 1:
        llm.llm_engine.shutdown()
    del llm  # free its weights and KV cache before the baseline loads
    gc.collect()
    data_parallel = None
    if dp > 1:
        data_parallel = run_dp_baselines(model_path, workload, warmup, args, max_model_len,
                                         dp, tm_tok_s, tm_ids)

    hf = None
    hf_n = args.hf_num_prompts or args.num_prompts
    hf_path = hf_baseline_path(name, model_path)  # (a quantized bench model's bf16 base)
    if not args.skip_hf:
        hf_work = workload.head(hf_n)
        hf_tok_s, hf_seconds, hf_ids, hf_generated = run_hf(
            hf_path, hf_work, warmup, args.dtype, device, args.hf_batch_size)
        agreement = greedy_agreement(tm_ids[:hf_n], hf_ids)
        logger.info("HF generate: %.1f useful output tok/s (%.1f s, %d tokens generated for "
                    "%d useful); greedy agreement with tokenmill %.1f%%", hf_tok_s, hf_seconds,
                    hf_generated, hf_work.total_output_tokens, 100 * agreement)
        hf = (hf_tok_s, hf_seconds, hf_generated, agreement)
    more = run_extra_baselines(args, hf_path, workload, warmup, device, tm_ids, tm_seconds,
                               hf, hf_n, platform["gemm_dtype"])

    print(format_platform(platform))
    print(format_weights(weights))
    print(format_table(tm_tok_s, hf[0] if hf else None, more["hf_cb_tok_s"]))
    if data_parallel is not None:
        print(format_data_parallel(data_parallel))
    if more["roofline"] is not None:
        from tokenmill.bench.roofline import format_roofline
        print(format_roofline(more["roofline"]))
    if structured is not None:
        print(format_structured(args.structured, structured[4], structured[0]))
    if args.output_json:
        result = build_result(args, model_path, device, max_model_len, workload,
                              (tm_tok_s, tm_seconds), hf, hf_n)
        result.update(more)
        result["platform"] = platform
        result["weights"] = weights
        result["workload"]["quantization"] = weights["quantization"]
        if data_parallel is not None:
            result["data_parallel"] = data_parallel
        if structured is not None:
            result["structured"] = {
                "kind": args.structured, "schema": BENCH_JSON_SCHEMA,
                "tok_s": structured[0], "seconds": structured[1],
                "output_tokens": structured[2], "ended_by_grammar": structured[3],
                "unstructured_warm_tok_s": structured[4],
                "ratio_to_unstructured": structured[0] / structured[4]}
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0
