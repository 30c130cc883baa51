"""The bandwidth bound of a single-stream decode token, for `tokenmill bench latency`.

At one stream a decode token is bound by the bytes it reads: every weight of the
decoder layers once, the lm_head (or its int8 screen), and the request's K/V. This
module counts those bytes for the engine as it runs (the weights in the form its
kernels read them: packed bf16 or fp32, quantized codes with their scales, the greedy
head's int8 screen), measures the machine's streaming read bandwidth in the same
process, and gives `bandwidth_fraction` = (bytes / bandwidth) / the measured time per
output token: 1.0 would be a token that does nothing but stream its bytes once.

The counts start from the checkpoint's architecture (roofline.count_decode_bytes:
layer parameters, MoE experts as the share a uniform router touches at batch 1,
K/V elements per cached token) and take the bytes per parameter of the layers'
linears from the loaded model, so a quantized model counts its codes and scales.
Norms, rotary tables and the one embedding row are left out (well under 1%).
"""
from __future__ import annotations

import time

import torch
from torch import nn

READ_PROBE_BYTES = 256 << 20  # > any CPU's last-level cache by a wide margin


def linear_read_bytes(layer: nn.Module) -> int:
    """Bytes a one-row forward of this linear layer reads: the packed copy where its
    method keeps one (a packed layer may also keep a fallback copy that one row never
    touches), else every tensor it holds (quantized codes, scales, zero points)."""
    from tokenmill.models.quantize_at_load import resident_weight_bytes
    packed = getattr(getattr(layer, "method", None), "packed_weight", None)
    bias = getattr(layer, "bias", None)
    bias_bytes = bias.nbytes if isinstance(bias, torch.Tensor) else 0
    if isinstance(packed, torch.Tensor) and packed.layout == torch.strided:
        return packed.nbytes + bias_bytes
    return resident_weight_bytes(layer)


def _is_linear(module: nn.Module) -> bool:
    return (hasattr(module, "method") and hasattr(module, "in_features")
            and hasattr(module, "out_features"))


def layer_bytes_per_param(model: nn.Module) -> float | None:
    """Bytes read per weight element over the decoder layers' linears (the lm_head,
    the embedding and MoE experts held outside `Linear`s not included)."""
    lm_head = getattr(model, "lm_head", None)
    read = params = 0
    for module in model.modules():
        if module is lm_head or not _is_linear(module):
            continue
        read += linear_read_bytes(module)
        params += module.in_features * module.out_features
    return read / params if params else None


def lm_head_read_bytes(model: nn.Module, greedy_head) -> int | None:
    """What a greedy one-row step reads of the lm_head: the int8 screen where the
    runner has one (its exact recompute touches a few 32-column blocks: left out),
    else the lm_head's own kernel weights."""
    if greedy_head is not None:
        return sum(t.nbytes for t in (greedy_head.q, greedy_head.scale, greedy_head.coef,
                                      greedy_head.l1))
    lm_head = getattr(model, "lm_head", None)
    return None if lm_head is None or not _is_linear(lm_head) else linear_read_bytes(lm_head)


def count_engine_read(runner, checkpoint: str) -> dict | None:
    """Per-token read counts of the engine's model (None where the model runs in
    another process). -> {"layer_weight_bytes", "lm_head_bytes", "kv_bytes_per_position",
    "bytes_per_param"}; `checkpoint`: the unquantized architecture (its config and
    tensor shapes)."""
    from tokenmill.bench.roofline import count_decode_bytes
    model = getattr(runner, "model", None)
    if model is None:
        return None
    counts = count_decode_bytes(checkpoint)
    per_param = layer_bytes_per_param(model)
    if per_param is None:
        return None
    touched = counts.top_k / counts.num_experts if counts.num_experts else 0.0
    head = lm_head_read_bytes(model, getattr(runner, "greedy_head", None))
    if head is None:
        head = counts.lm_head_params * per_param
    caches = [t for t in getattr(runner, "kv_caches", {}).values()
              if isinstance(t, torch.Tensor)]
    kv_elem = caches[0].element_size() if caches else 2
    return {"layer_weight_bytes": (counts.dense_params + counts.expert_params * touched)
            * per_param,
            "lm_head_bytes": head,
            "kv_bytes_per_position": counts.kv_per_token * kv_elem,
            "bytes_per_param": per_param}


def token_read_bytes(counts: dict, context_len: float) -> float:
    """Bytes one decode token reads at `context_len` cached positions."""
    return (counts["layer_weight_bytes"] + counts["lm_head_bytes"]
            + counts["kv_bytes_per_position"] * context_len)


def _best_seconds(fn, reps: int) -> float:
    fn()  # first touch / warm-up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _torch_read_gbps(nbytes: int, reps: int) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best_seconds(lambda: x.amax(), reps) / 1e9


def _platform_linear_gbps(platform, nbytes: int, reps: int) -> tuple[str, float]:
    """One row through a Linear of about `nbytes` weights in the platform's model dtype,
    with the method the platform gives it (its decode path: the packed kernel where it
    packs): (the method's name, bytes that row reads / second)."""
    from tokenmill.models.layers.linear import Linear
    dtype = getattr(torch, platform.model_dtype)
    k = 4096
    n = nbytes // (dtype.itemsize * k) // 32 * 32
    layer = Linear(k, n, bias=False, dtype=dtype)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    layer.set_method(platform.linear_method(layer))
    row = torch.ones(1, k, dtype=dtype)
    read = linear_read_bytes(layer)
    with torch.inference_mode():
        seconds = _best_seconds(lambda: layer(row), reps)
    return type(layer.method).__name__, read / seconds / 1e9


def measure_read_bandwidth(platform=None, nbytes: int = READ_PROBE_BYTES,
                           reps: int = 7) -> dict:
    """The machine's streaming read bandwidth (CPU), GB/s: the best of a few read-only
    probes over `nbytes` (far beyond the caches), each the best of `reps` runs:
    torch's max over fp32 and, with the engine's CPU `platform`, a one-row linear
    through the method it picks (the decode kernel's own access pattern). Taking the
    best probe makes the bound the strictest one this run can show."""
    probes = {"torch amax fp32": _torch_read_gbps(nbytes, reps)}
    if platform is not None and platform.device == "cpu":
        name, gbps = _platform_linear_gbps(platform, nbytes, reps)
        probes[f"one-row {name}"] = gbps
    return {"gbps": max(probes.values()), "probes": probes, "bytes": nbytes, "reps": reps}


def bandwidth_fraction(counts: dict, input_len: int, output_len: int, tpot_s: float,
                       bandwidth_gbps: float) -> dict:
    """The single-stream decode bound of this workload and the fraction reached: the
    decode tokens see on average input_len + (output_len - 1) / 2 cached positions."""
    context = input_len + (output_len - 1) / 2
    nbytes = token_read_bytes(counts, context)
    bound = nbytes / (bandwidth_gbps * 1e9)
    return {"bytes_per_token": nbytes, "mean_context": context, "bound_s": bound,
            "tpot_s": tpot_s, "bandwidth_gbps": bandwidth_gbps,
            "bandwidth_fraction": bound / tpot_s if tpot_s > 0 else None}


def format_bandwidth(block: dict) -> str:
    c, bw = block["counts"], block["bandwidth"]
    probes = ", ".join(f"{k} {v:.1f}" for k, v in bw["probes"].items())
    frac = block["bandwidth_fraction"]
    return (f"decode bandwidth: {block['bytes_per_token'] / 1e6:.1f} MB a token "
            f"(layers {c['layer_weight_bytes'] / 1e6:.1f} at {c['bytes_per_param']:.3f} B a "
            f"weight, lm_head {c['lm_head_bytes'] / 1e6:.1f}, K/V "
            f"{c['kv_bytes_per_position'] * block['mean_context'] / 1e6:.2f}); streaming "
            f"reads {bw['gbps']:.1f} GB/s (best of: {probes}); bound "
            f"{1e3 * block['bound_s']:.3f} ms vs TPOT {1e3 * block['tpot_s']:.3f} ms = "
            + ("n/a" if frac is None else f"{100 * frac:.1f}% of the bandwidth bound"))
