"""Which runner an engine is and how it pools: the checkpoint's sentence-transformers
files, --pooler-config on top, --runner / --task; PoolingParams' checks; the chunk-by-
chunk pooling against pooling the whole prompt at once."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from embedding_checkpoint import write_st_files
from tokenmill.errors import ParamError
from tokenmill.pooling.config import PoolerConfig, read_sentence_transformers, resolve_pooling
from tokenmill.pooling.params import PoolingParams
from tokenmill.worker.pooler import PoolingState

CAUSAL = {"architectures": ["Qwen3ForCausalLM"]}
BARE = {"architectures": ["Qwen3Model"]}


@pytest.mark.parametrize("mode", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_files_give_the_pooler(tmp_path, mode, normalize):
    write_st_files(str(tmp_path), mode, normalize)
    assert read_sentence_transformers(str(tmp_path)) == PoolerConfig(mode, normalize)


def test_without_a_pooling_module_there_is_no_pooler(tmp_path):
    assert read_sentence_transformers(str(tmp_path)) is None  # no modules.json
    write_st_files(str(tmp_path), None, normalize=True)
    assert read_sentence_transformers(str(tmp_path)) is None


@pytest.mark.parametrize("mode", ["pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                  "pooling_mode_weightedmean_tokens"])
def test_a_pooling_mode_tokenmill_does_not_run_is_refused_by_name(tmp_path, mode):
    write_st_files(str(tmp_path), "MEAN", pooling_config={mode: True})
    with pytest.raises(ValueError, match=mode):
        read_sentence_transformers(str(tmp_path))


def test_two_modes_a_dense_module_or_a_missing_config_are_refused(tmp_path):
    write_st_files(str(tmp_path), "MEAN", pooling_config={"pooling_mode_cls_token": True})
    with pytest.raises(ValueError, match="exactly one"):
        read_sentence_transformers(str(tmp_path))
    write_st_files(str(tmp_path), "LAST", extra_modules=("sentence_transformers.models.Dense",))
    with pytest.raises(ValueError, match="Dense is not supported"):
        read_sentence_transformers(str(tmp_path))
    write_st_files(str(tmp_path), "LAST")
    (tmp_path / "1_Pooling" / "config.json").unlink()
    with pytest.raises(ValueError, match="without its config"):
        read_sentence_transformers(str(tmp_path))


def test_pooler_config_overrides_field_by_field():
    base = PoolerConfig("MEAN", False)
    assert PoolerConfig.override(base, None) == base
    assert PoolerConfig.override(base, '{"normalize": true}') == PoolerConfig("MEAN", True)
    assert PoolerConfig.override(base, {"pooling_type": "cls"}) == PoolerConfig("CLS", False)
    for bad, match in [('{"pooling_type": "MAX"}', "pooling_type"),
                       ({"normalize": "yes"}, "normalize"),
                       ({"softmax": True}, "unknown field 'softmax'"),
                       ("{not json", "not valid JSON"), ("[1]", "JSON object")]:
        with pytest.raises(ValueError, match=match):
            PoolerConfig.override(base, bad)


def test_runner_resolution(tmp_path):
    d = str(tmp_path)
    assert resolve_pooling("auto", None, CAUSAL, d) == ("generate", PoolerConfig("LAST", True))
    assert resolve_pooling("auto", None, BARE, d)[0] == "pooling"
    assert resolve_pooling("embed", None, CAUSAL, d)[0] == "pooling"  # --task embed
    assert resolve_pooling("pooling", {"pooling_type": "MEAN"}, CAUSAL, d) == (
        "pooling", PoolerConfig("MEAN", True))
    with pytest.raises(ValueError, match="no LM head"):
        resolve_pooling("generate", None, BARE, d)
    with pytest.raises(ValueError, match="runner must be one of"):
        resolve_pooling("classify", None, CAUSAL, d)
    write_st_files(d, "CLS", normalize=False)  # sentence-transformers files: an embedder
    assert resolve_pooling("auto", None, CAUSAL, d) == ("pooling", PoolerConfig("CLS", False))
    assert resolve_pooling("auto", '{"normalize": true}', CAUSAL, d)[1] == PoolerConfig(
        "CLS", True)
    assert resolve_pooling("generate", None, CAUSAL, d)[0] == "generate"


def test_cli_flags():
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.entrypoints.cli import build_parser

    def kw(*flags):
        return engine_kwargs(build_parser().parse_args(["serve", *flags]))
    assert kw()["runner"] == "auto" and kw()["pooler_config"] is None
    assert kw("--task", "embed")["runner"] == "pooling"
    got = kw("--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}')
    assert got["runner"] == "pooling" and json.loads(got["pooler_config"]) == {
        "pooling_type": "MEAN"}
    with pytest.raises(ValueError, match="contradicts"):
        kw("--task", "embed", "--runner", "generate")


def test_pooling_params_checks():
    for kwargs, param in [(dict(dimensions=True), "dimensions"),
                          (dict(dimensions="8"), "dimensions"),
                          (dict(normalize="yes"), "normalize"),
                          (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                          (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
                          (dict(pooling_type="MAX"), "pooling_type")]:
        with pytest.raises(ParamError) as ei:
            PoolingParams(**kwargs)
        assert ei.value.param == param
    assert PoolingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_chunk_by_chunk_pooling_equals_the_whole_prompt(kind, normalize):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g)
    ref = {"LAST": h[-1], "MEAN": h.mean(dim=0), "CLS": h[0]}[kind]
    ref = F.normalize(ref, dim=-1) if normalize else ref
    state = PoolingState(kind, normalize, 37)
    whole = state.add_chunk(h, 0)
    assert torch.allclose(whole, ref, atol=1e-6, rtol=0)
    assert kind == "MEAN" or torch.equal(whole, ref)
    # preempted halfway, then recomputed in chunks of 8: the first chunk starts over
    assert state.add_chunk(h[:20] * 3.0, 0) is None
    out = None
    for start in range(0, 37, 8):
        out = state.add_chunk(h[start:start + 8], start)
        assert (out is None) == (start + 8 < 37)
    assert torch.allclose(out, ref, atol=1e-6, rtol=0)
    if kind != "MEAN":
        assert torch.equal(out, ref)


def test_the_messages_carry_pooling():
    """An embedding request and its vector cross the process boundaries (engine core
    process, tensor-parallel workers) as msgpack, typed all the way down."""
    import numpy as np

    from tokenmill.core import serial
    from tokenmill.core.sched_output import ModelRunnerOutput, NewRequestData
    from tokenmill.core.scheduler import EngineCoreOutput
    from tokenmill.engine.core_messages import (INPUT_TYPES, CoreOutputs, CoreStats,
                                                EngineCoreRequest)
    from tokenmill.pooling.params import pooling_sampling_params
    pp = PoolingParams(normalize=False, pooling_type="MEAN")
    req = EngineCoreRequest("e", [1, 2], pooling_sampling_params(), [], 1.0, pooling_params=pp)
    back = serial.decode(serial.encode(req), INPUT_TYPES[b"add"])
    assert back == req and back.pooling_params == pp
    new = NewRequestData("e", [1, 2], pooling_sampling_params(), [[1]], 0, pooling_params=pp)
    assert serial.decode(serial.encode(new), NewRequestData).pooling_params == pp
    vec = np.linspace(-1, 1, 7, dtype=np.float32)
    out = ModelRunnerOutput(["e"], {"e": 0}, [[]], pooler_output={"e": vec})
    got = serial.decode(serial.encode(out), ModelRunnerOutput).pooler_output["e"]
    assert got.dtype == np.float32 and np.array_equal(got, vec)
    core = CoreOutputs([EngineCoreOutput("e", [], "stop", pooled=vec)], CoreStats())
    got = serial.decode(serial.encode(core), CoreOutputs).outputs[0].pooled
    assert np.array_equal(got, vec)
