"""The model runner driven directly, with hand-built SchedulerOutputs (no scheduler).

Covers: KV allocation from the KVCacheConfig specs (padded pages included), the
decode-first reorder keeping every per-row field on the same request, the
discard mask of chunked prefill, greedy decode against dense HF forwards,
per-row sampling in a batch, and preempted/resumed requests.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import hf_next_token, make_llm, runner_of
from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.models.loader import load_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.platforms import create_platform

BS = 4  # block size of every runner here
MAX_LEN = 64
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tm(tiny_model_factory):
    # Qwen3 with head_dim 32 != hidden / heads (16): the KV page must follow the spec.
    return tiny_model_factory("qwen3_headdim")


def make_runner(tm, num_blocks=32, block_size=BS, page_size_padded=None, max_num_reqs=8):
    # A fresh model per runner: initialize_kv_cache binds the caches onto its layers.
    platform = create_platform(CPU, torch.float32)
    model = load_model(tm.path, tm.hf_config, torch.float32, CPU, platform)
    runner = ModelRunner(model, dtype=torch.float32, device=CPU, max_num_reqs=max_num_reqs,
                         max_model_len=MAX_LEN, max_num_batched_tokens=64, platform=platform)
    spec = FullAttentionSpec(block_size, model.config.num_kv_heads, model.config.head_dim,
                             "float32", page_size_padded=page_size_padded)
    config = KVCacheConfig(num_blocks, [KVCacheGroup(list(runner.attention_layers()), spec)])
    runner.initialize_kv_cache(config)
    return runner


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=64)


def seeded(seed, temperature=1.5, top_k=50, top_p=0.95):
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          max_tokens=64)


def new_req(rid, prompt, blocks, sp=None, num_computed=0, output=()):
    return NewRequestData(req_id=rid, prompt_token_ids=list(prompt),
                          sampling_params=sp or greedy(), block_ids=[list(blocks)],
                          num_computed_tokens=num_computed, output_token_ids=list(output))


def cached(*entries):
    """entries: (req_id, num_computed_tokens, new_blocks or None, resumed=False)."""
    c = CachedRequestData()
    for e in entries:
        rid, computed, blocks = e[:3]
        resumed = e[3] if len(e) > 3 else False
        c.req_ids.append(rid)
        c.num_computed_tokens.append(computed)
        c.new_block_ids.append(None if blocks is None else [list(blocks)])
        c.resumed_from_preemption.append(resumed)
    return c


def step(runner, sched, new=(), cached_reqs=None, finished=(), preempted=()):
    so = SchedulerOutput(list(new), cached_reqs or CachedRequestData(), dict(sched),
                         sum(sched.values()), set(finished), set(preempted))
    assert runner.execute_model(so) is None  # the forward only; tokens come from sample_tokens
    return runner.sample_tokens()


def token_of(out, rid):
    toks = out.sampled_token_ids[out.req_id_to_index[rid]]
    assert len(toks) == 1, f"{rid} sampled {toks}"
    return toks[0]


def prompt_of(n, start):
    return [(start + 37 * i) % 384 for i in range(n)]


# ---- (a) KV allocation from the spec ------------------------------------------------------

def test_kv_cache_allocated_from_spec(tm):
    runner = make_runner(tm, num_blocks=12)
    c = runner.model.config
    assert (c.num_kv_heads, c.head_dim) == (2, 32)
    # The runner's own spec follows the model's attention layers, not hidden / heads.
    specs = runner.get_kv_cache_spec(BS)
    assert set(specs) == {"layers.0.attn", "layers.1.attn"}
    spec = next(iter(specs.values()))
    assert spec == FullAttentionSpec(BS, 2, 32, "float32")
    assert spec.page_size_bytes == spec.real_page_size_bytes == 2 * BS * 2 * 32 * 4
    assert set(runner.kv_caches) == set(specs)
    for name, cache in runner.kv_caches.items():
        assert cache.shape == (12, 2, BS, 2, 32)
        assert cache.dtype == torch.float32
        assert cache.untyped_storage().nbytes() == 12 * spec.page_size_bytes
        # Each attention layer reads and writes exactly this tensor.
        assert runner.attention_layers()[name].kv_cache is cache
    # Two layers never share memory.
    ptrs = {cache.untyped_storage().data_ptr() for cache in runner.kv_caches.values()}
    assert len(ptrs) == 2


def test_padded_page_is_honoured_and_still_computes(tm):
    real = FullAttentionSpec(BS, 2, 32, "float32").real_page_size_bytes
    padded = real + 512
    num_blocks = 10
    runner = make_runner(tm, num_blocks=num_blocks, page_size_padded=padded)
    spec = runner.kv_cache_config.groups[0].spec
    assert spec.page_size_bytes == padded != real
    assert runner.kv_cache_config.bytes_per_block() == 2 * padded
    for cache in runner.kv_caches.values():
        storage = cache.untyped_storage()
        assert storage.nbytes() == num_blocks * padded  # the raw allocation per layer
        assert cache.shape == (num_blocks, 2, BS, 2, 32)
        assert cache.stride(0) * cache.element_size() == padded

    # The data still computes correctly: prefill + decodes equal dense HF argmax.
    prompt = prompt_of(6, 5)
    out = step(runner, {"A": 6}, new=[new_req("A", prompt, [1, 2])])
    tokens = prompt + [token_of(out, "A")]
    assert tokens[-1] == hf_next_token(tm.hf, prompt)
    blocks = [1, 2]
    for _ in range(5):
        computed = len(tokens) - 1
        extra = None
        if len(tokens) > len(blocks) * BS:
            extra = [len(blocks) + 1]
            blocks += extra
        out = step(runner, {"A": 1}, cached_reqs=cached(("A", computed, extra)))
        expect = hf_next_token(tm.hf, tokens)
        tokens.append(token_of(out, "A"))
        assert tokens[-1] == expect

    # The padding bytes of every page are untouched; the real bytes were written.
    for cache in runner.kv_caches.values():
        raw = torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage()).view(
            num_blocks, padded)
        assert not raw[:, real:].any()
        assert raw[1, :real].any() and raw[3, :real].any()
        assert not raw[0].any()  # the null block is never written


def test_engine_sizes_the_cache_from_the_spec(tm):
    per_block = 2 * FullAttentionSpec(8, 2, 32, "float32").page_size_bytes  # two layers
    llm = make_llm(tm.path, block_size=8, kv_cache_memory=per_block * 21 + per_block // 2,
                   max_model_len=64)
    runner = runner_of(llm)
    config = runner.kv_cache_config
    assert config.num_blocks == 21
    assert config.bytes_per_block() == per_block
    assert config.groups[0].spec == FullAttentionSpec(8, 2, 32, "float32")
    assert sorted(config.groups[0].layer_names) == ["layers.0.attn", "layers.1.attn"]
    for cache in runner.kv_caches.values():
        assert cache.shape == (21, 2, 8, 2, 32)
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.pool.num_blocks == 21


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_cache_holds_the_running_sequences_and_with_prefix_caching_as_much_again(
        tm, prefix_caching):
    """A budget larger than needed: blocks for max_num_seqs sequences of max_model_len
    (plus the null block); with prefix caching twice that, so that finished requests'
    blocks stay cached beside a full batch (a lone request at max_model_len would
    otherwise evict the prompt blocks its successor hits)."""
    llm = make_llm(tm.path, block_size=8, max_model_len=64, max_num_seqs=2,
                   kv_cache_memory=1 << 30, enable_prefix_caching=prefix_caching)
    per_seq = 64 // 8
    want = (2 if prefix_caching else 1) * 2 * per_seq + 1
    assert runner_of(llm).kv_cache_config.num_blocks == want


def test_padded_page_smaller_than_real_is_rejected():
    spec = FullAttentionSpec(BS, 2, 32, "float32", page_size_padded=16)
    with pytest.raises(ValueError, match="page_size_padded"):
        spec.page_size_bytes


# ---- (b) the four-way ordering identity ---------------------------------------------------

def test_four_way_ordering_identity(tm):
    runner = make_runner(tm)
    batch = runner.input_batch
    d_prompt = [6, 7, 8]
    # Step 1: D prefills its prompt (real KV in block 1) and samples its first token.
    out = step(runner, {"D": 3}, new=[new_req("D", d_prompt, [1])])
    d_first = token_of(out, "D")
    # Step 2: D is not scheduled: it leaves the batch (its state stays).
    step(runner, {})
    assert batch.num_reqs() == 0 and "D" in runner.requests
    # Step 3: P (new, 5-token prefill, seeded random) is admitted before D comes back,
    # so P takes row 0 and D row 1: prefill-first.
    p_prompt = [1, 2, 3, 4, 5]
    so = SchedulerOutput([new_req("P", p_prompt, [2, 3], seeded(12345))],
                         cached(("D", 3, None)), {"P": 5, "D": 1}, 6)
    runner.execute_model(so)

    # The reorder moved the decode to row 0.
    assert batch.req_ids[:2] == ["D", "P"]
    assert batch.req_id_to_index == {"D": 0, "P": 1}
    step_in = runner.last_step
    # seq_lens / block-table rows.
    assert step_in.seq_lens.tolist() == [4, 5]
    assert step_in.block_table[0, 0] == 1 and step_in.block_table[1, :2].tolist() == [2, 3]
    # Logits rows: D's single token at flat index 0, P's last prompt token at 5.
    assert step_in.query_start_loc.tolist() == [0, 1, 6]
    assert step_in.logits_indices.tolist() == [0, 5]
    assert step_in.input_ids.tolist() == [d_first] + p_prompt
    assert step_in.positions.tolist() == [3, 0, 1, 2, 3, 4]
    assert runner.last_attn_meta.num_decodes == 1
    # Sampling rows: P's generator sits at row 1, D (greedy) has none.
    md = batch.make_sampling_metadata()
    assert set(md.generators) == {1}
    assert md.generators[1] is runner.requests["P"].generator
    assert batch.seeds == {1: 12345}
    assert md.greedy_mask.tolist() == [True, False]
    assert md.temperature[1].item() == pytest.approx(1.5)
    assert md.top_k.tolist() == [0, 50]
    assert md.top_p[1].item() == pytest.approx(0.95)
    assert not md.all_greedy and not md.all_random
    # Write-back slots.
    assert batch.num_tokens_no_spec[:2].tolist() == [4, 5]

    out = runner.sample_tokens()
    assert out.req_ids == ["D", "P"]
    assert out.req_id_to_index == {"D": 0, "P": 1}
    d_tok, p_tok = token_of(out, "D"), token_of(out, "P")
    assert batch.num_tokens_no_spec[:2].tolist() == [5, 6]
    assert batch.token_id(0, 4) == d_tok
    assert batch.token_id(1, 5) == p_tok
    assert runner.requests["D"].output_token_ids == [d_first, d_tok]
    assert runner.requests["P"].output_token_ids == [p_tok]
    # D's token came from D's logits row (dense HF over its own sequence).
    assert d_tok == hf_next_token(tm.hf, d_prompt + [d_first])
    # P's token used P's generator on P's row: the same as P alone with the same seed.
    alone = make_runner(tm)
    out_alone = step(alone, {"P": 5}, new=[new_req("P", p_prompt, [2, 3], seeded(12345))])
    assert token_of(out_alone, "P") == p_tok


# ---- (c) per-row fields stay consistent through the reorder ------------------------------

# Each request: prompt, output so far, num_computed, scheduled, blocks, sampling params.
REQS = {
    # decode (region 0)
    "D": dict(prompt=prompt_of(3, 11), output=[9], computed=3, sched=1, blocks=[1],
              sp=lambda: greedy()),
    # one more prompt token mid-prompt (region 1), discarded
    "S": dict(prompt=prompt_of(8, 21), output=[], computed=4, sched=1, blocks=[2, 3],
              sp=lambda: seeded(333, top_k=7)),
    # a longer chunk continuing a prompt (region 2), discarded
    "L": dict(prompt=prompt_of(9, 31), output=[], computed=4, sched=3, blocks=[4, 5],
              sp=lambda: SamplingParams(temperature=0.9, top_p=0.8, max_tokens=8)),
    # fresh prefills (region 3): one complete, one a first chunk
    "P0": dict(prompt=prompt_of(5, 41), output=[], computed=0, sched=5, blocks=[6, 7],
               sp=lambda: seeded(111, temperature=0.7, top_k=2, top_p=1.0)),
    "P1": dict(prompt=prompt_of(6, 51), output=[], computed=0, sched=4, blocks=[8, 9],
               sp=lambda: seeded(222, temperature=0.7, top_k=2, top_p=1.0)),
}


def region(spec):
    if spec["computed"] == 0:
        return 3
    if spec["sched"] > 1:
        return 2
    return 1 if spec["computed"] < len(spec["prompt"]) else 0


@pytest.mark.parametrize("order", [
    ["P0", "P1", "D"],  # the 3-request case: two prefills admitted before a decode
    ["D", "P0", "P1"],
    ["P0", "L", "D", "S", "P1"],
    ["P1", "P0", "L", "S", "D"],
    ["S", "P0", "D", "P1", "L"],
], ids=lambda o: "-".join(o))
def test_reorder_keeps_every_per_row_field_consistent(tm, order):
    runner = make_runner(tm)
    batch = runner.input_batch
    new = []
    for rid in order:
        r = REQS[rid]
        new.append(new_req(rid, r["prompt"], r["blocks"], r["sp"](), r["computed"], r["output"]))
    so = SchedulerOutput(new, CachedRequestData(), {rid: REQS[rid]["sched"] for rid in order},
                         sum(REQS[rid]["sched"] for rid in order))
    runner.execute_model(so)
    n = len(order)
    assert batch.num_reqs() == n
    rows = batch.req_ids[:n]
    assert sorted(rows) == sorted(order)
    # Decode-first: regions never decrease along the rows.
    regions = [region(REQS[rid]) for rid in rows]
    assert regions == sorted(regions)

    step_in = runner.last_step
    md = batch.make_sampling_metadata()
    qsl = step_in.query_start_loc
    meta = runner.last_attn_meta
    assert meta.num_decodes == sum(1 for rid in rows if REQS[rid]["sched"] == 1
                                   and region(REQS[rid]) < 3)
    prefill_rows = rows[meta.num_decodes:]
    assert [p.context_len for p in meta.prefills] == [REQS[r]["computed"] for r in prefill_rows]
    before = batch.num_tokens_no_spec[:n].copy()
    for row, rid in enumerate(rows):
        r = REQS[rid]
        tokens = r["prompt"] + r["output"]
        sp = runner.requests[rid].sampling_params
        c, s = r["computed"], r["sched"]
        assert batch.req_id_to_index[rid] == row
        assert batch.num_prompt_tokens[row] == len(r["prompt"])
        assert batch.num_tokens_no_spec[row] == len(tokens)
        assert batch.num_computed_tokens_cpu[row] == c
        assert batch.token_ids_cpu[row, :len(tokens)].tolist() == tokens
        nb = len(r["blocks"])
        assert batch.block_tables[0].num_blocks_per_row[row] == nb
        assert step_in.block_table[row, :nb].tolist() == r["blocks"]
        assert not step_in.block_table[row, nb:].any()
        assert step_in.seq_lens[row] == c + s
        assert qsl[row + 1] - qsl[row] == s
        assert step_in.logits_indices[row] == qsl[row + 1] - 1
        lo, hi = qsl[row], qsl[row + 1]
        assert step_in.positions[lo:hi].tolist() == list(range(c, c + s))
        assert step_in.input_ids[lo:hi].tolist() == tokens[c:c + s]
        expect_slots = [r["blocks"][p // BS] * BS + p % BS for p in range(c, c + s)]
        assert step_in.slot_mapping[lo:hi].tolist() == expect_slots
        assert bool(step_in.discard_mask[row]) == (c + s < len(tokens))
        # Sampling row.
        assert md.temperature[row].item() == pytest.approx(sp.temperature if not sp.greedy
                                                           else 1.0)
        assert bool(md.greedy_mask[row]) == sp.greedy
        assert (0 if md.top_k is None else int(md.top_k[row])) == sp.top_k
        assert (1.0 if md.top_p is None else float(md.top_p[row])) == pytest.approx(sp.top_p)
        if sp.seed is not None and not sp.greedy:
            assert md.generators[row] is runner.requests[rid].generator
            assert batch.seeds[row] == sp.seed
        else:
            assert row not in md.generators and row not in batch.seeds

    out = runner.sample_tokens()
    assert out.req_ids == rows
    for row, rid in enumerate(rows):
        r = REQS[rid]
        tokens = r["prompt"] + r["output"]
        discarded = r["computed"] + r["sched"] < len(tokens)
        sampled = out.sampled_token_ids[out.req_id_to_index[rid]]
        if discarded:
            assert sampled == []
            assert batch.num_tokens_no_spec[row] == before[row]
        else:
            assert len(sampled) == 1
            assert batch.num_tokens_no_spec[row] == before[row] + 1
            assert batch.token_id(row, int(before[row])) == sampled[0]
        assert runner.requests[rid].output_token_ids == r["output"] + sampled


# ---- (d) the discard mask -----------------------------------------------------------------

def test_chunked_prefill_row_samples_nothing(tm):
    runner = make_runner(tm)
    batch = runner.input_batch
    prompt = prompt_of(10, 3)
    out = step(runner, {"C": 5}, new=[new_req("C", prompt, [1, 2])])
    assert out.req_ids == ["C"]
    assert out.sampled_token_ids == [[]]
    assert runner.last_step.discard_mask.tolist() == [True]
    assert batch.num_tokens_no_spec[0] == 10  # the row did not grow
    assert batch.token_ids_cpu[0, :10].tolist() == prompt
    assert runner.requests["C"].output_token_ids == []
    # The rest of the prompt: now it samples, and from the whole prompt's context.
    out = step(runner, {"C": 5}, cached_reqs=cached(("C", 5, [3])))
    assert runner.last_step.discard_mask.tolist() == [False]
    assert runner.last_attn_meta.prefills[0].context_len == 5
    tok = token_of(out, "C")
    assert tok == hf_next_token(tm.hf, prompt)
    assert batch.num_tokens_no_spec[0] == 11 and batch.token_id(0, 10) == tok


def test_discarded_row_does_not_advance_its_generator(tm):
    """A seeded request's tokens must not depend on how its prompt was chunked."""
    prompt = prompt_of(10, 17)

    def run(chunks):
        runner = make_runner(tm)
        toks, computed = [], 0
        for i, n in enumerate(chunks):
            if i == 0:
                out = step(runner, {"R": n}, new=[new_req("R", prompt, [1, 2, 3, 4, 5],
                                                          seeded(99, temperature=1.0, top_k=0,
                                                                 top_p=1.0))])
            else:
                out = step(runner, {"R": n}, cached_reqs=cached(("R", computed, None)))
            computed += n
            toks += out.sampled_token_ids[0]
        for _ in range(6):  # decodes
            out = step(runner, {"R": 1}, cached_reqs=cached(("R", computed, None)))
            computed += 1
            toks += out.sampled_token_ids[0]
        return toks

    whole = run([10])
    assert len(whole) == 7
    chunked = run([4, 3, 3])
    assert chunked == whole, ("the two discarded prompt chunks consumed draws from the "
                              "request's generator")


# ---- (e) single-request greedy decode vs dense HF --------------------------------------

def test_single_request_greedy_decode_matches_dense_hf(tm):
    runner = make_runner(tm, num_blocks=16)
    batch = runner.input_batch
    prompt = prompt_of(5, 9)
    blocks = [3, 7]  # deliberately not contiguous
    out = step(runner, {"A": 5}, new=[new_req("A", prompt, blocks)])
    tokens = prompt + [token_of(out, "A")]
    assert tokens[-1] == hf_next_token(tm.hf, prompt)
    assert batch.num_tokens_no_spec[0] == 6 and batch.token_id(0, 5) == tokens[-1]
    # The prefill wrote K/V into the request's blocks and nowhere else.
    for cache in runner.kv_caches.values():
        assert cache[3].abs().sum() > 0 and cache[7, :, :1].abs().sum() > 0
        assert not cache[7, :, 1:].any()
        assert not cache[0].any() and not cache[1].any()
    spare = [12, 5, 9]
    for _ in range(10):
        computed = len(tokens) - 1
        extra = None
        if len(tokens) > len(blocks) * BS:
            extra = [spare.pop(0)]
            blocks = blocks + extra
        out = step(runner, {"A": 1}, cached_reqs=cached(("A", computed, extra)))
        # The input was the previously sampled token, at its position.
        assert runner.last_step.input_ids.tolist() == [tokens[-1]]
        assert runner.last_step.positions.tolist() == [computed]
        assert runner.last_step.seq_lens.tolist() == [computed + 1]
        assert runner.last_step.block_table[0, :len(blocks)].tolist() == blocks
        expect = hf_next_token(tm.hf, tokens)
        tokens.append(token_of(out, "A"))
        assert tokens[-1] == expect, f"step at position {computed}"
        assert batch.num_tokens_no_spec[0] == len(tokens)
        assert batch.token_id(0, len(tokens) - 1) == tokens[-1]
    assert len(blocks) == 4  # the decode crossed into two new blocks
    assert runner.requests["A"].output_token_ids == tokens[5:]
    for cache in runner.kv_caches.values():
        assert not cache[0].any()


# ---- (f) a 2-request batch samples each from its own row --------------------------------

def test_two_request_batch_samples_each_from_its_own_row(tm):
    runner = make_runner(tm)
    a_prompt, b_prompt = prompt_of(7, 100), prompt_of(3, 200)
    a_exp, b_exp = hf_next_token(tm.hf, a_prompt), hf_next_token(tm.hf, b_prompt)
    assert a_exp != b_exp  # otherwise a row mix-up would go unnoticed
    out = step(runner, {"A": 7, "B": 3},
               new=[new_req("A", a_prompt, [1, 2]), new_req("B", b_prompt, [3])])
    assert out.req_ids == ["A", "B"]  # both prefills: no reorder
    seqs = {"A": a_prompt + [token_of(out, "A")], "B": b_prompt + [token_of(out, "B")]}
    assert seqs["A"][-1] == a_exp and seqs["B"][-1] == b_exp
    # Batched decodes of different lengths (one decode call with a padded mask).
    blocks = {"A": [1, 2], "B": [3]}
    spare = [4, 5, 6, 7]
    for _ in range(4):
        entries = []
        for rid in ("A", "B"):
            extra = None
            if len(seqs[rid]) > len(blocks[rid]) * BS:
                extra = [spare.pop(0)]
                blocks[rid] = blocks[rid] + extra
            entries.append((rid, len(seqs[rid]) - 1, extra))
        expect = {rid: hf_next_token(tm.hf, seqs[rid]) for rid in seqs}
        out = step(runner, {"A": 1, "B": 1}, cached_reqs=cached(*entries))
        assert runner.last_attn_meta.num_decodes == 2
        for rid in ("A", "B"):
            seqs[rid].append(token_of(out, rid))
            assert seqs[rid][-1] == expect[rid], rid


def test_finished_request_leaves_the_batch(tm):
    runner = make_runner(tm)
    step(runner, {"A": 3, "B": 4},
         new=[new_req("A", prompt_of(3, 1), [1]), new_req("B", prompt_of(4, 2), [2])])
    b_seq = prompt_of(4, 2) + runner.requests["B"].output_token_ids
    out = step(runner, {"B": 1}, cached_reqs=cached(("B", 4, [3])), finished={"A"})
    assert "A" not in runner.requests
    assert out.req_ids == ["B"]
    assert runner.input_batch.req_ids[0] == "B"  # condensed into row 0
    assert runner.input_batch.token_ids_cpu[0, :5].tolist() == b_seq
    assert token_of(out, "B") == hf_next_token(tm.hf, b_seq)


# ---- (g) preempted and resumed requests -------------------------------------------------

def grow(blocks, num_tokens, spare):
    """New block ids a request needs to hold num_tokens (None when it has room)."""
    extra = []
    while (len(blocks) + len(extra)) * BS < num_tokens:
        extra.append(spare.pop(0))
    blocks.extend(extra)
    return extra or None


@pytest.mark.parametrize("recompute_chunks", [[None], [4, None]], ids=["whole", "chunked"])
def test_preempted_request_resumes_correctly(tm, recompute_chunks):
    runner = make_runner(tm)
    batch = runner.input_batch
    a_prompt, b_prompt = prompt_of(6, 77), prompt_of(5, 88)
    a_blocks, b_blocks = [1, 2], [3, 4]
    out = step(runner, {"A": 6, "B": 5},
               new=[new_req("A", a_prompt, a_blocks), new_req("B", b_prompt, b_blocks)])
    a = a_prompt + [token_of(out, "A")]
    b = b_prompt + [token_of(out, "B")]
    for _ in range(2):  # A: 7, 8 tokens; B: 6, 7 (all inside their two blocks)
        out = step(runner, {"A": 1, "B": 1},
                   cached_reqs=cached(("A", len(a) - 1, None), ("B", len(b) - 1, None)))
        a.append(token_of(out, "A"))
        b.append(token_of(out, "B"))
    assert len(a) == 9  # A's next decode would need a third block
    # A is preempted: out of the batch; its freed blocks go to B, which overwrites them.
    spare = [2, 1, 8, 9, 10, 11, 12, 13]
    out = step(runner, {"B": 1}, cached_reqs=cached(("B", len(b) - 1, grow(b_blocks, len(b), spare))),
               preempted={"A"})
    assert out.req_ids == ["B"]
    b.append(token_of(out, "B"))
    assert "A" in runner.requests and "A" not in batch.req_id_to_index
    for _ in range(5):
        out = step(runner, {"B": 1},
                   cached_reqs=cached(("B", len(b) - 1, grow(b_blocks, len(b), spare))))
        b.append(token_of(out, "B"))
    assert b_blocks[:4] == [3, 4, 2, 1]  # both of A's old blocks now hold B's K/V
    # Resume A from scratch in fresh blocks (recompute prompt + outputs).
    a_blocks = [5, 6, 7]
    computed = 0
    for i, chunk in enumerate(recompute_chunks):
        n = len(a) - computed if chunk is None else chunk
        entry = ("A", computed, a_blocks, True) if i == 0 else ("A", computed, None)
        out = step(runner, {"A": n, "B": 1}, cached_reqs=cached(
            entry, ("B", len(b) - 1, grow(b_blocks, len(b), spare))))
        row = batch.req_id_to_index["A"]
        assert batch.token_ids_cpu[row, :len(a)].tolist() == a
        assert runner.requests["A"].block_ids == [a_blocks]
        assert runner.last_step.block_table[row, :3].tolist() == a_blocks
        computed += n
        b.append(token_of(out, "B"))
        if computed < len(a):
            assert out.sampled_token_ids[out.req_id_to_index["A"]] == []
            assert batch.num_tokens_no_spec[row] == len(a)
    expect = hf_next_token(tm.hf, a)
    a.append(token_of(out, "A"))
    assert a[-1] == expect
    # A keeps decoding correctly after the resume; so does B beside it.
    for _ in range(3):
        expect_a, expect_b = hf_next_token(tm.hf, a), hf_next_token(tm.hf, b)
        out = step(runner, {"A": 1, "B": 1}, cached_reqs=cached(
            ("A", len(a) - 1, grow(a_blocks, len(a), spare)),
            ("B", len(b) - 1, grow(b_blocks, len(b), spare))))
        a.append(token_of(out, "A"))
        b.append(token_of(out, "B"))
        assert (a[-1], b[-1]) == (expect_a, expect_b)
    assert runner.requests["A"].output_token_ids == a[len(a_prompt):]
    assert runner.requests["B"].output_token_ids == b[len(b_prompt):]


def test_empty_step_returns_empty_output(tm):
    runner = make_runner(tm)
    out = step(runner, {})
    assert out.req_ids == [] and out.sampled_token_ids == []
    assert runner.input_batch.num_reqs() == 0
    # And the reorder helper reports a real move for a prefill-first batch.
    from tokenmill.worker.runner_inputs import reorder_decodes_first
    runner.execute_model(SchedulerOutput(
        [new_req("P", prompt_of(4, 1), [1]), new_req("D", prompt_of(3, 2), [2], output=[5],
                                                      num_computed=3)],
        CachedRequestData(), {"P": 4, "D": 1}, 5))
    assert runner.input_batch.req_ids[:2] == ["D", "P"]
    assert not reorder_decodes_first(runner.input_batch, {"P": 4, "D": 1})  # already sorted
    runner.input_batch.swap_states(0, 1)
    assert reorder_decodes_first(runner.input_batch, {"P": 4, "D": 1})
    assert runner.input_batch.req_ids[:2] == ["D", "P"]
    runner.sample_tokens()
    assert np.all(runner.input_batch.num_tokens_no_spec[:2] == [5, 5])


# ---- the persistent batch over many steps, against dense HF ------------------------------

class RunnerSim:
    """Plays the scheduler for a runner: tracks tokens, blocks and what each step must return.

    Every sampled token is checked against a dense HF forward over the request's tokens.
    """

    def __init__(self, runner, hf, num_blocks, max_tokens_per_step=64):
        self.runner, self.hf = runner, hf
        self.free = list(range(1, num_blocks))
        self.reqs: dict[str, dict] = {}
        self.finished_pending: set[str] = set()
        self.max_tokens_per_step = max_tokens_per_step
        self.num_checked = self.num_resumed = self.num_skipped = 0

    def add(self, rid, prompt):
        self.reqs[rid] = dict(tokens=list(prompt), n_prompt=len(prompt), computed=0, blocks=[],
                              known=False, resumed=False)

    def remaining(self, rid):
        r = self.reqs[rid]
        return len(r["tokens"]) - r["computed"]

    def preempt(self, rid):
        r = self.reqs[rid]
        self.free.extend(r["blocks"])
        r.update(computed=0, blocks=[], resumed=True)

    def finish(self, rid):
        self.free.extend(self.reqs.pop(rid)["blocks"])
        self.finished_pending.add(rid)

    def step(self, sched: dict[str, int], preempted=()):
        assert sum(sched.values()) <= self.max_tokens_per_step
        new, entries = [], []
        for rid, n in sched.items():
            r = self.reqs[rid]
            assert 1 <= n <= self.remaining(rid)
            need = cdiv_(r["computed"] + n, BS) - len(r["blocks"])
            extra = [self.free.pop(0) for _ in range(max(0, need))]
            r["blocks"] += extra
            if not r["known"]:
                new.append(new_req(rid, r["tokens"][:r["n_prompt"]], r["blocks"],
                                   num_computed=r["computed"],
                                   output=r["tokens"][r["n_prompt"]:]))
                r["known"] = True
            elif r["resumed"]:
                entries.append((rid, r["computed"], list(r["blocks"]), True))
                self.num_resumed += 1
            else:
                entries.append((rid, r["computed"], extra or None))
            r["resumed"] = False
        so = SchedulerOutput(new, cached(*entries), dict(sched), sum(sched.values()),
                             set(self.finished_pending), set(preempted))
        self.finished_pending = set()
        expect = {}
        for rid, n in sched.items():
            r = self.reqs[rid]
            if r["computed"] + n == len(r["tokens"]):
                expect[rid] = [hf_next_token(self.hf, r["tokens"])]
            else:
                expect[rid] = []
        self.runner.execute_model(so)
        out = self.runner.sample_tokens()
        assert sorted(out.req_ids) == sorted(sched)
        batch = self.runner.input_batch
        for rid, n in sched.items():
            r = self.reqs[rid]
            got = out.sampled_token_ids[out.req_id_to_index[rid]]
            assert got == expect[rid], f"{rid} at {r['computed']}+{n}/{len(r['tokens'])}"
            self.num_checked += len(got)
            r["computed"] += n
            r["tokens"] += got
            row = batch.req_id_to_index[rid]
            assert batch.token_ids_cpu[row, :len(r["tokens"])].tolist() == r["tokens"]
            assert batch.num_tokens_no_spec[row] == len(r["tokens"])
        return out


def cdiv_(a, b):
    return -(-a // b)


def test_mixed_regions_and_reorders_compute_correct_tokens(tm):
    runner = make_runner(tm, num_blocks=40)
    batch = runner.input_batch
    sim = RunnerSim(runner, tm.hf, 40)
    for rid, n, start in (("C", 9, 1), ("B", 8, 2), ("A", 5, 3), ("E", 12, 5)):
        sim.add(rid, prompt_of(n, start))
    # Admitted C, B, A, E: only A completes its prompt.
    sim.step({"C": 4, "B": 4, "A": 5, "E": 2})
    assert batch.req_ids[:4] == ["C", "B", "A", "E"]
    # A decodes (region 0), B takes one prompt token (1), C and E longer chunks (2; E's
    # needs two new blocks at once), D arrives (3).
    sim.add("D", prompt_of(6, 4))
    sim.step({"C": 3, "B": 1, "A": 1, "E": 10, "D": 6})
    assert batch.req_ids[:2] == ["A", "B"]
    assert set(batch.req_ids[2:4]) == {"C", "E"} and batch.req_ids[4] == "D"
    assert runner.last_attn_meta.num_decodes == 2
    sim.step({"C": 2, "B": 3, "A": 1, "D": 1, "E": 1})  # B and C finish their prompts
    for _ in range(4):
        sim.step({rid: 1 for rid in "ABCDE"})
    assert sim.num_checked == 1 + 3 + 5 + 20


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_schedules_match_dense_hf(tm, seed):
    """Random arrivals, chunks, skipped steps, preemptions and finishes."""
    import random
    rng = random.Random(seed)
    num_blocks = 48
    runner = make_runner(tm, num_blocks=num_blocks, max_num_reqs=6)
    sim = RunnerSim(runner, tm.hf, num_blocks, max_tokens_per_step=24)
    next_id = 0
    for step_no in range(30):
        live = list(sim.reqs)
        if len(live) < 5 and rng.random() < 0.5:
            sim.add(f"r{next_id}", prompt_of(rng.randint(1, 20), rng.randint(0, 383)))
            next_id += 1
            live = list(sim.reqs)
        # Finish some requests that have produced enough, preempt one now and then.
        for rid in live:
            r = sim.reqs[rid]
            if len(r["tokens"]) - r["n_prompt"] >= rng.randint(3, 8) and rng.random() < 0.5:
                sim.finish(rid)
        live = list(sim.reqs)
        preempted = set()
        if live and (rng.random() < 0.15 or step_no in (8, 16, 24)):
            victims = [rid for rid in live if sim.reqs[rid]["known"] and sim.reqs[rid]["computed"]]
            if victims:
                victim = rng.choice(victims)
                sim.preempt(victim)
                preempted.add(victim)
        sched, budget = {}, 24
        order = live[:]
        rng.shuffle(order)
        for rid in order:
            if rid in preempted or budget == 0 or rng.random() < 0.15:
                sim.num_skipped += rid not in preempted
                continue  # skipped this step (budget, or just not scheduled)
            rem = sim.remaining(rid)
            r = sim.reqs[rid]
            if len(r["tokens"]) >= MAX_LEN - 1:
                continue
            n = min(rem, budget, rng.randint(1, rem))
            need = cdiv_(r["computed"] + n, BS) - len(r["blocks"])
            if need > len(sim.free):
                continue
            sched[rid] = n
            budget -= n
        sim.step(sched, preempted)  # also when empty: the runner must hear of preemptions
        # Requests near the length limit finish.
        for rid in list(sim.reqs):
            if len(sim.reqs[rid]["tokens"]) >= MAX_LEN - 1:
                sim.finish(rid)
    assert sim.num_checked >= 15
    assert next_id >= 5
    assert sim.num_resumed >= 1 and sim.num_skipped >= 1
