"""The model runner's KV cache concern: the layers' KV cache specs, the caches and state
slots allocated from the engine's KVCacheConfig, each group's attention backend and
metadata builder bound (Platform.attention_backend), the KV connector's worker half
and the decode CUDA graphs captured. A mixin of `ModelRunner` (worker/model_runner.py),
whose constructor sets the attributes it reads."""
from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.core.kv_cache_spec import (FP8_KV_DTYPE, FullAttentionSpec, KVCacheConfig,
                                          KVCacheSpec, MambaSpec, MLAAttentionSpec,
                                          SlidingWindowSpec, kv_cache_dtype_name)
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.kv_cache import allocate_kv_caches, dtype_name
from tokenmill.worker.state_cache import StateSlots, allocate_state_caches, snapshot_base

logger = logging.getLogger(__name__)
FP8_DTYPE = torch.float8_e4m3fn


class KVCacheMixin:
    def attention_layers(self) -> dict[str, nn.Module]:
        layers = {f"layers.{i}.attn": layer
                  for i, layer in enumerate(self.model.attention_layers())}
        if self.draft_model is not None and hasattr(self.draft_model, "attention_layers"):
            # a drafter's layers (EAGLE-style, DFlash): extra layers of the same KV cache
            # group where their spec is the target's
            layers.update({f"draft.{i}.attn": layer
                           for i, layer in enumerate(self.draft_model.attention_layers())})
        return layers

    def state_layers(self) -> dict[str, nn.Module]:
        """Recurrent layers (Gated DeltaNet): each has state_shapes() and a `state` tuple."""
        layers = getattr(self.model, "state_layers", lambda: [])()
        return {f"layers.{i}.state": layer for i, layer in enumerate(layers)}

    def kv_sharing_targets(self) -> dict[str, str]:
        """Attention layers that read another layer's KV cache instead of keeping one
        (PagedAttention.kv_sharing_target; Gemma 4's KV-shared layers): layer name ->
        the name of the layer whose cache and KV group it uses."""
        layers = self.attention_layers()
        targets = {}
        for name, layer in layers.items():
            index = getattr(layer, "kv_sharing_target", None)
            if index is None:
                continue
            target = f"layers.{index}.attn"
            if (name.startswith("draft.") or target not in layers
                    or getattr(layers[target], "kv_sharing_target", None) is not None):
                raise ValueError(f"{name}: kv_sharing_target {index} is not a layer with a "
                                 "KV cache of its own")
            targets[name] = target
        return targets

    def _layer_spec(self, layer: nn.Module, block_size: int) -> KVCacheSpec:
        # K/V in the model's dtype, or float8_e4m3fn (--kv-cache-dtype fp8); recurrent
        # state (MambaSpec) keeps the model's dtype either way.
        kv_dtype = kv_cache_dtype_name(getattr(self, "kv_cache_dtype", "auto"),
                                       dtype_name(self.dtype))
        if getattr(layer, "latent_cache", False):  # MLA: one latent row per token
            if kv_dtype == FP8_KV_DTYPE:
                raise ValueError("kv_cache_dtype fp8 does not support MLA's latent cache "
                                 "(DeepSeek-V2 / V3 models): use kv_cache_dtype auto")
            return MLAAttentionSpec(block_size, layer.kv_lora_rank, layer.rope_dim, kv_dtype)
        window = getattr(layer, "sliding_window", None)
        if window is not None and getattr(layer, "cache_all_positions", False):
            window = None  # (a DFlash sliding layer: its block reads through the window)
        if window is not None and window < self.max_model_len:
            return SlidingWindowSpec(block_size, layer.num_kv_heads, layer.head_size,
                                     kv_dtype, window)
        # (a window no sequence outgrows is full attention)
        return FullAttentionSpec(block_size, layer.num_kv_heads, layer.head_size, kv_dtype)

    def get_kv_cache_spec(self, block_size: int) -> dict[str, KVCacheSpec]:
        """One spec per layer that keeps a cache: a KV-sharing layer has none (it reads
        its target's, whose spec it must equal)."""
        specs: dict[str, KVCacheSpec] = {}
        layers = self.attention_layers()
        sharing = self.kv_sharing_targets()
        for name, layer in layers.items():
            if name not in sharing:
                specs[name] = self._layer_spec(layer, block_size)
        for name, target in sharing.items():
            if self._layer_spec(layers[name], block_size) != specs[target]:
                raise ValueError(f"{name} shares the KV cache of {target}, whose layout "
                                 "(heads, head size, window) differs")
        for name, layer in self.state_layers().items():
            shapes = layer.state_shapes()
            specs[name] = MambaSpec(tuple(tuple(s) for s in shapes),
                                    tuple(dtype_name(d) for d in
                                          layer.state_dtypes(self.dtype)))
        return specs

    def initialize_kv_cache(self, config: KVCacheConfig, kv_connector=None) -> None:
        """Allocate the KV caches of `config` and bind the layers to them; with
        `kv_connector` (the external KV tier's KVConnector), its worker half moves
        payloads between the stores and these caches."""
        self.kv_cache_config = config
        self.attn_group_id = config.attention_group_id
        self.state_group_id = config.state_group_id
        self.kv_caches = allocate_kv_caches(config, self.device)
        if kv_connector is not None:
            from tokenmill.kv_connector.worker import KVConnectorWorker
            self.kv_connector = KVConnectorWorker(
                kv_connector, self.kv_caches, config.groups[config.attention_group_id].layer_names)
        layers = self.attention_layers()
        for name, cache in self.kv_caches.items():
            if name in layers:  # a draft model's layers are bound by its own runner
                layers[name].kv_cache = cache
        # Several attention groups: each layer reads its group's metadata.
        self.attn_group_ids = config.attention_group_ids
        # An EAGLE-style drafter's layers: in the target's group, or their own (beside
        # a sliding-window target) whose block table its K/V steps use.
        # A drafter of several layers whose spec is not the target's may span groups
        # (groups are cut to the smallest's size): all of them, in order.
        self.draft_group_ids = [gid for gid in self.attn_group_ids
                                if any(n.startswith("draft.")
                                       for n in config.groups[gid].layer_names)]
        self.draft_group_id = (self.draft_group_ids[0] if self.draft_group_ids
                               else self.attn_group_id)
        multi = len(self.attn_group_ids) > 1
        group_of = {}
        self.attn_backends, self.attn_builders = {}, {}
        for gid in self.attn_group_ids:
            group = config.groups[gid]
            backend = self.platform.attention_backend(group.spec)
            self.attn_backends[gid] = backend
            self.attn_builders[gid] = backend.make_builder(self.device)
            logger.debug("KV cache group %d (%s): attention backend %s", gid,
                         type(group.spec).__name__, backend.name)
            for name in group.layer_names:
                group_of[name] = gid
                if name in layers:
                    layers[name].kv_group = gid if multi else None
                    layers[name].impl = backend.make_impl(layers[name])
        # KV-sharing layers read their target's cache through its group's tables.
        for name, target in self.kv_sharing_targets().items():
            layers[name].kv_cache = layers[target].kv_cache
            layers[name].kv_group = layers[target].kv_group
            layers[name].impl = self.attn_backends[group_of[target]].make_impl(layers[name])
        _drop_unused_kv_scales(layers)
        graphs = self._cuda_graphs_apply()
        # Decode graphs of a hybrid model: one scratch state slot for their pad rows.
        self.state_caches = allocate_state_caches(config, self.device, int(graphs))
        self.snapshot_base = snapshot_base(config, int(graphs))
        if self.kv_connector is not None and self.state_caches:
            # Hybrids: the tier carries state snapshots, read into / out of their slots.
            self.kv_connector.bind_state(self.state_caches,
                                         config.groups[config.state_group_id].layer_names,
                                         self.snapshot_base)
        state_layers = self.state_layers()
        for name, tensors in self.state_caches.items():
            state_layers[name].state = tensors
        width = 1 + (self.drafter.k if self.drafter is not None else 0)
        self.state_slots = (StateSlots(config.num_state_slots, width) if self.state_caches
                            else None)
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len,
                                      [g.spec.block_size if g.is_attention else 1
                                       for g in config.groups], self.device,
                                      self.model.config.vocab_size)
        if graphs:
            from tokenmill.worker.cuda_graph import DecodeGraphRunner
            self.cuda_graphs = DecodeGraphRunner.build(self)

    def _cuda_graphs_apply(self) -> bool:
        """Decode (and draft-verifying) steps replay CUDA graphs where the platform says
        so (CUDA, Triton attention, not enforce_eager), for models whose decode step is
        all in the graph: every attention group on a backend whose decode steps replay
        (Triton: the PyTorch decode path sizes its mask per step). Recurrent layers are
        in the graph: their pad rows use a scratch state slot. A drafter reads the
        step's hidden states and taps within the step (sample_tokens), before the next
        replay rewrites them."""
        return (self.platform.cuda_graphs and self.device.type == "cuda"
                and bool(self.attn_backends)
                and all(b.cuda_graphs for b in self.attn_backends.values()))


def _drop_unused_kv_scales(layers: dict[str, nn.Module]) -> None:
    """A checkpoint's KV cache scales apply to an fp8 cache only (as in vLLM): the
    implementations of layers with any other cache run unscaled; said once."""
    ignored = 0
    for layer in layers.values():
        impl, cache = getattr(layer, "impl", None), getattr(layer, "kv_cache", None)
        if impl is None or not hasattr(impl, "k_scale") or cache is None:
            continue
        if cache.dtype != FP8_DTYPE and (impl.k_scale, impl.v_scale) != (1.0, 1.0):
            impl.k_scale = impl.v_scale = 1.0
            ignored += 1
    if ignored:
        logger.info("the checkpoint's KV cache scales (%d layers) are not used: the KV cache "
                    "is not fp8 (they apply to --kv-cache-dtype fp8)", ignored)
