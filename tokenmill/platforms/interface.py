"""What every platform decides: the interface the engine, the runner and the loaders read.

A platform is made once per engine, from the engine's arguments and the device
(`tokenmill.platforms.create_platform`), and passed down to whatever builds or runs
the model; nothing builds one of its own. Each field is one kernel decision, made
for the whole run; `prepare_model` hands them to the layers once, after the weights
are loaded. The fields every platform answers are here, each with what it means on
a platform that has no such kernel; a platform's own facts (the CPU's capability
level, CUDA's `enforce_eager`) are fields of that platform only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Platform:
    device: str                     # torch device string ("cpu", "cuda", "cuda:1", "meta")
    model_dtype: str                # the checkpoint's compute dtype (activations, KV cache)
    gemm_dtype: str                 # what the GEMMs compute in (wider where bf16 is emulated)
    # Attention kernels: "native" (the CPU kernels), "triton" (CUDA) or "torch" (the
    # PyTorch reference path, every device); `attention_backend` turns it into each KV
    # cache group's backend (tokenmill/attention/).
    attention: str = "torch"
    # Dense layers: the decode-sized inputs' kernel ("packed_bf16", "packed_f32" or
    # "torch"), how many rows take it, and the GEMM of the other inputs.
    linear: str = "torch"
    linear_bf16_max_rows: int = 0   # rows that take packed_bf16 (layers/linear.py ALL_ROWS: all)
    linear_f32_max_rows: int = 0    # rows that take packed_f32 (0: never)
    gemm: str = "torch"             # "onednn_prepacked" or "torch"
    weights: str = ""               # what the Linear layers keep in memory (for the log)
    norm: str = "torch"             # RMSNorm of half-precision activations: "native" / "torch"
    # The norms with no fused ATen op (Qwen3.5 / Qwen3-Next's zero-centred and gated ones:
    # `native_fp32_norm` on the module) in fp32 too: "native" / "torch"
    fp32_norm: str = "torch"
    activation: str = "torch"       # silu_mul / gelu_tanh_mul: "native" / "torch"
    lm_head: str = "full"           # "greedy_int8" (int8-screened argmax) or "full"
    greedy_head_max_rows: int = 0   # rows that take greedy_int8 (0: never)
    # Quantized layers (GPTQ / AWQ / int8, fp8 checkpoints and fp8 made at load): inputs
    # of up to this many rows take the native W8A16 / W4A16 kernel (e4m3 codes too),
    # larger ones dequantized tiles (0: never native).
    quantized_max_rows: int = 0
    # > 0: 4- / 8-bit weights in the quad layout (integer dot products on 15-bit
    # activations, platforms/cpu.py) for inputs of up to this many rows
    quantized_quad_max_rows: int = 0
    # Their GEMM where the platform has one: "triton" (ops/triton_quant_linear.py,
    # CUDA) or "torch" (native above, else dequantized tiles).
    quantized_gemm: str = "torch"
    decode_layers: bool = False     # a decode step's layers in one native call
    linear_attention: str = "torch"  # Gated DeltaNet kernels: "native" (CPU), "fla" or "torch"
    cuda_graphs: bool = False       # decode steps replayed from captured graphs
    # Ranks the model is sharded over: above 1 the native decode loop and the greedy
    # head are off (neither can all-reduce or gather inside its native call).
    tensor_parallel_size: int = 1
    # The native CPU kernels module the decisions above use, or None.
    ops: object = field(default=None, compare=False, repr=False)

    @property
    def widen_to(self):
        """The torch dtype the GEMM layers are widened to, or None (they keep the model's)."""
        import torch
        return None if self.gemm_dtype == self.model_dtype else getattr(torch, self.gemm_dtype)

    @property
    def fast_decode_rows(self) -> int | None:
        """Rows a decode step may have at about the cost of one (speculative decoding's
        row budget); None: no such limit."""
        return None

    def in_this_process(self) -> Platform:
        """The same decisions, usable in this process (a tensor-parallel worker gets the
        engine's platform pickled: a kernels module is loaded again there)."""
        return self

    def describe(self) -> str:
        """One line for the start-up log: what will run."""
        raise NotImplementedError

    def as_dict(self) -> dict:
        """Every decision and what it was made from (JSON-ready; no kernels module)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "ops"}
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
        out["platform"] = type(self).__name__
        out["description"] = self.describe()
        return out

    def attention_backend(self, spec):
        """The attention backend of the layers whose KV cache spec is `spec` (the runner
        asks once per KV cache group, at initialize_kv_cache, and binds each layer's
        implementation from it): the first backend of the platform's `attention` kernels
        that takes the spec (Triton: head sizes up to 512; the CPU kernels: paged K/V and
        MLA's latent rows), else the PyTorch reference of the spec's kind. The one place
        an attention implementation is chosen."""
        from tokenmill.attention import cpu_native, mla, torch_ref, triton
        preferred = {
            "native": (cpu_native.CpuNativeAttentionBackend(self.ops),
                       mla.CpuNativeMLABackend(self.ops)),
            "triton": (triton.TritonAttentionBackend(),),
            "torch": (),
        }[self.attention]
        for backend in preferred + (torch_ref.TorchAttentionBackend(), mla.TorchMLABackend()):
            if backend.supports(spec):
                return backend
        raise ValueError(f"no attention backend takes the KV cache spec {spec}")

    def prepare_model(self, model) -> None:
        """After the weights are loaded: hand the decisions to the layers (each GEMM
        layer's method, each layer's kernels module, the decode loop). Nothing is
        decided per forward call afterwards. (The attention layers get their
        implementation when the runner binds the KV caches: `attention_backend`.)"""
        self.prepare_gemm_layers(model)
        norm_ops = self.ops if self.norm == "native" else None
        fp32_norm_ops = self.ops if self.fp32_norm == "native" else None
        act_ops = self.ops if self.activation == "native" else None
        # The fused q/k norm + rotary goes with the native attention kernels (the native
        # decode loops make the same calls).
        rope_ops = self.ops if self.attention == "native" else None
        # Gated DeltaNet: the native kernel takes the ops module; fla loads its own.
        la_ops = self.ops if self.linear_attention == "native" else None
        for module in model.modules():
            if hasattr(module, "set_norm_kernels"):
                # (a norm whose PyTorch form is a chain of ops takes the kernel in fp32
                # too: the same math, fp32 sums in another order)
                module.set_norm_kernels(fp32_norm_ops if norm_ops is None and getattr(
                    module, "native_fp32_norm", False) else norm_ops)
            if hasattr(module, "set_activation_kernels"):
                module.set_activation_kernels(act_ops)
            if hasattr(module, "set_qk_norm_rope"):
                module.set_qk_norm_rope(rope_ops)
            if hasattr(module, "set_linear_attention"):
                module.set_linear_attention(self.linear_attention, la_ops)
        set_decode_layers = getattr(model, "set_decode_layers", None)
        if set_decode_layers is not None:
            # (the loop calls the native attention kernels itself)
            set_decode_layers(self.ops if self.decode_layers and self.attention == "native"
                              else None,
                              self.linear_f32_max_rows if self.linear == "packed_f32"
                              else self.linear_bf16_max_rows)

    # ---- the GEMM layers' methods (layers/linear_methods/) ----------------------------
    def prepare_gemm_layers(self, model) -> None:
        """Give every Linear and FusedMoE of `model` its method (`linear_method`,
        `moe_method`), which repacks the loaded weights once."""
        from tokenmill.models.layers.linear import Linear
        from tokenmill.models.layers.moe import FusedMoE
        # Parameters more than one module holds (a head tied to the embedding).
        seen: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
        widened = 0
        tied = {}  # id of a shared weight -> its Linear
        for module in model.modules():
            if isinstance(module, Linear):
                # (an integer-quantized layer has no `weight` until its method converts)
                w = getattr(module, "weight", None)
                if seen.get(id(w), 0) > 1:
                    tied[id(w)] = module
                method = self.linear_method(module, shared=seen.get(id(w), 0) > 1)
                dtype = w.dtype if w is not None else module.method.dtype
            elif isinstance(module, FusedMoE):
                method, dtype = self.moe_method(module), module.gate_up_proj.dtype
            else:
                continue
            if method is not module.method:
                widened += self.widen_to is not None and dtype != self.widen_to
                module.set_method(method)
        if widened:
            logger.info("%d GEMM layers compute in %s (activations and KV cache stay %s)",
                        widened, self.gemm_dtype, self.model_dtype)
        if tied:  # a tied embedding reads the head's packed copy: the matrix kept once
            from tokenmill.models.layers.linear_methods.cpu_packed import (
                tie_embeddings_to_packed_heads)
            tie_embeddings_to_packed_heads(model, tied)

    def linear_method(self, layer, shared: bool = False):
        """The method `layer` (a Linear, weights loaded) runs through: the one place the
        GEMM kernel of a dense layer is chosen, from this platform's decisions.

        - `linear` "packed_bf16" / "packed_f32": a layer of that dtype on the CPU takes
          the packed kernel for up to `linear_*_max_rows` rows (bf16 ALL_ROWS: every
          input, the packed copy the only one);
        - the other inputs: oneDNN's prepacked GEMM where `gemm` says so (weights in
          the model's dtype; `shared`: the weight is tied to another module and stays),
          else F.linear, widened to `gemm_dtype` where that differs.

        A layer whose method is not the plain unquantized one (a quantized format's,
        or one already chosen) keeps it; a quantized method gets the platform's kernels
        through its `for_platform` (the integer formats and fp8: the native CPU kernel
        up to `quantized_max_rows` rows, or the Triton GEMM, and the widened dtype)."""
        import torch

        from tokenmill.models.layers.linear_methods import (
            ALL_ROWS, OneDNNPrepackedLinearMethod, PackedBf16LinearMethod,
            PackedF32LinearMethod, UnquantizedLinearMethod)
        current = layer.method
        bind_kernels = getattr(current, "for_platform", None)
        if bind_kernels is not None:  # quantized formats (quantized_linear.py, fp8.py)
            on_cpu = self.device == "cpu" and self.quantized_max_rows > 0
            return bind_kernels(self.ops if on_cpu else None, self.widen_to,
                                self.quantized_max_rows if on_cpu else 0,
                                triton=self.quantized_gemm == "triton",
                                quad_max_rows=self.quantized_quad_max_rows if on_cpu else 0)
        if type(current) is not UnquantizedLinearMethod or current.compute_dtype is not None:
            return current
        w = layer.weight
        on_cpu = w.device.type == "cpu"
        widen = self.widen_to
        if self.gemm == "onednn_prepacked" and on_cpu and w.dtype == getattr(
                torch, self.model_dtype):
            rest = OneDNNPrepackedLinearMethod(keep_weight=shared)
        elif widen is not None and w.dtype != widen:
            rest = UnquantizedLinearMethod(compute_dtype=widen)
        else:
            rest = current
        if self.linear == "packed_bf16" and on_cpu and w.dtype == torch.bfloat16:
            rows = self.linear_bf16_max_rows
            return PackedBf16LinearMethod(self.ops, rows, None if rows >= ALL_ROWS else rest)
        if self.linear == "packed_f32" and on_cpu and w.dtype == torch.float32:
            return PackedF32LinearMethod(self.ops, self.linear_f32_max_rows, rest)
        return rest

    def moe_method(self, layer):
        """The method a FusedMoE's experts (weights loaded) run through: the packed bf16
        kernel for expert slices of up to `linear_bf16_max_rows` rows where `linear`
        is "packed_bf16", the grouped GEMMs (widened to `gemm_dtype` where that
        differs) for the rest. A non-default method is kept; quantized experts (integer
        formats, int8 at load, fp8) on the CPU get the native kernels (`for_platform`:
        packed per expert, up to `quantized_max_rows` rows, the quad layout where the
        platform asks for it); a quantized one that can compute in another dtype (fp8's
        dequantized experts) without them gets the widened one."""
        import torch

        from tokenmill.models.layers.linear_methods import (PackedBf16FusedMoEMethod,
                                                            UnquantizedFusedMoEMethod)
        current = layer.method
        bind_kernels = getattr(current, "for_platform", None)
        if getattr(current, "packed", None) is not None:
            return current  # bound and packed already (a second prepare_model)
        if (bind_kernels is not None and self.device == "cpu" and self.quantized_max_rows > 0
                and hasattr(self.ops, "linear_quant")):
            # quantized experts (integer formats, int8 at load, fp8): packed per expert
            # for the native kernel (quantized_cpu.PackedQuantizedExperts)
            return bind_kernels(self.ops, self.widen_to, self.quantized_max_rows,
                                quad_max_rows=self.quantized_quad_max_rows)
        widen_quantized = getattr(current, "with_compute_dtype", None)
        if (widen_quantized is not None and self.widen_to is not None
                and current.compute_dtype is None):
            return widen_quantized(self.widen_to)
        if type(current) is not UnquantizedFusedMoEMethod or current.compute_dtype is not None:
            return current
        w = layer.gate_up_proj
        widen = self.widen_to if self.widen_to is not None and w.dtype != self.widen_to else None
        if self.linear == "packed_bf16" and w.device.type == "cpu" and w.dtype == torch.bfloat16:
            return PackedBf16FusedMoEMethod(self.ops, self.linear_bf16_max_rows, widen)
        return current if widen is None else UnquantizedFusedMoEMethod(widen)


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
