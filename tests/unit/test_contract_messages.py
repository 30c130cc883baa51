"""The scheduler/runner contract as messages (tokenmill/core/serial.py): every
SchedulerOutput, GrammarOutput and ModelRunnerOutput of a busy run round-trips
through msgpack unchanged, a SchedulerOutput cannot be changed once scheduled, and
anything that could not cross a process boundary is refused."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import make_llm, runner_of
from tokenmill import SamplingParams
from tokenmill.core import serial
from tokenmill.core.sched_output import (CachedRequestData, GrammarOutput, KVConnectorMetadata,
                                         KVLoad, KVStoreBlock, ModelRunnerOutput,
                                         MultiModalFeature, NewRequestData, SchedulerOutput)


def same(a, b) -> bool:
    """Deep equality that also holds for numpy arrays, memoryviews and dict order."""
    if dataclasses.is_dataclass(a):  # every field, those left out of == too
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, memoryview):
        return isinstance(b, memoryview) and a.tobytes() == b.tobytes()
    if isinstance(a, (set, frozenset)):
        return type(a) is type(b) and a == b
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) or {type(a), type(b)} <= {list, tuple}) and len(a) == len(b) \
            and all(same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def first_difference(a, b, path="") -> str:
    """Where `same` fails first (for the assertion message)."""
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        for f in dataclasses.fields(a):
            if not same(getattr(a, f.name), getattr(b, f.name)):
                return first_difference(getattr(a, f.name), getattr(b, f.name),
                                        f"{path}.{f.name}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if not same(x, y):
                return first_difference(x, y, f"{path}[{i}]")
    elif isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b):
        for k in a:
            if not same(a[k], b[k]):
                return first_difference(a[k], b[k], f"{path}[{k!r}]")
    return f"{path}: {a!r:.80} != {b!r:.80}"


def test_a_busy_run_round_trips(llama_tiny):
    """Chunked prefill, preemption, drafts, logprobs and prompt logprobs, a seeded sampled
    request, bad words, the external KV tier (steps that load and store blocks, a load
    that fails): every message of every step decodes to an equal object of its class."""
    llm = make_llm(llama_tiny.path, max_num_batched_tokens=16, num_kv_blocks=14,
                   block_size=8, max_model_len=96, kv_connector=["cpu"],
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    runner = runner_of(llm)
    seen: list[tuple[type, object]] = []
    execute, sample = runner.execute_model, runner.sample_tokens

    def execute_model(so):
        seen.append((SchedulerOutput, so))
        return execute(so)

    def sample_tokens(grammar=None):
        out = sample(grammar)
        seen.append((ModelRunnerOutput, out))
        return out
    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
    motif = [5, 9, 2]
    prompts = [[3, 1, 4] + motif * 6, list(range(20, 50)), [7] * 12, motif * 8]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True,
                             prompt_logprobs=1, logit_bias={3: 2.0}),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    for _ in range(2):  # the second round hits the external tier
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # Third round: the prompts grow (a step loads their prefix and stores new blocks), and
    # one entry is corrupted between the lookup and the worker's read (a failed load).
    store = llm.llm_engine.engine_core.kv_connector.stores[0]
    real_get, broke = store.get_many, []

    def get_many(keys):
        if not broke:
            b = bytearray(store._data[keys[-1]])
            b[-1] ^= 1
            store._data[keys[-1]] = bytes(b)
            broke.append(keys[-1])
        return real_get(keys)
    store.get_many = get_many
    llm.generate([{"prompt_token_ids": p + [11, 12, 13, 14, 15, 16, 17, 18]} for p in prompts],
                 params, use_tqdm=False)
    assert broke
    kinds = {cls for cls, _ in seen}
    assert kinds == {SchedulerOutput, ModelRunnerOutput}
    sos = [m for cls, m in seen if cls is SchedulerOutput]
    assert any(so.preempted_req_ids for so in sos)
    assert any(so.scheduled_spec_decode_tokens for so in sos)
    metas = [so.kv_connector_metadata for so in sos if so.kv_connector_metadata is not None]
    assert any(m.loads and m.stores for m in metas)  # one step loads and stores
    assert any(any(so.scheduled_cached_reqs.resumed_from_preemption) for so in sos)
    outs = [m for cls, m in seen if cls is ModelRunnerOutput]
    assert any(o.logprobs is not None for o in outs) and any(o.prompt_logprobs for o in outs)
    assert any(o.spec_token_ids and any(o.spec_token_ids) for o in outs)
    assert any(o.invalid_block_ids for o in outs)  # the failed load, reported
    for cls, msg in seen:
        data = serial.encode(msg)
        assert isinstance(data, bytes)
        back = serial.decode(data, cls)
        assert same(msg, back), first_difference(msg, back)


def test_connector_metadata_round_trips():
    """A step's KV connector work (loads and stores: ids, hashes, store indices) and the
    runner's report of the blocks that did not load round-trip as they are."""
    meta = KVConnectorMetadata(
        loads=[KVLoad("a", 2, [7, 9], [bytes(range(32)), bytes(32)], [[0], [1, 0]]),
               KVLoad("b", 0, [3], [b"\xff" * 32], [[1]])],
        stores=[KVStoreBlock("a", 11, b"\x01" * 32, (0, 1)),
                KVStoreBlock("c", 4, b"\x02" * 32, (1,))])
    so = SchedulerOutput([], CachedRequestData(["a", "b", "c"], [False] * 3, [None] * 3,
                                               [16, 0, 40]),
                         {"a": 5, "b": 8, "c": 1}, 14, kv_connector_metadata=meta)
    back = serial.decode(serial.encode(so), SchedulerOutput)
    assert same(so, back), first_difference(so, back)
    assert isinstance(back.kv_connector_metadata.loads[0], KVLoad)
    assert back.kv_connector_metadata.stores[0] == KVStoreBlock("a", 11, b"\x01" * 32, (0, 1))
    out = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[], [5]], invalid_block_ids={9})
    back = serial.decode(serial.encode(out), ModelRunnerOutput)
    assert same(out, back) and back.invalid_block_ids == {9}


def test_multimodal_scheduler_output_round_trips():
    """A new request with images (patches as float32 arrays, grids, placeholder runs), the
    step's encoder inputs and freed encoder entries round-trip as they are."""
    rng = np.random.default_rng(0)
    feats = [MultiModalFeature("ab" * 32, rng.standard_normal((96, 96)).astype(np.float32),
                               [1, 8, 12], 3, 24),
             MultiModalFeature("cd" * 32, rng.standard_normal((16, 96)).astype(np.float32),
                               [1, 4, 4], 30, 4)]
    new = NewRequestData("r", [1, 2, 3] + [5] * 24 + [4, 9, 9] + [5] * 4, SamplingParams(),
                         [[1, 2, 3]], 0, mm_features=feats)
    so = SchedulerOutput([new], CachedRequestData(), {"r": 16}, 16,
                         scheduled_encoder_inputs={"r": [0]}, free_encoder_hashes=["ef" * 32])
    back = serial.decode(serial.encode(so), SchedulerOutput)
    assert same(so, back), first_difference(so, back)
    f = back.scheduled_new_reqs[0].mm_features[1]
    assert isinstance(f, MultiModalFeature) and f.pixel_values.dtype == np.float32
    assert f.pixel_values.shape == (16, 96) and f.image_grid_thw == [1, 4, 4]
    # a PIL image or a tensor in a feature is refused: only arrays cross
    bad = NewRequestData("r", [5], SamplingParams(), [[1]], 0, mm_features=[
        MultiModalFeature("00", torch.zeros(1, 96), [1, 2, 2], 0, 1)])
    with pytest.raises(TypeError):
        serial.encode(SchedulerOutput([bad], CachedRequestData(), {"r": 1}, 1))


def test_grammar_output_round_trips():
    bitmask = np.arange(12, dtype=np.int32).reshape(3, 4) - 5
    g = GrammarOutput({"b": 0, "a": 2}, bitmask)
    back = serial.decode(serial.encode(g), GrammarOutput)
    assert same(g, back) and back.grammar_bitmask.flags.writeable


def test_scheduler_output_is_final_once_scheduled():
    so = SchedulerOutput.make_empty()
    with pytest.raises(dataclasses.FrozenInstanceError):
        so.total_num_scheduled_tokens = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        so.kv_connector_metadata = None


def test_what_cannot_cross_a_process_is_refused():
    bad = ModelRunnerOutput(["a"], {"a": 0}, [[1]], spec_token_ids=[[torch.tensor(1)]])
    with pytest.raises(TypeError, match="not part of the scheduler/runner contract"):
        serial.encode(bad)
    with pytest.raises(TypeError, match="not part of"):
        serial.encode(SchedulerOutput([], CachedRequestData(), {"a": 1}, 1,
                                      finished_req_ids={lambda: 0}))
