"""Gemma 4 beyond HF parity (test_hf_parity / test_logprobs run every gemma4* spec of
conftest.MODEL_SPECS): KV-shared layers keep no cache of their own, the config fields
that are refused, and the vision-language checkpoint loaded as its text model."""
from __future__ import annotations

import pytest

from conftest import make_llm, runner_of
from tokenmill import SamplingParams
from tokenmill.core.kv_cache_spec import KVCacheConfig, group_layer_specs
from tokenmill.models.gemma4 import Gemma4Config, Gemma4ForCausalLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
IMAGE_TOKEN = 383  # the tiny vision-language checkpoint's image placeholder id


@pytest.mark.parametrize("name,shared", [("gemma4_kvshare", {2: 0, 3: 1}),
                                         ("gemma4_all", {3: 1, 4: 1, 5: 2})])
def test_kv_shared_layers_allocate_no_cache(tiny_model_factory, name, shared):
    """The shared layers get no spec, no buffer and no group: they are bound to their
    source's cache and group. Here half the layers share, so a block costs half the
    bytes it would if every layer kept its own K/V (one KV buffer instead of two)."""
    tm = tiny_model_factory(name)
    bs = 4
    llm = make_llm(tm.path, block_size=bs)
    runner = runner_of(llm)
    config = llm.llm_engine.engine_core.kv_cache_config
    layers = runner.attention_layers()
    num_layers = tm.hf_config["num_hidden_layers"]
    assert runner.kv_sharing_targets() == {f"layers.{i}.attn": f"layers.{j}.attn"
                                           for i, j in shared.items()}
    own = {f"layers.{i}.attn" for i in range(num_layers) if i not in shared}
    assert set(runner.kv_caches) == own
    assert {n for g in config.groups for n in g.layer_names} == own
    for i, j in shared.items():
        a, b = layers[f"layers.{i}.attn"], layers[f"layers.{j}.attn"]
        assert a.kv_cache is b.kv_cache and a.kv_group == b.kv_group
    # The same layers, each with a cache of its own: twice the bytes per block.
    every = {n: runner._layer_spec(layer, bs) for n, layer in layers.items()}
    unshared = KVCacheConfig(1, group_layer_specs(every))
    page = max(spec.page_size_bytes for spec in every.values())
    assert unshared.buffer_page_sizes() == [page] * 2
    assert config.buffer_page_sizes() == [page]
    assert config.bytes_per_block() * 2 == unshared.bytes_per_block()
    storages = {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes()
                for c in runner.kv_caches.values()}
    assert sum(storages.values()) == config.num_blocks * config.bytes_per_block()
    prompt = tm.prompts[4]  # 70 tokens: past the window
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == tm.reference(prompt)


def _config(**kw) -> dict:
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"] * 2,
               hidden_size_per_layer_input=0)
    cfg.update(kw)
    return cfg


def test_kv_sources_follow_hf():
    """The last num_kv_shared_layers layers read the last earlier layer of their kind."""
    c = Gemma4Config(_config(num_hidden_layers=7, num_kv_shared_layers=3,
                             layer_types=["sliding_attention"] * 2 + ["full_attention"]
                             + ["sliding_attention"] * 3 + ["full_attention"]))
    assert c.kv_source == [None, None, None, None, 3, 3, 2]


@pytest.mark.parametrize("kw,field", [
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(num_kv_shared_layers=4), "num_kv_shared_layers"),
    (dict(num_kv_shared_layers=3, layer_types=["full_attention"] + ["sliding_attention"] * 2
          + ["full_attention"]), "num_kv_shared_layers"),
    (dict(enable_moe_block=True, num_experts=4, moe_intermediate_size=8), "top_k_experts"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=8),
     "top_k_experts"),
    (dict(hidden_size_per_layer_input=4, vocab_size_per_layer_input=32),
     "vocab_size_per_layer_input"),
])
def test_unsupported_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        Gemma4Config(_config(**kw))


def test_global_shape_from_fields_without_per_layer_config():
    """Hub config.json files may carry global_head_dim / num_global_key_value_heads
    instead of per_layer_config: the global layers get the same shapes HF gives them."""
    c = Gemma4Config(_config(global_head_dim=64, num_global_key_value_heads=1))
    assert c.head_dims == [16, 64, 16, 64] and c.kv_heads == [1, 1, 1, 1]
    c = Gemma4Config(_config(num_key_value_heads=2, global_head_dim=64,
                             num_global_key_value_heads=1, attention_k_eq_v=True))
    assert c.head_dims == [16, 64, 16, 64] and c.kv_heads == [2, 1, 2, 1]
    import transformers as tf
    hf = tf.Gemma4TextConfig(**_config(num_key_value_heads=2, global_head_dim=64,
                                       num_global_key_value_heads=1, attention_k_eq_v=True))
    assert [hf.per_layer_config[i].head_dim for i in range(4)] == c.head_dims
    assert [hf.per_layer_config[i].num_key_value_heads for i in range(4)] == c.kv_heads


def test_vision_bidirectional_attention_is_causal_for_text():
    """"vision" makes image tokens attend both ways; a text-only model has none."""
    assert Gemma4Config(_config(use_bidirectional_attention="vision")).num_layers == 4


@pytest.fixture(scope="module")
def gemma4_vlm(tmp_path_factory):
    """A Gemma4ForConditionalGeneration checkpoint (as the hub ships Gemma 4): the
    gemma4_all text model under model.language_model, a one-layer vision tower."""
    import warnings

    import torch
    import transformers as tf

    from conftest import MODEL_SPECS, TINY, TinyModel
    path = str(tmp_path_factory.mktemp("gemma4_vlm"))
    text = dict(TINY, **MODEL_SPECS["gemma4_all"][1], pad_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tf.Gemma4Config(
            text_config=tf.Gemma4TextConfig(**text),
            vision_config=tf.Gemma4VisionConfig(hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=2,
                                                num_key_value_heads=2, head_dim=8),
            audio_config=None, image_token_id=IMAGE_TOKEN)
        model = tf.Gemma4ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return TinyModel("gemma4_vlm", path, "gemma4", model)


def test_conditional_generation_checkpoint_runs_its_text_model(gemma4_vlm, caplog):
    """The towers' tensors are skipped (one log line; any other tensor the text model
    has no place for would fail the load), the text
    model loads, and its greedy tokens equal HF's Gemma4ForConditionalGeneration on
    text alone: a mixed batch, prompts chunked past the window, one with an image
    placeholder id (embedded as the pad token, as HF does without an image)."""
    import logging

    from conftest import scheduler_of
    tm = gemma4_vlm
    assert tm.hf_config["architectures"] == ["Gemma4ForConditionalGeneration"]
    with caplog.at_level(logging.INFO):
        llm = make_llm(tm.path, max_num_batched_tokens=16, block_size=4)
    assert "loading the text model only" in caplog.text
    prompts = tm.prompts
    prompts[2] = prompts[2][:10] + [IMAGE_TOKEN] + prompts[2][10:]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == tm.reference(p), len(p)
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("form", ["per_layer_config", "global_head_dim"])
def test_tensor_parallel_rank_config_splits_each_layer(form):
    """A rank's model: every layer's heads split at its own head_dim (unchanged per
    head), the global layers' KV heads split, or replicated when fewer than ranks, in
    either config form (per_layer_config, or the older global_head_dim /
    num_global_key_value_heads). (TP=2 parity: tests/test_tensor_parallel.py.)"""
    from tokenmill.models.tensor_parallel import check_divisible, rank_config
    for global_kv, rank_kv in ((4, 2), (1, 1)):
        if form == "per_layer_config":
            glob = {"head_dim": 32, "num_key_value_heads": global_kv}
            cfg = _config(num_attention_heads=4, num_key_value_heads=2,
                          per_layer_config={"1": glob, "3": glob})
        else:
            cfg = _config(num_attention_heads=4, num_key_value_heads=2, global_head_dim=32,
                          attention_k_eq_v=True, num_global_key_value_heads=global_kv)
        check_divisible(cfg, 2, Gemma4ForCausalLM)
        c = Gemma4Config(rank_config(cfg, 2, Gemma4ForCausalLM))
        assert c.num_heads == 2 and c.head_dims == [16, 32, 16, 32]
        assert c.kv_heads == [1, rank_kv, 1, rank_kv]
        assert Gemma4Config(cfg).kv_heads == [2, global_kv, 2, global_kv]  # not mutated


@pytest.mark.parametrize("form", ["per_layer_config", "global_head_dim"])
def test_tensor_parallel_refuses_uneven_global_kv_heads(form):
    """Global layers whose KV heads neither split over the ranks nor are fewer than
    them are refused by name, before any rank starts."""
    from tokenmill.models.tensor_parallel import check_divisible
    if form == "per_layer_config":
        cfg = _config(num_attention_heads=6, num_key_value_heads=2,
                      per_layer_config={i: {"head_dim": 32, "num_key_value_heads": 3}
                                        for i in ("1", "3")})
    else:
        cfg = _config(num_attention_heads=6, num_key_value_heads=2, global_head_dim=32,
                      attention_k_eq_v=True, num_global_key_value_heads=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*num_key_value_heads of "
                                         "layer 1 .*\\(3\\)"):
        check_divisible(cfg, 2, Gemma4ForCausalLM)
