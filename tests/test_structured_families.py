"""Structured output on the families with other attention kinds: sliding windows
(Mistral, Gemma 3's local layers, with blocks given back as the window moves) and
DeepSeek's latent cache (MLA). Tiny random checkpoints of each, given the demo
model's real tokenizer: whatever the model says, the grammar makes the JSON valid,
through chunked prefill past the window and preemption."""
from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from conftest import MODEL_SPECS, build_checkpoint  # noqa: E402
from test_structured_output import SCHEMA, assert_json_valid  # noqa: E402

FAMILIES = ["mistral_swa", "gemma3", "deepseek_v2"]
# A pool too small for the four requests at once: a sliding-window request holds only
# its window's blocks, so Mistral's pool is smallest.
POOL_BLOCKS = {"mistral_swa": 8, "gemma3": 40, "deepseek_v2": 33}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, demo_path, tmp_path_factory):
    name = request.param
    arch, overrides = MODEL_SPECS[name]
    path = str(tmp_path_factory.mktemp(f"{name}_tok"))
    build_checkpoint(path, arch, {**overrides, "vocab_size": 4096})  # the demo vocabulary
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(demo_path, f)):
            shutil.copy(os.path.join(demo_path, f), path)
    return name, path


def test_json_schema_past_the_window_with_preemption(family):
    from tokenmill import LLM, SamplingParams, StructuredOutputsParams
    name, path = family
    # Prompt chunks of 16 tokens; the pool forces preemption.
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, block_size=8,
              num_kv_blocks=POOL_BLOCKS[name], max_num_batched_tokens=16,
              enable_chunked_prefill=True)
    long_prompt = "The old mill by the river turns all day and " * 6  # past every window
    prompts = [long_prompt, "JSON please:", "Once upon a time", long_prompt + "again"]
    params = [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(
                                 json=SCHEMA, disable_any_whitespace=True))
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert_json_valid(out.outputs[0])
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_preemptions > 0, name
    assert scheduler.kv_cache_manager.pool.num_used_blocks == 0  # nothing leaked
