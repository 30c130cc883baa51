"""The model runner: persistent batch -> flat step inputs -> forward -> sample.

One step is split in two, as in vLLM's GPU model runner: `execute_model`
updates the batch from the SchedulerOutput, reorders it decode-first, builds
the flat inputs and attention metadata, runs the forward and gathers the
logits of the rows that sample; `sample_tokens` samples on the device, writes
the ids back into the batch and returns the ModelRunnerOutput.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenmill import faults
from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.builder import AttentionMetadataBuilder
from tokenmill.attention.metadata import AttentionMetadata, StateMetadata
from tokenmill.core.kv_cache_spec import (FullAttentionSpec, KVCacheConfig, KVCacheSpec,
                                          MambaSpec, MLAAttentionSpec, SlidingWindowSpec)
from tokenmill.core.sched_output import (GrammarOutput, LogprobsLists, ModelRunnerOutput,
                                         SchedulerOutput)
from tokenmill.errors import RequestFault
from tokenmill.platforms import Platform
from tokenmill.models.layers.greedy_head import GreedyHead
from tokenmill.sample.bitmask import apply_grammar_bitmask
from tokenmill.sample.sampler import Sampler, apply_processors, gather_logprobs
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.drafter import Drafter
from tokenmill.spec_decode.dflash_proposer import DFlashProposer
from tokenmill.spec_decode.eagle import EagleProposer
from tokenmill.spec_decode.rejection_sampler import RejectionSampler
from tokenmill.spec_decode.verify import verify_greedy
from tokenmill.worker.input_batch import CachedRequestState, InputBatch
from tokenmill.worker.kv_cache import allocate_kv_caches, dtype_name
from tokenmill.worker.state_cache import StateSlots, allocate_state_caches

logger = logging.getLogger(__name__)

# Rows scheduling at most this many tokens count as decodes in the reorder.
DECODE_THRESHOLD = 1


@dataclass
class StepInputs:
    """The flat inputs of the last step, kept for inspection and tests."""

    input_ids: np.ndarray
    positions: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    discard_mask: np.ndarray  # rows still consuming their prompt: they sample nothing
    block_table: np.ndarray  # group 0, rows [0, num_reqs)
    # Speculative decoding: logits rows of request i are cu_num_logits[i]..[i+1]-1
    # (its drafts' positions, then one more); num_drafts[i] = that count - 1.
    cu_num_logits: np.ndarray | None = None
    num_drafts: np.ndarray | None = None


def reorder_decodes_first(batch: InputBatch, num_scheduled: dict[str, int],
                          decode_threshold: int = DECODE_THRESHOLD,
                          spec_tokens: dict[str, list[int]] | None = None) -> bool:
    """Order rows decode -> short extend -> long extend -> prefill, with few swaps.

    A row verifying drafts (`spec_tokens`) is a decode: its tokens beyond the one
    decode token are its drafts. Only rows that sit in the wrong region move; each
    follows its swap chain. Returns whether anything moved.
    """
    n = batch.num_reqs()
    if n <= 1:
        return False
    spec = spec_tokens or {}
    sched = np.array([num_scheduled[batch.req_ids[i]] - len(spec.get(batch.req_ids[i], ()))
                      for i in range(n)])
    computed = batch.num_computed_tokens_cpu[:n]
    prompt = batch.num_prompt_tokens[:n]
    region = np.where(computed == 0, 3,
                      np.where(sched > decode_threshold, 2,
                               np.where(computed < prompt, 1, 0)))
    target = np.sort(region, kind="stable")
    wrong = np.nonzero(region != target)[0]
    if wrong.size == 0:
        return False
    sources = wrong[np.argsort(region[wrong], kind="stable")]
    dest = {int(s): int(d) for s, d in zip(sources, wrong)}
    for src in sources.tolist():
        dst = dest[src]
        while src != dst:
            batch.swap_states(src, dst)
            nxt = dest.get(dst, dst)
            dest[dst] = dst
            dst = nxt
    return True


class ModelRunner:
    def __init__(self, model: nn.Module, *, dtype: torch.dtype, device: torch.device,
                 max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 platform: Platform,
                 speculative_config: SpeculativeConfig | None = None, draft_model=None):
        """`platform`: the engine's kernel decisions (tokenmill/platforms; the model was
        prepared with it at load).
        `speculative_config`: propose drafts after each step and verify them in the
        next (tokenmill/spec_decode); None: no speculation. `draft_model`: the draft
        model of an eagle3 / mtp config (an EagleStyleDrafter) or of a dflash one."""
        self.model = model
        self.platform = platform
        self.dtype = dtype
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.input_batch: InputBatch | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.kv_cache_config: KVCacheConfig | None = None
        self.state_caches: dict[str, tuple[torch.Tensor, ...]] = {}
        self.state_slots: StateSlots | None = None
        self.attn_group_id = 0
        self.attn_group_ids: list[int] = [0]
        self.draft_group_id = 0
        self.state_group_id: int | None = None
        self.last_step: StepInputs | None = None
        # Hybrid models under speculation: per verifying request, the slot holding its
        # state after each of its step's tokens (StateSlots.write_slots).
        self._spec_write_slots: dict[str, list[int]] = {}
        self.last_attn_meta: AttentionMetadata | None = None
        # (logits, discard_mask, sampled ids or None) between execute_model and sample_tokens
        self._pending = None
        self._pending_nonfinite_hidden: torch.Tensor | None = None  # greedy-head steps
        self._grammar: GrammarOutput | None = None  # sample_tokens()' argument, while it runs
        self._prompt_logprobs_ready: dict[str, LogprobsLists] = {}
        self._prompt_logprobs_reqs: set[str] = set()  # asked and not yet sent
        self._arange = np.arange(max(max_num_batched_tokens, max_model_len), dtype=np.int64)
        # Speculative decoding: the drafter and the verifier of its drafts.
        self.draft_model = draft_model
        proposer = None
        if draft_model is not None and speculative_config.method == "dflash":
            proposer = DFlashProposer(draft_model, device, max_model_len)
            # DFlash names the layers whose output it reads: the input of the next one
            # (the last layer's output is the final normed hidden state, as in HF).
            model.aux_layer_ids = tuple(i + 1 for i in draft_model.target_layer_ids)
        elif draft_model is not None:
            proposer = EagleProposer(draft_model, device, max_model_len)
            if draft_model.aux_layer_ids:
                model.aux_layer_ids = tuple(draft_model.aux_layer_ids)
        self.drafter = (Drafter(speculative_config, proposer,
                                row_budget=self.platform.fast_decode_rows)
                        if speculative_config is not None else None)
        self._step_hidden = None  # the target's hidden states and metadata, for the drafter
        self._step_meta = None
        self.rejection_sampler = RejectionSampler()
        # Per attention KV cache group: the backend the platform chose for its spec and
        # the builder of its metadata, through which every attention metadata of a step
        # (the target's and the drafters') is built. Set in initialize_kv_cache.
        self.attn_backends: dict[int, AttentionBackend] = {}
        self.attn_builders: dict[int, AttentionMetadataBuilder] = {}
        # CUDA graphs of pure-decode steps (worker/cuda_graph.py), captured at
        # initialize_kv_cache where the platform says so; None: every step eager.
        self.cuda_graphs = None
        # The worker half of the KV connector (initialize_kv_cache), or None.
        self.kv_connector = None
        # This step's external loads that did not land (ModelRunnerOutput.invalid_block_ids).
        self._kv_invalid_block_ids: set[int] = set()
        # All-greedy steps of up to greedy_head_max_rows sampling rows take their tokens
        # from the int8-screened lm_head (layers/greedy_head.py), where the platform says
        # so, for models whose logits are exactly lm_head(hidden) (`plain_lm_head`).
        self.greedy_head = None
        self.greedy_head_max_rows = 0
        # Multimodal models: each encoded image's output rows keyed on its hash (the
        # scheduler's EncoderCacheManager says which to drop), how many images the
        # encoder ran over, and whether positions are M-RoPE's three per token.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_encoded_images = 0
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.has_encoder = hasattr(model, "encode_images")
        if self.platform.lm_head == "greedy_int8" and getattr(model, "plain_lm_head", False):
            self.greedy_head = GreedyHead.build(model.lm_head, self.platform.ops)
            if self.greedy_head is not None:
                self.greedy_head_max_rows = self.platform.greedy_head_max_rows

    def _arange_upto(self, n: int) -> np.ndarray:
        if n > self._arange.size:
            self._arange = np.arange(n, dtype=np.int64)
        return self._arange[:n]

    # ---- KV cache ----------------------------------------------------------------
    def attention_layers(self) -> dict[str, nn.Module]:
        layers = {f"layers.{i}.attn": layer
                  for i, layer in enumerate(self.model.attention_layers())}
        if self.draft_model is not None and hasattr(self.draft_model, "attention_layers"):
            # an EAGLE-style drafter's layers: extra layers of the same KV cache group
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
        if getattr(layer, "latent_cache", False):  # MLA: one latent row per token
            return MLAAttentionSpec(block_size, layer.kv_lora_rank, layer.rope_dim,
                                    dtype_name(self.dtype))
        window = getattr(layer, "sliding_window", None)
        if window is not None and window < self.max_model_len:
            return SlidingWindowSpec(block_size, layer.num_kv_heads, layer.head_size,
                                     dtype_name(self.dtype), window)
        # (a window no sequence outgrows is full attention)
        return FullAttentionSpec(block_size, layer.num_kv_heads, layer.head_size,
                                 dtype_name(self.dtype))

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
        self.draft_group_id = next(
            (gid for gid in self.attn_group_ids
             if any(n.startswith("draft.") for n in config.groups[gid].layer_names)),
            self.attn_group_id)
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
        graphs = self._cuda_graphs_apply()
        # Decode graphs of a hybrid model: one scratch state slot for their pad rows.
        self.state_caches = allocate_state_caches(config, self.device, int(graphs))
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
        """Decode steps replay CUDA graphs where the platform says so (CUDA, Triton
        attention, not enforce_eager), for models whose decode step is all in the graph:
        no drafter (its proposals read the step's hidden states after the next replay),
        every attention group on a backend whose decode steps replay (Triton: the
        PyTorch decode path sizes its mask per step). Recurrent layers are in the graph:
        their pad rows use a scratch state slot."""
        return (self.platform.cuda_graphs and self.device.type == "cuda"
                and self.drafter is None and bool(self.attn_backends)
                and all(b.cuda_graphs for b in self.attn_backends.values()))

    # ---- step, part 1 ------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for h in so.free_encoder_hashes:
            self.encoder_cache.pop(h, None)
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._prompt_logprobs_reqs.discard(rid)
            batch.remove_request(rid)
            if self.drafter is not None:
                self.drafter.remove(rid)
            if self.state_slots is not None:
                self.state_slots.release(rid)
        if self.state_slots is not None:
            for rid in so.preempted_req_ids:  # resumed later from 0: a fresh state then
                self.state_slots.release(rid)
        # Preempted or simply not scheduled: out of the batch, state kept.
        for rid in list(batch.req_id_to_index):
            if rid not in so.num_scheduled_tokens:
                batch.remove_request(rid)
        for new in so.scheduled_new_reqs:
            if faults.ARMED and faults.fires("input", new.req_id, new.prompt_token_ids):
                raise faults.InjectedFault(f"input preparation of {new.req_id}")
            sp = new.sampling_params
            old = self.requests.get(new.req_id)
            if old is not None and old.generator is not None:
                # Sent again after a failed step (reset_batch): its seeded stream goes on.
                gen = old.generator
            elif sp.seed is not None and not sp.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed)
            else:
                gen = None
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), sp, gen,
                                       [list(b) for b in new.block_ids],
                                       new.num_computed_tokens, list(new.output_token_ids),
                                       mm_features=new.mm_features or None)
            if state.mm_features and self.uses_mrope:
                state.mrope_positions, state.mrope_delta = self.model.mrope_positions(
                    len(state.prompt_token_ids),
                    [(f.offset, f.length, tuple(f.image_grid_thw)) for f in state.mm_features])
            self.requests[new.req_id] = state
            batch.add_request(state)
            if sp.prompt_logprobs is not None:
                self._prompt_logprobs_reqs.add(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            resumed = cached.resumed_from_preemption[i]
            if resumed:
                state.block_ids = [list(b) for b in new_blocks]
            elif new_blocks is not None:
                for group_ids, ids in zip(state.block_ids, new_blocks):
                    group_ids.extend(ids)
            row = batch.req_id_to_index.get(rid)
            if row is None:
                batch.add_request(state)
                continue
            batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
            if resumed:
                for table, ids in zip(batch.block_tables, state.block_ids):
                    table.add_row(ids, row)
            elif new_blocks is not None:
                for table, ids in zip(batch.block_tables, new_blocks):
                    table.append_row(ids, row)
        batch.condense()

    def _prepare_inputs(self, so: SchedulerOutput):
        batch = self.input_batch
        n = batch.num_reqs()
        num_sched = np.array([so.num_scheduled_tokens[batch.req_ids[i]] for i in range(n)],
                             dtype=np.int64)
        spec = so.scheduled_spec_decode_tokens
        num_drafts = None
        if spec:
            # The drafts follow the row's real tokens; they are inputs like any other.
            num_drafts = np.zeros(n, dtype=np.int64)
            for rid, drafts in spec.items():
                r = batch.req_id_to_index[rid]
                num_drafts[r] = len(drafts)
                start = int(batch.num_tokens_no_spec[r])
                batch.token_ids_cpu[r, start:start + len(drafts)] = drafts
        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        query_start_loc[1:] = cu
        req_indices = np.repeat(np.arange(n), num_sched)
        # Offset of each token inside its request's chunk.
        offsets = self._arange_upto(total) - np.repeat(query_start_loc[:-1], num_sched)
        computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        positions = computed[req_indices] + offsets
        input_ids = batch.token_ids_cpu.reshape(-1)[req_indices * batch.max_model_len + positions]
        seq_lens = computed + num_sched
        discard = seq_lens < batch.num_tokens_no_spec[:n]
        cu_num_logits = None
        if num_drafts is None:
            logits_indices = cu - 1
        else:
            # A verifying row samples at its last token and at every draft.
            num_logits = num_drafts + 1
            cu_num_logits = np.zeros(n + 1, dtype=np.int64)
            cu_num_logits[1:] = np.cumsum(num_logits)
            logits_indices = (np.repeat(cu - num_logits, num_logits)
                              + self._arange_upto(int(cu_num_logits[-1]))
                              - np.repeat(cu_num_logits[:-1], num_logits))

        # Leading decode rows (one token, or one plus its drafts) share one batched
        # decode call: each of their tokens is a query row that sees the cache up to
        # itself (every token's K/V is written before attention runs).
        single = num_sched == 1 if num_drafts is None else num_sched - num_drafts == 1
        not_single = np.nonzero(~single)[0]
        nd = int(not_single[0]) if not_single.size else n
        groups = {gid: self.attn_builders[gid].step(
                      batch.block_tables[gid], self.kv_cache_config.groups[gid].sliding_window,
                      req_indices, positions, seq_lens, computed, num_sched, query_start_loc,
                      nd, n)
                  for gid in self.attn_group_ids}
        meta = groups[self.attn_group_id]
        if len(groups) > 1:
            meta.by_group = groups
        table = batch.block_tables[self.attn_group_id]
        bs = table.block_size
        slot_mapping = (table.block_table.reshape(-1)[
            req_indices * table.max_num_blocks_per_req + positions // bs].astype(np.int64) * bs
            + positions % bs)
        if self.state_slots is not None:
            meta.state = self._state_metadata(nd, query_start_loc, computed, num_drafts)
        self.last_step = StepInputs(
            input_ids=input_ids, positions=positions, query_start_loc=query_start_loc,
            seq_lens=seq_lens, slot_mapping=slot_mapping,
            logits_indices=logits_indices, discard_mask=discard,
            block_table=table.block_table[:n].copy(), cu_num_logits=cu_num_logits,
            num_drafts=num_drafts)
        self.last_attn_meta = meta
        return input_ids, positions, logits_indices, meta, discard

    def _state_metadata(self, num_decodes: int, query_start_loc: np.ndarray,
                        computed: np.ndarray, num_drafts: np.ndarray | None = None
                        ) -> StateMetadata:
        """Each row's state slot; a request seen for the first time gets a zeroed one.

        `num_decodes` rows lead the batch; with drafts (`num_drafts`) each of them has
        1 + drafts tokens, run as decode steps in order, each leaving its state in
        the next slot of the request's group (StateSlots.write_slots)."""
        batch = self.input_batch
        n = batch.num_reqs()
        slots = np.empty(n, dtype=np.int64)
        fresh = []
        for r in range(n):
            slot, new = self.state_slots.get_or_allocate(batch.req_ids[r])
            slots[r] = slot
            if new:
                fresh.append(slot)
            if computed[r] == 0 and not new:
                # Back from the start with a slot still held (not preempted): reset it.
                fresh.append(slot)
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.long, device=self.device)
            for tensors in self.state_caches.values():
                for t in tensors:
                    t.index_fill_(0, idx, 0)
        self._spec_write_slots = {}
        nd_tokens = int(query_start_loc[num_decodes])
        meta = StateMetadata(nd_tokens, torch.from_numpy(slots).to(self.device))
        if nd_tokens > num_decodes:
            meta.decode_steps = self._state_decode_steps(num_decodes, query_start_loc, slots)
        for r in range(num_decodes, n):
            meta.prefills.append((int(query_start_loc[r]), int(query_start_loc[r + 1]),
                                  int(slots[r])))
        return meta

    def _state_decode_steps(self, nd: int, query_start_loc: np.ndarray, slots: np.ndarray):
        """Step j reads each row's state after its token j - 1 and writes the state after
        token j; which one the request keeps is decided by its accepted drafts."""
        batch = self.input_batch
        counts = np.diff(query_start_loc[:nd + 1])
        write = {}
        for r in range(nd):
            rid = batch.req_ids[r]
            write[rid] = self.state_slots.write_slots(rid, int(counts[r]))
        self._spec_write_slots = write
        dev = self.device
        steps = []
        for j in range(int(counts.max())):
            rows = np.nonzero(counts > j)[0]
            ws = [write[batch.req_ids[r]] for r in rows.tolist()]
            read = [int(slots[r]) if j == 0 else w[j - 1] for r, w in zip(rows.tolist(), ws)]
            steps.append((torch.from_numpy(query_start_loc[rows] + j).to(dev),
                          torch.tensor(read, dtype=torch.long, device=dev),
                          torch.tensor([w[j] for w in ws], dtype=torch.long, device=dev)))
        return steps

    def reset_batch(self) -> None:
        """After a failed step: empty the persistent batch (its rows may be half-updated).
        The scheduler sends every live request again as new (Scheduler.
        requeue_all_for_retry); the per-request states stay only for their generators."""
        batch = self.input_batch
        for rid in list(batch.req_id_to_index):
            batch.remove_request(rid)
        batch.condense()
        if self.state_slots is not None:
            for rid in list(self.requests):
                self.state_slots.release(rid)
        self._pending = None
        self._prompt_logprobs_ready = {}
        self._grammar = None
        self._step_hidden = self._step_meta = None
        self._spec_write_slots = {}
        self._kv_invalid_block_ids = set()

    def apply_sampled_tokens(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """A rank that does not sample (tensor parallelism, tokenmill/executor): the
        tokens rank 0 sampled for the step this rank ran (the ModelRunnerOutput's rows),
        written into the batch as sample_tokens() writes its own: the next step's
        input ids read them."""
        self._pending = None
        self._prompt_logprobs_ready = {}
        counts = np.fromiter(map(len, sampled), dtype=np.int64, count=len(sampled))
        total = int(counts.sum())
        if not total:
            return
        batch = self.input_batch
        index = batch.req_id_to_index
        rows = np.fromiter((index[rid] for rid in req_ids), dtype=np.int64, count=len(req_ids))
        flat = np.fromiter((t for toks in sampled for t in toks), dtype=np.int64, count=total)
        each = np.repeat(rows, counts)
        j = self._arange_upto(total) - np.repeat(np.cumsum(counts) - counts, counts)
        batch.token_ids_cpu[each, batch.num_tokens_no_spec[each] + j] = flat
        batch.num_tokens_no_spec[rows] += counts.astype(batch.num_tokens_no_spec.dtype)
        for rid, toks in zip(req_ids, sampled):
            if toks:
                self.requests[rid].output_token_ids.extend(toks)

    def remove_requests(self, req_ids) -> None:
        """Drop finished requests when no further step will carry their ids."""
        for rid in req_ids:
            self.requests.pop(rid, None)
            self._prompt_logprobs_reqs.discard(rid)
            if self.drafter is not None:
                self.drafter.remove(rid)
            if self.state_slots is not None:
                self.state_slots.release(rid)
            self.input_batch.remove_request(rid)
        self.input_batch.condense()

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        """Forward for the scheduled tokens; logits wait for sample_tokens()."""
        kv_meta = so.kv_connector_metadata if self.kv_connector is not None else None
        self._kv_invalid_block_ids = set()
        if kv_meta is not None:  # external prefix hits: their reads start now
            self.kv_connector.start_load_kv(kv_meta)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            self._pending = None
            return None
        reorder_decodes_first(self.input_batch, so.num_scheduled_tokens,
                              spec_tokens=so.scheduled_spec_decode_tokens)
        input_ids, positions, logits_indices, meta, discard = self._prepare_inputs(so)
        dev = self.device
        kv_failed = set()
        if kv_meta is not None:  # ... and are in their blocks before any layer reads them
            invalid = self._kv_invalid_block_ids = self.kv_connector.wait_for_load()
            if invalid:  # a row over a block without its KV samples nothing this step
                batch, gid = self.input_batch, self.attn_group_id
                for r, rid in enumerate(batch.req_ids[:batch.num_reqs()]):
                    if not invalid.isdisjoint(self.requests[rid].block_ids[gid]):
                        discard[r] = True
                        kv_failed.add(rid)
        ids_t = torch.from_numpy(input_ids.astype(np.int64)).to(dev)
        if self.uses_mrope:
            positions = self._mrope_positions(positions)
        pos_t = torch.from_numpy(positions).to(dev)
        embeds = self._multimodal_embeds(so, ids_t) if self.has_encoder else None
        if (embeds is None and self.cuda_graphs is not None and not meta.prefills
                and self.last_step.cu_num_logits is None
                and self.cuda_graphs.can_run(len(input_ids))):
            hidden = self.cuda_graphs.run(ids_t, pos_t, meta)  # a pure-decode step
        else:
            hidden = self.model(ids_t, pos_t, meta,
                                **({"inputs_embeds": embeds} if embeds is not None else {}))
        if kv_meta is not None:  # prompt blocks this step completed, to the external stores
            self.kv_connector.save_kv(kv_meta, kv_failed)
        if self.draft_model is not None:
            self._step_hidden, self._step_meta = hidden, meta
        # Only the rows that sample reach lm_head.
        sample_hidden = hidden[torch.from_numpy(logits_indices).to(dev)]
        if self._greedy_head_applies(so, sample_hidden.shape[0]):
            # No logits to look at: a non-finite hidden row is what makes NaN logits.
            self._pending_nonfinite_hidden = ~torch.isfinite(sample_hidden).all(dim=1)
            self._pending = (None, discard, self.greedy_head(sample_hidden))
        else:
            self._pending = (self.model.compute_logits(sample_hidden), discard, None)
        self._compute_prompt_logprobs(hidden, so)
        return None

    # ---- multimodal ----------------------------------------------------------------
    def _mm_rows(self):
        """Rows of this step whose chunk is still in a prompt with images:
        (row, state, first token of the chunk, end of the chunk)."""
        batch, step = self.input_batch, self.last_step
        for r in range(batch.num_reqs()):
            state = self.requests[batch.req_ids[r]]
            if not state.mm_features:
                continue
            end = int(step.seq_lens[r])
            start = end - int(step.query_start_loc[r + 1] - step.query_start_loc[r])
            if start < len(state.prompt_token_ids):
                yield r, state, start, end

    def _mrope_positions(self, positions: np.ndarray) -> np.ndarray:
        """M-RoPE ids [3, T]: a prompt with images reads its precomputed ones, every other
        token its index + its request's delta (the same id on all three axes). A step
        without image prompts (decodes) gets [T]: one id per token, the plain rotary's
        cheaper gather, the same cos / sin."""
        batch, step = self.input_batch, self.last_step
        n = batch.num_reqs()
        num_sched = np.diff(step.query_start_loc)
        delta = np.fromiter((self.requests[rid].mrope_delta for rid in batch.req_ids[:n]),
                            dtype=np.int64, count=n)
        flat = positions + np.repeat(delta, num_sched)
        rows = list(self._mm_rows())
        if not rows:
            return flat
        out = np.repeat(flat[None], 3, axis=0)
        for r, state, start, end in rows:
            end = min(end, len(state.prompt_token_ids))
            q = int(step.query_start_loc[r])
            out[:, q:q + end - start] = state.mrope_positions[:, start:end]
        return out

    def _encode(self, features) -> None:
        """Run the encoder once over these images (all of them in one call) and cache
        each one's output rows by its hash."""
        todo, seen = [], set()
        for f in features:
            if f.hash not in self.encoder_cache and f.hash not in seen:
                seen.add(f.hash)
                todo.append(f)
        if not todo:
            return
        dev = self.device
        pixels = torch.from_numpy(np.concatenate([f.pixel_values for f in todo])).to(dev)
        outs = self.model.encode_images(pixels, [tuple(f.image_grid_thw) for f in todo])
        for f, out in zip(todo, outs):
            if out.shape[0] != f.length:
                raise ValueError(f"image {f.hash[:12]}: the encoder gave {out.shape[0]} rows "
                                 f"for {f.length} placeholder tokens")
            self.encoder_cache[f.hash] = out
        self.num_encoded_images += len(todo)

    def _multimodal_embeds(self, so: SchedulerOutput, input_ids: torch.Tensor):
        """The step's input embeddings with the image rows in place, or None (no row of
        this step reads an image)."""
        scheduled = [self.requests[rid].mm_features[i]
                     for rid, idx in so.scheduled_encoder_inputs.items() for i in idx]
        rows = list(self._mm_rows())
        needed = []  # (flat index of the chunk's first overlapping token, feature, lo, hi)
        for r, state, start, end in rows:
            q = int(self.last_step.query_start_loc[r])
            for f in state.mm_features:
                lo, hi = max(start, f.offset), min(end, f.offset + f.length)
                if lo < hi:
                    needed.append((q + lo - start, f, lo - f.offset, hi - f.offset))
        # (an entry missing though not scheduled, after a failed step: encoded now)
        self._encode(scheduled + [f for _, f, _, _ in needed])
        if not needed:
            return None
        dev = self.device
        index = torch.from_numpy(np.concatenate(
            [first + self._arange_upto(hi - lo) for first, _, lo, hi in needed])).to(dev)
        embeds = torch.cat([self.encoder_cache[f.hash][lo:hi] for _, f, lo, hi in needed])
        return self.model.embed_multimodal(input_ids, index, embeds)

    def _greedy_head_applies(self, so: SchedulerOutput, num_rows: int) -> bool:
        """Whether argmax of the raw logits is all this step samples, at a size where
        the screened lm_head pays and gives the packed kernel's logits (layers/linear_methods/)."""
        return (self.greedy_head is not None
                and num_rows <= self.greedy_head_max_rows
                and self.input_batch.all_plain_greedy())

    def _compute_prompt_logprobs(self, hidden: torch.Tensor, so: SchedulerOutput) -> None:
        """Logprobs of each prompt token given the tokens before it, for the requests
        that asked, over the prompt positions of this step's chunk."""
        self._prompt_logprobs_ready = {}
        if not self._prompt_logprobs_reqs:
            return
        batch = self.input_batch
        step = self.last_step
        for rid in list(self._prompt_logprobs_reqs):
            r = batch.req_id_to_index.get(rid)
            if r is None:  # not scheduled this step
                continue
            state = self.requests[rid]
            k = state.sampling_params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            start = int(step.seq_lens[r]) - so.num_scheduled_tokens[rid]
            end = int(step.seq_lens[r])
            if state.prompt_logprobs is None:
                state.prompt_logprobs = (np.zeros((num_prompt - 1, 1 + k), dtype=np.int64),
                                         np.zeros((num_prompt - 1, 1 + k), dtype=np.float32),
                                         np.zeros(num_prompt - 1, dtype=np.int64))
            # Position p predicts prompt token p + 1.
            lo, hi = start, min(end, num_prompt - 1)
            if hi > lo:
                flat = int(step.query_start_loc[r]) + self._arange_upto(hi - start)[lo - start:]
                logits = self.model.compute_logits(hidden[torch.from_numpy(flat).to(self.device)])
                targets = torch.tensor(state.prompt_token_ids[lo + 1:hi + 1], device=self.device)
                got = gather_logprobs(logits.float().log_softmax(dim=-1), k, targets)
                ids, lps, ranks = state.prompt_logprobs
                ids[lo:hi] = got.token_ids.cpu().numpy()
                lps[lo:hi] = got.logprobs.cpu().numpy()
                ranks[lo:hi] = got.ranks.cpu().numpy()
            if end >= num_prompt:
                self._prompt_logprobs_ready[rid] = LogprobsLists(*state.prompt_logprobs)
                state.prompt_logprobs, state.prompt_logprobs_sent = None, True
                self._prompt_logprobs_reqs.discard(rid)

    # ---- structured output -------------------------------------------------------
    def _grammar_bitmask_rows(self, cu_num_logits: np.ndarray | None = None):
        """The step's compact grammar bitmask (the GrammarOutput sample_tokens() got) and,
        per row, its row in the batch (the reference's struct_out_req_batch_indices), on
        the device; None without one. With `cu_num_logits` (a step verifying drafts) a
        request's rows map onto its logits rows instead: one per verified position
        (StructuredOutputManager)."""
        grammar = self._grammar
        if grammar is None or not grammar.structured_output_request_ids:
            return None
        index = self.input_batch.req_id_to_index
        compact, dense = [], []
        for rid, row in grammar.structured_output_request_ids.items():
            r = index.get(rid)
            if r is None:
                continue
            if cu_num_logits is None:
                compact.append(row)
                dense.append(r)
            else:
                start, num = int(cu_num_logits[r]), int(cu_num_logits[r + 1] - cu_num_logits[r])
                compact += range(row, row + num)
                dense += range(start, start + num)
        if not dense:
            return None
        bitmask = grammar.grammar_bitmask
        if compact != list(range(bitmask.shape[0])):
            bitmask = bitmask[compact]
        dev = self.device
        return (torch.tensor(dense, dtype=torch.long, device=dev),
                torch.from_numpy(np.ascontiguousarray(bitmask)).to(dev))

    # ---- step, part 2 ------------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Sample the step execute_model() ran; `grammar`: its grammar bitmask, built by
        the engine once the tokens before it were accepted (None: no structured request)."""
        self._grammar = grammar
        try:
            return self._sample_tokens()
        finally:
            self._grammar = None

    def _sample_tokens(self) -> ModelRunnerOutput:
        batch = self.input_batch
        n = batch.num_reqs()
        req_ids = list(batch.req_ids[:n])
        req_id_to_index = {rid: i for i, rid in enumerate(req_ids)}
        if self._pending is None:
            return ModelRunnerOutput(req_ids, req_id_to_index, [[] for _ in range(n)])
        prompt_logprobs, self._prompt_logprobs_ready = self._prompt_logprobs_ready, {}
        logits, discard, sampled = self._pending
        self._pending = None
        if faults.ARMED:
            for rid in req_ids:
                if faults.fires("sampler", rid, self.requests[rid].prompt_token_ids):
                    raise RequestFault([rid], faults.InjectedFault(f"sampler of {rid}"))
        step = self.last_step
        if step.cu_num_logits is not None:
            tokens, num_emitted, logprobs, nan_rows, vocab = self._verify_drafts(
                logits, sampled, discard)
        else:
            tokens, logprobs, nan_rows, vocab = self._sample_one(logits, sampled, discard)
            num_emitted = np.ones(n, dtype=np.int64)
        errored = self._check_sampled(req_ids, discard, nan_rows, tokens, num_emitted, vocab)
        keep = ~discard
        if errored:
            keep &= ~np.isin(np.arange(n), [req_id_to_index[rid] for rid in errored])
        num_emitted = np.where(keep, num_emitted, 0)
        if step.cu_num_logits is not None and logprobs is not None:
            logprobs = self._emitted_logprobs(logprobs, tokens, num_emitted)
        # Write back into the batch, vectorised over the rows that keep their tokens.
        total = int(num_emitted.sum())
        rows = np.repeat(np.arange(n), num_emitted)
        j = self._arange_upto(total) - np.repeat(np.cumsum(num_emitted) - num_emitted,
                                                 num_emitted)
        flat = tokens[rows, j]
        batch.token_ids_cpu[rows, batch.num_tokens_no_spec[rows] + j] = flat
        batch.num_tokens_no_spec[:n] += num_emitted.astype(batch.num_tokens_no_spec.dtype)
        out = [[] for _ in range(n)]
        flat_list = flat.tolist()
        pos = 0
        for r in np.nonzero(num_emitted)[0].tolist():
            e = int(num_emitted[r])
            out[r] = flat_list[pos:pos + e]
            pos += e
            self.requests[req_ids[r]].output_token_ids.extend(out[r])
        spec_token_ids = None
        if self.drafter is not None:
            # Processors read the tokens before each position; verifying drafts would
            # need them per position: such requests go without drafts.
            eligible = keep & ~batch.needs_processors[:n]
            if self.drafter.model_proposer is not None:
                spec_token_ids = self.drafter.propose_with_model(
                    self, self._step_hidden, self._step_meta, req_ids, eligible)
                self._step_hidden = self._step_meta = None
            else:
                spec_token_ids = self.drafter.propose(req_ids, batch.token_ids_cpu,
                                                      batch.num_tokens_no_spec[:n], eligible)
        return ModelRunnerOutput(req_ids, req_id_to_index, out, logprobs, prompt_logprobs,
                                 errored, spec_token_ids, self._kv_invalid_block_ids)

    def _emitted_logprobs(self, pending, tokens: np.ndarray,
                          num_emitted: np.ndarray) -> LogprobsLists:
        """Logprobs of each row's emitted tokens (row r's token j was chosen at its logits
        row cu[r] + j); a row that emits nothing gets one row, as without speculation."""
        raw, k = pending
        cu = self.last_step.cu_num_logits
        counts = np.maximum(num_emitted, 1)
        total = int(counts.sum())
        req = np.repeat(np.arange(counts.size), counts)
        j = self._arange_upto(total) - np.repeat(np.cumsum(counts) - counts, counts)
        dev = self.device
        # (clipped: an errored row's garbage id must not index past the vocabulary)
        chosen = np.clip(tokens[req, j], 0, raw.shape[1] - 1)
        got = gather_logprobs(raw[torch.from_numpy(cu[:-1][req] + j).to(dev)], k,
                              torch.from_numpy(chosen).to(dev))
        return LogprobsLists(got.token_ids.cpu().numpy(), got.logprobs.cpu().numpy(),
                             got.ranks.cpu().numpy())

    def _sample_one(self, logits, sampled, discard):
        """One token per row: (tokens [n, 1], logprobs, NaN rows, vocabulary size)."""
        logprobs = None
        if sampled is not None:  # the greedy lm_head sampled already
            nan_rows = self._pending_nonfinite_hidden
            vocab = self.greedy_head.lm_head.out_features
            sampled_np = sampled.to("cpu", dtype=torch.int64).numpy()
        else:
            # A row whose logits hold NaN (an overflow in this request's activations)
            # samples garbage: that request is failed, never given token 0.
            # (amax propagates NaN: one vectorised pass, a tenth of isnan().any())
            nan_rows = torch.isnan(logits.amax(dim=1))
            vocab = logits.shape[1]
            md = self._sampling_metadata(discard)
            sampler_out = self.sampler(logits.float(), md)
            ids = sampler_out.sampled_token_ids.to(torch.int64)
            if ids.device.type != "cpu":  # one device -> host copy for the ids and flags
                both = torch.stack([ids.view(-1), nan_rows.to(torch.int64)]).cpu().numpy()
                ids, nan_rows = torch.from_numpy(both[0]), torch.from_numpy(both[1] != 0)
            sampled_np = ids.numpy()
            if sampler_out.logprobs is not None:
                lt = sampler_out.logprobs
                logprobs = LogprobsLists(lt.token_ids.cpu().numpy(), lt.logprobs.cpu().numpy(),
                                         lt.ranks.cpu().numpy())
        if nan_rows is not None:
            nan_rows = nan_rows.to("cpu").numpy()
        return sampled_np.reshape(-1, 1), logprobs, nan_rows, vocab

    def _sampling_metadata(self, discard: np.ndarray, cu_num_logits: np.ndarray | None = None):
        md = self.input_batch.make_sampling_metadata()
        md.grammar_bitmask = self._grammar_bitmask_rows(cu_num_logits)
        # A row still in its prompt samples nothing: its seeded generator must not advance.
        for r in np.nonzero(discard)[0].tolist():
            md.generators.pop(r, None)
        return md

    def _verify_drafts(self, logits, sampled, discard):
        """A step with drafts: verify each row's drafts against the target's rows.

        Returns (tokens [n, 1 + max drafts]: row r emits tokens[r, :num_emitted[r]],
        num_emitted [n], (raw logprobs [T, V], top-k width) or None, per-row NaN flags,
        vocabulary size). Rows without drafts (and rows still
        in their prompt) sample their one token as the plain sampler would."""
        batch = self.input_batch
        step = self.last_step
        n = batch.num_reqs()
        cu = step.cu_num_logits
        num_drafts = step.num_drafts
        num_logits = int(cu[-1])
        # The drafts sit in token_ids_cpu right after each row's real tokens.
        draft_req = np.repeat(np.arange(n), num_drafts)
        draft_pos = (self._arange_upto(draft_req.size)
                     - np.repeat(cu[:-1] - np.arange(n), num_drafts))
        drafts = batch.token_ids_cpu[draft_req, batch.num_tokens_no_spec[draft_req] + draft_pos]
        drafts = drafts.astype(np.int64)
        logprobs = None
        md = None
        if sampled is not None:  # the greedy lm_head: argmax of every verified row
            target = sampled.to("cpu", dtype=torch.int64).numpy()
            nan_t = self._pending_nonfinite_hidden.to("cpu").numpy()
            vocab = self.greedy_head.lm_head.out_features
        else:
            nan_t = torch.isnan(logits.amax(dim=1)).to("cpu").numpy()
            vocab = logits.shape[1]
            md = self._sampling_metadata(discard, cu)
            if md.all_greedy and md.no_processors and md.grammar_bitmask is None \
                    and md.max_num_logprobs is None:
                target = logits.argmax(dim=-1).to("cpu", dtype=torch.int64).numpy()
                md = None
        if md is None:
            accepted = verify_greedy(target, drafts, cu)
            num_emitted = accepted + 1
            width = int(num_emitted.max())
            idx = np.minimum(cu[:-1, None] + np.arange(width), num_logits - 1)
            tokens = target[idx]
        else:
            logits = logits.float()
            raw = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
            # The grammar masks every verified position (its rows follow the drafts);
            # the processors act on each request's last row: a request with drafts has
            # none (the runner gives such requests no drafts).
            if md.grammar_bitmask is not None:
                logits = apply_grammar_bitmask(logits, *md.grammar_bitmask)
            if not md.no_processors:
                last = torch.from_numpy(cu[1:] - 1).to(self.device)
                logits = logits.clone()
                logits[last] = apply_processors(logits[last], md)
            result = self.rejection_sampler(
                logits, torch.from_numpy(cu).to(self.device),
                torch.from_numpy(drafts).to(self.device), md)
            tokens = result.token_ids.to("cpu").numpy()
            num_emitted = result.num_emitted.to("cpu").numpy().astype(np.int64)
            accepted = num_emitted - 1
            if raw is not None:  # gathered once the emitted tokens are final
                logprobs = (raw, md.max_num_logprobs)
        self.drafter.observe(batch.req_ids[:n], num_drafts, accepted)
        if self.state_slots is not None:  # each verifying row goes on from its accepted state
            for r in np.nonzero(num_drafts)[0].tolist():
                rid = batch.req_ids[r]
                self.state_slots.accept(rid, self._spec_write_slots[rid][int(accepted[r])])
        nan_rows = np.logical_or.reduceat(nan_t, cu[:-1]) if nan_t.size else nan_t
        return tokens, num_emitted, logprobs, nan_rows, vocab

    def _check_sampled(self, req_ids, discard: np.ndarray, nan_rows: np.ndarray | None,
                       tokens: np.ndarray, num_emitted: np.ndarray,
                       vocab: int) -> dict[str, tuple[str, str]]:
        """The rows that must not emit their tokens: NaN logits, or an id outside the
        vocabulary (the reference's clamp-and-terminate). request id -> (reason, message)."""
        errored = {}
        if nan_rows is not None:
            for r in np.nonzero(nan_rows & ~discard)[0].tolist():
                errored[req_ids[r]] = ("nan_logits", "the model produced NaN logits for this "
                                                     "request")
        emitted = np.arange(tokens.shape[1]) < num_emitted[:, None]
        outside = (((tokens < 0) | (tokens >= vocab)) & emitted).any(axis=1) & ~discard
        for r in np.nonzero(outside)[0].tolist():
            bad = tokens[r][emitted[r] & ((tokens[r] < 0) | (tokens[r] >= vocab))]
            errored.setdefault(req_ids[r], ("token_out_of_vocab",
                                            f"sampled token id {int(bad[0])} is outside "
                                            f"the vocabulary"))
        for rid, (reason, _) in errored.items():
            logger.error("request %s failed: %s", rid, reason)
        return errored

