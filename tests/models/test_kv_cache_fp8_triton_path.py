"""The FP8 KV cache through the engine's Triton attention (the CUDA path's kernels, run
by Triton's interpreter on CPU tensors, the CPU platform given CUDA's attention
decision): the e4m3 writes, decode and prefill over a cached fp8 prefix (chunks of 8
tokens) against HF with the same e4m3 rounding of K/V (test_kv_cache_fp8.py); with a
checkpoint's k_scale / v_scale, against HF with the scaled rounding
(test_kv_cache_scales.py)."""
import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import make_llm, runner_of  # noqa: E402
from test_kv_cache_fp8 import (NEW, PROMPTS, check_against_reference, models,  # noqa: E402,F401
                               _generate)
from tokenmill import platforms  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture
def triton_platform(monkeypatch):
    make = platforms.from_engine_args

    def with_triton(args, device, dtype):
        return dataclasses.replace(make(args, device, dtype), attention="triton")

    monkeypatch.setattr(platforms, "from_engine_args", with_triton)


@pytest.mark.parametrize("name", ["llama", "mistral_swa"])
def test_triton_attention_over_fp8_cache_matches_hf(models, triton_platform, name):
    path, ref = models(name)
    llm = make_llm(path, kv_cache_dtype="fp8", cpu_kernels="torch", max_num_batched_tokens=8)
    runner = runner_of(llm)
    assert {b.name for b in runner.attn_backends.values()} == {"triton"}
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches.values())
    assert check_against_reference(ref, PROMPTS, _generate(llm, PROMPTS)) == len(PROMPTS) * NEW


def test_triton_attention_with_checkpoint_kv_scales_matches_hf(triton_platform,
                                                               tmp_path_factory):
    from test_kv_cache_scales import PROMPTS as SCALED_PROMPTS
    from test_kv_cache_scales import SCALES_F32, _check_against_reference
    from test_kv_cache_scales import build_scaled_checkpoint
    path, _, ref = build_scaled_checkpoint(tmp_path_factory)
    llm = make_llm(path, kv_cache_dtype="fp8", cpu_kernels="torch", max_num_batched_tokens=8)
    runner = runner_of(llm)
    assert {b.name for b in runner.attn_backends.values()} == {"triton"}
    assert [(a.impl.k_scale, a.impl.v_scale)
            for a in runner.model.attention_layers()] == [SCALES_F32] * 2
    outs = _generate(llm, SCALED_PROMPTS)
    assert _check_against_reference(ref, SCALED_PROMPTS, outs) == len(SCALED_PROMPTS) * NEW
