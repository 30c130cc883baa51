"""The roofline ratio of the benches: achieved model FLOP/s over the peak GEMM FLOP/s
measured on the same machine in the same run.

Model FLOPs of a request with a prompt of L tokens and O output tokens (greedy,
every output token sampled from one logits row):

- T = L + O - 1 token positions go through the decoder layers (the last sampled
  token is never fed back). Every GEMM weight of the layers (attention q/k/v/o,
  MLP, MoE router, DeltaNet projections and depthwise conv; for MoE experts only
  the `num_experts_per_tok / num_experts` active share) costs 2 FLOPs per
  parameter per position: ``dense = 2 * layer_params * T``.
- lm_head runs on the O rows that sample (never on the other prompt rows):
  ``lm_head = 2 * hidden * vocab * O``.
- Attention scores and values in each full-attention layer, causal (position p,
  0-based, reads p + 1 keys): ``attention = 4 * heads * head_dim * T (T + 1) / 2``
  per layer. Linear-attention (DeltaNet) state updates, norms, rotary, SiLU and
  the embedding lookup are not counted.

The same useful FLOPs are the numerator for every system (a static HF batch also
computes padding rows; they do not count). The peak is the best `torch.mm` FLOP/s
over GEMMs shaped like the model's (M tokens x hidden -> hidden, hidden ->
2 x intermediate, intermediate -> hidden), best of a few repetitions, in bf16 and
in fp32: a CPU without native bf16 (no AVX512-BF16 / AMX) emulates bf16 GEMMs,
and tokenmill then computes its GEMMs in fp32 (its CPU platform's gemm_dtype), so both
ratios are printed.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

GEMM_M = 1024  # rows (tokens) of the peak GEMMs: a large prefill / decode batch
PEAK_DTYPES = ("bfloat16", "float32")


@dataclass
class ModelFlops:
    layer_params: int       # GEMM parameters a token meets in the decoder layers (active experts)
    lm_head_params: int     # hidden * vocab
    attention_layers: int   # full-attention layers (softmax attention over the context)
    num_heads: int
    head_dim: int

    def request(self, prompt_len: int, output_len: int) -> dict[str, int]:
        """Model FLOPs of one request, by part (see the module docstring)."""
        t = prompt_len + output_len - 1
        dense = 2 * self.layer_params * t
        lm_head = 2 * self.lm_head_params * output_len
        attention = 4 * self.attention_layers * self.num_heads * self.head_dim * (t * (t + 1) // 2)
        return {"dense": dense, "lm_head": lm_head, "attention": attention,
                "total": dense + lm_head + attention}

    def workload(self, prompt_lens, output_lens) -> dict[str, int]:
        total = {"dense": 0, "lm_head": 0, "attention": 0, "total": 0}
        for n_in, n_out in zip(prompt_lens, output_lens):
            for k, v in self.request(n_in, n_out).items():
                total[k] += v
        return total


def _text_config(model_path: str) -> dict:
    from tokenmill.config import flatten_text_config
    with open(os.path.join(model_path, "config.json")) as f:
        return flatten_text_config(json.load(f))


def _checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers (no weights are read)."""
    from safetensors import safe_open
    shapes = {}
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {model_path!r}")
    for name in files:
        with safe_open(os.path.join(model_path, name), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _weights(shapes: dict[str, tuple[int, ...]]):
    """(kind, name, shape, numel) per checkpoint tensor; kind: "lm_head", "embed",
    "layer" (decoder layers, not a vision tower's or an MTP head's) or "other"."""
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if name.endswith("lm_head.weight"):
            yield "lm_head", name, shape, numel
        elif name.endswith("embed_tokens.weight"):
            yield "embed", name, shape, numel
        elif ".layers." in name and not any(s in name for s in ("visual", "vision", "mtp")):
            yield "layer", name, shape, numel
        else:
            yield "other", name, shape, numel


def _attention_geometry(cfg: dict) -> tuple[int, int, int, int]:
    """(full-attention layers, heads, head_dim, KV heads) from a text config."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layer_types = cfg.get("layer_types")
    attention_layers = (sum(t == "full_attention" for t in layer_types) if layer_types
                        else cfg["num_hidden_layers"])
    return attention_layers, heads, head_dim, cfg.get("num_key_value_heads") or heads


def _num_experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg.get("num_local_experts") or 0


def count_model_flops(model_path: str) -> ModelFlops:
    """The FLOP counts of a local checkpoint: parameter shapes from its safetensors
    headers, attention geometry from its config.json."""
    cfg = _text_config(model_path)
    num_experts = _num_experts(cfg)
    active = (cfg.get("num_experts_per_tok") or 0) / num_experts if num_experts else 1.0
    layer_params = 0.0
    sizes = {"lm_head": 0, "embed": 0}
    for kind, name, shape, numel in _weights(_checkpoint_shapes(model_path)):
        if kind in sizes:
            sizes[kind] = numel
        elif kind == "layer" and len(shape) >= 2:  # matrices: the GEMMs
            layer_params += numel * (active if ".experts." in name else 1.0)
    # tied word embeddings: lm_head is the embedding matrix
    lm_head = sizes["lm_head"] or sizes["embed"]
    attention_layers, heads, head_dim, _ = _attention_geometry(cfg)
    return ModelFlops(int(round(layer_params)), lm_head, attention_layers, heads, head_dim)


# ---- the peak ------------------------------------------------------------------
def gemm_shapes(model_path: str, m: int = GEMM_M) -> list[tuple[int, int, int]]:
    """(M, K, N) GEMMs shaped like the model's: qkv/o-sized, gate_up-sized, down-sized."""
    cfg = _text_config(model_path)
    hidden = cfg["hidden_size"]
    inter = cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or 4 * hidden
    shapes = [(m, hidden, hidden), (m, hidden, 2 * inter), (m, inter, hidden)]
    return list(dict.fromkeys(shapes))


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_gemm_peak(dtype: str, device, shapes: list[tuple[int, int, int]], reps: int = 5,
                      min_rep_s: float = 0.02) -> dict:
    """Best torch.mm FLOP/s over `shapes` (A [M, K] @ W[N, K].T, as a Linear layer does):
    one warmup call per shape, then `reps` timed repetitions of enough calls to last
    about `min_rep_s`; the best repetition counts."""
    import torch
    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    best = {"gflops": 0.0, "shape": None}
    per_shape = []
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen).to(device=device, dtype=tdtype)
        w = torch.randn(n, k, generator=gen).to(device=device, dtype=tdtype)
        out = torch.empty(m, n, device=device, dtype=tdtype)
        with torch.inference_mode():
            _sync(device)
            start = time.perf_counter()
            torch.mm(a, w.t(), out=out)
            _sync(device)
            one = max(time.perf_counter() - start, 1e-6)
            calls = max(1, int(min_rep_s / one))
            rep_best = float("inf")
            for _ in range(reps):
                _sync(device)
                start = time.perf_counter()
                for _ in range(calls):
                    torch.mm(a, w.t(), out=out)
                _sync(device)
                rep_best = min(rep_best, (time.perf_counter() - start) / calls)
        gflops = 2 * m * k * n / rep_best / 1e9
        per_shape.append({"shape_mkn": [m, k, n], "gflops": gflops})
        if gflops > best["gflops"]:
            best = {"gflops": gflops, "shape": [m, k, n]}
    return {"dtype": dtype, "peak_gflops": best["gflops"], "peak_shape_mkn": best["shape"],
            "per_shape": per_shape, "reps": reps}


def measure_peaks(model_path: str, device, dtypes=PEAK_DTYPES, m: int = GEMM_M,
                  reps: int = 5) -> dict[str, dict]:
    import torch
    device = torch.device(device)
    shapes = gemm_shapes(model_path, m)
    return {dt: measure_gemm_peak(dt, device, shapes, reps=reps) for dt in dict.fromkeys(dtypes)}


# ---- the report ----------------------------------------------------------------
def roofline(flops: ModelFlops, peaks: dict[str, dict], runs: dict[str, tuple],
             gemm_dtype: str | None = None) -> dict:
    """The --output-json "roofline" block: the measured peaks and, per system
    (name -> (prompt lengths, output lengths, timed seconds) of what it ran), the
    model FLOPs of its workload, achieved GFLOP/s and the ratio to each peak.
    `gemm_dtype`: the dtype tokenmill's GEMMs run in on this machine."""
    systems = {}
    for name, (prompt_lens, output_lens, seconds) in runs.items():
        if not seconds:
            continue
        work = flops.workload(prompt_lens, output_lens)
        achieved = work["total"] / seconds / 1e9
        systems[name] = {"model_flops": work, "seconds": seconds, "achieved_gflops": achieved,
                         **{f"ratio_{dt}": achieved / p["peak_gflops"]
                            for dt, p in peaks.items() if p["peak_gflops"] > 0}}
    return {"model": asdict(flops), "peaks": peaks, "tokenmill_gemm_dtype": gemm_dtype,
            "systems": systems}


def format_roofline(block: dict) -> str:
    """A few lines: the peaks, then each system's achieved GFLOP/s and ratios."""
    peaks = block["peaks"]
    head = ", ".join(f"{dt} {p['peak_gflops']:.1f}" for dt, p in peaks.items())
    lines = [f"roofline: peak GEMM GFLOP/s (torch.mm, this run): {head}"
             + (f"; tokenmill GEMMs run in {block['tokenmill_gemm_dtype']}"
                if block.get("tokenmill_gemm_dtype") else "")]
    names = list(block["systems"])
    if not names:
        return lines[0]
    width = max(len(n) for n in names)
    cols = [f"vs {dt} peak" for dt in peaks]
    cw = [max(len(c), 8) for c in cols]
    lines.append(f"{'':<{width}}  {'GFLOP':>9}  {'GFLOP/s':>9}"
                 + "".join(f"  {c:>{w}}" for c, w in zip(cols, cw)))
    for name, s in block["systems"].items():
        ratios = "".join(f"  {100 * s.get(f'ratio_{dt}', 0.0):>{w - 1}.1f}%"
                         for dt, w in zip(peaks, cw))
        lines.append(f"{name:<{width}}  {s['model_flops']['total'] / 1e9:>9.1f}  "
                     f"{s['achieved_gflops']:>9.2f}{ratios}")
    return "\n".join(lines)


# ---- the memory-bandwidth bound of a decode step ----------------------------------
# A decode step of B rows reads every weight of the layers once (MoE: the experts its
# rows route to), the lm_head, and each row's K/V; at small B nothing else comes close,
# so its time is bounded below by those bytes over the device's memory bandwidth.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class DecodeBytes:
    dense_params: int        # layer weights every step reads (norms included; no experts)
    expert_params: int       # all routed-expert weights
    num_experts: int
    top_k: int
    lm_head_params: int
    kv_per_token: int        # K/V elements per cached token over all full-attention layers

    def step(self, batch: int, context_len: int, dtype_bytes: int) -> dict[str, float]:
        """Bytes a decode step of `batch` rows at `context_len` cached tokens each reads:
        the experts as the expected share a uniform router touches."""
        touched = 1.0
        if self.num_experts:
            touched = 1.0 - (1.0 - self.top_k / self.num_experts) ** batch
        weights = (self.dense_params + self.expert_params * touched + self.lm_head_params) \
            * dtype_bytes
        kv = self.kv_per_token * batch * context_len * dtype_bytes
        return {"weights": weights, "kv": kv, "total": weights + kv}


def count_decode_bytes(model_path: str) -> DecodeBytes:
    """From the checkpoint's safetensors headers and config.json (no weights read)."""
    cfg = _text_config(model_path)
    dense = experts = 0
    sizes = {"lm_head": 0, "embed": 0}
    for kind, name, _, numel in _weights(_checkpoint_shapes(model_path)):
        if kind in sizes:
            sizes[kind] = numel
        elif kind == "layer" and ".experts." in name:  # routed (shared ones are dense)
            experts += numel
        elif kind == "layer":
            dense += numel
    attention_layers, _, head_dim, kv_heads = _attention_geometry(cfg)
    return DecodeBytes(dense, experts, _num_experts(cfg), cfg.get("num_experts_per_tok") or 0,
                       sizes["lm_head"] or sizes["embed"],
                       2 * attention_layers * kv_heads * head_dim)


def measure_bandwidth(device, nbytes: int | None = None, reps: int = 5) -> dict:
    """Device memory bandwidth from the best of `reps` timed copies of `nbytes` (1 GiB on
    CUDA, 256 MiB elsewhere): (bytes read + bytes written) / seconds, in GB/s."""
    import torch
    device = torch.device(device)
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return {"bytes": 2 * src.numel() * 4, "gbps": 2 * src.numel() * 4 / best / 1e9,
            "reps": reps}


def decode_bound(counts: DecodeBytes, batch: int, context_len: int, dtype: str,
                 bandwidth_gbps: float, measured_s: float | None = None,
                 weight_bytes: int | None = None) -> dict:
    """The bound of one decode step and, with `measured_s`, the fraction of it reached;
    `weight_bytes`: the weights' bytes per step when not the checkpoint's parameters
    in `dtype` (quantized weights)."""
    step = counts.step(batch, context_len, DTYPE_BYTES[dtype])
    if weight_bytes is not None:
        step = {**step, "weights": weight_bytes, "total": weight_bytes + step["kv"]}
    bound = step["total"] / (bandwidth_gbps * 1e9)
    out = {"batch": batch, "context_len": context_len, "bytes": step, "bound_s": bound,
           "bandwidth_gbps": bandwidth_gbps}
    if measured_s:
        out.update(measured_s=measured_s, bound_fraction=bound / measured_s)
    return out
