"""The EAGLE-3 draft model (tokenmill/models/eagle3.py) against a plain-torch reference.

The drafter runs through PagedAttention over a real paged KV cache (a prompt in two
chunks, then one-row decode steps that feed it its own next_hidden, as the runner's
draft loop does); the reference computes the same rows densely over the whole
sequence with explicit norms, rotary and causal attention, from the raw tensors the
checkpoint builder wrote (so loading is checked too).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY
from tokenmill.spec_decode.random_drafters import (build_eagle3_checkpoint, eagle3_config,
                                                   eagle3_tensors, write_eagle3_checkpoint)
from tokenmill import kernels
from tokenmill.core.kv_cache_spec import FullAttentionSpec
from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.models.eagle3 import Eagle3DraftModel, default_aux_layer_ids, load_eagle3_drafter
from tokenmill.models.loader import load_model
from tokenmill.spec_decode.draft_model import EagleStyleDrafter
from tokenmill.worker.kv_cache import _allocate_layer

BLOCK = 4
TABLE = torch.tensor([9, 3, 12, 6, 1], dtype=torch.long)  # scattered on purpose
CHUNKS = [(0, 5), (5, 11)]  # the second chunk reads the first from the cache
NUM_STEPS = 5  # one-row draft steps after the chunks: positions 11..15


def _platform(dtype, native: bool):
    return CpuPlatform.create("cpu", dtype, cpu_kernels="auto" if native else "torch")


def _native_ops():
    ops = kernels.cpu_ops()
    if ops is None:
        pytest.skip("no native CPU kernels (no compiler, or TOKENMILL_NO_NATIVE=1)")
    return ops


@pytest.fixture(scope="module")
def target_fp32(llama_tiny):
    return load_model(llama_tiny.path, llama_tiny.hf_config, torch.float32,
                      torch.device("cpu"), _platform(torch.float32, False))


# name -> (builder keywords): own embedding under a model. prefix; the target's embedding;
# the residual stream starting from the normed hidden state.
VARIANTS = {
    "own_embed_prefixed": dict(with_embedding=True, prefix="model."),
    "shared_embed": dict(with_embedding=False),
    "norm_before_residual": dict(with_embedding=True, norm_before_residual=True),
    # the HF-decoder naming of the one layer (layers.0.*), under model.
    "layers_0_naming": dict(with_embedding=True, prefix="model.", layer_prefix="layers.0."),
}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            path = str(tmp_path_factory.mktemp(f"eagle3_{name}"))
            cache[name] = (path, *build_eagle3_checkpoint(path, TINY, **VARIANTS[name]))
        return cache[name]
    return get


# ---- the reference --------------------------------------------------------------------
def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, pos, theta):
    """Neox rotary on [N, heads, D] at positions [N], written out."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None, :]
    cos = torch.cat([ang.cos()] * 2, -1)[:, None].float()
    sin = torch.cat([ang.sin()] * 2, -1)[:, None].float()
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference(cfg, t, embed, ids, hidden):
    """(out, next_hidden) of every position 0..N-1 of one sequence, densely."""
    m = "midlayer."
    n, hq, hkv = ids.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // hq
    pos = torch.arange(n)
    h = _rms(hidden, t[m + "hidden_norm.weight"])
    x = torch.cat([_rms(embed[ids], t[m + "input_layernorm.weight"]), h], -1)
    q = _rotate((x @ t[m + "self_attn.q_proj.weight"].T).view(n, hq, d), pos, cfg["rope_theta"])
    k = _rotate((x @ t[m + "self_attn.k_proj.weight"].T).view(n, hkv, d), pos, cfg["rope_theta"])
    v = (x @ t[m + "self_attn.v_proj.weight"].T).view(n, hkv, d)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, hq * d)
    residual = h if cfg.get("norm_before_residual") else hidden
    r = residual + attn @ t[m + "self_attn.o_proj.weight"].T
    y = _rms(r, t[m + "post_attention_layernorm.weight"])
    r = r + (F.silu(y @ t[m + "mlp.gate_proj.weight"].T) * (y @ t[m + "mlp.up_proj.weight"].T)
             ) @ t[m + "mlp.down_proj.weight"].T
    return _rms(r, t["norm.weight"]), r


# ---- running the module over a paged cache -------------------------------------------
def _chunk_meta(s, e):
    pos = torch.arange(s, e)
    return AttentionMetadata(num_decodes=0, slot_block=TABLE[pos // BLOCK], slot_offset=pos % BLOCK,
                             prefills=[PrefillChunk(0, e - s, s, TABLE[:-(-e // BLOCK)])])


def _decode_meta(p):
    nb = -(-(p + 1) // BLOCK)
    return AttentionMetadata(num_decodes=1, slot_block=TABLE[p // BLOCK].view(1),
                             slot_offset=torch.tensor([p % BLOCK]),
                             decode_block_table=TABLE[None, :nb].to(torch.int32),
                             decode_seq_lens=torch.tensor([p + 1], dtype=torch.int32))


def _bind(layer, spec, platform):
    """A fresh cache and the platform's attention implementation, as the runner binds."""
    layer.kv_cache = _allocate_layer(spec, 16, torch.device("cpu"))
    layer.impl = platform.attention_backend(spec).make_impl(layer)


def run_sequence(model, platform, dtype, seed=0):
    """Chunks from fresh target hidden states, then draft steps on the model's own output.
    -> (ids, hidden inputs, outs, next_hiddens, combined) over all positions, in fp32."""
    layer = model.attention_layers()[0]
    spec = FullAttentionSpec(BLOCK, layer.num_kv_heads, layer.head_size, str(dtype)[6:])
    _bind(layer, spec, platform)
    g = torch.Generator().manual_seed(seed)
    n = CHUNKS[-1][1] + NUM_STEPS
    ids = torch.randint(0, TINY["vocab_size"], (n,), generator=g)
    aux = torch.randn(CHUNKS[-1][1], len(model.aux_layer_ids) * TINY["hidden_size"],
                      generator=g)
    hiddens, outs, nexts = [], [], []
    with torch.inference_mode():
        combined = model.combine_target_hidden(aux.to(dtype))
        for s, e in CHUNKS:
            hid = combined[s:e]
            out, nxt = model(ids[s:e], torch.arange(s, e), hid, _chunk_meta(s, e))
            hiddens.append(hid), outs.append(out), nexts.append(nxt)
        for p in range(CHUNKS[-1][1], n):
            hid = nexts[-1][-1:]  # the previous step's pre-norm stream at p - 1
            out, nxt = model(ids[p:p + 1], torch.tensor([p]), hid, _decode_meta(p))
            hiddens.append(hid), outs.append(out), nexts.append(nxt)
    f = lambda xs: torch.cat(xs).float()  # noqa: E731
    return ids, aux, f(hiddens), f(outs), f(nexts), combined.float()


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_dense_reference(drafts, target_fp32, variant, native):
    if native:
        _native_ops()
    platform = _platform(torch.float32, native)
    path, cfg, t = drafts(variant)
    model = load_eagle3_drafter(path, target_fp32, torch.float32, torch.device("cpu"), platform)
    # EagleStyleDrafter is a plain Protocol (not runtime-checkable): its members, by name.
    assert all(hasattr(model, m) for m in EagleStyleDrafter.__annotations__.keys()
               | {"combine_target_hidden", "forward", "draft_token_ids", "attention_layers"})
    embed = t["embed_tokens.weight"] if "embed_tokens.weight" in t else \
        target_fp32.embed_tokens.weight.detach()
    ids, aux, hidden, out, nxt, combined = run_sequence(model, platform, torch.float32)
    # Checked after the steps: the chunks' `hidden` (slices of combined) were not written.
    torch.testing.assert_close(combined, aux @ t["fc.weight"].T, atol=1e-5, rtol=1e-5)
    # The steps' inputs were the module's own outputs: the reference takes the same rows.
    ref_out, ref_next = reference(cfg, t, embed, ids, hidden)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nxt, ref_next, atol=1e-5, rtol=1e-5)
    # The logits are far from flat: a wrong weight would move the drafts.
    logits = out @ t["lm_head.weight"].T
    assert (logits.max(-1).values - logits.median(-1).values).min() > 1.0


def test_bf16_with_the_platforms_kernels(drafts, llama_tiny):
    """bf16 as the engine runs it: the platform packs the drafter's Linear layers (the
    2H-wide qkv_proj too) and the native attention kernels run; close to the fp32 math."""
    platform = _platform(torch.bfloat16, True)
    target = load_model(llama_tiny.path, llama_tiny.hf_config, torch.bfloat16,
                        torch.device("cpu"), platform)
    path, cfg, t = drafts("shared_embed")
    model = load_eagle3_drafter(path, target, torch.bfloat16, torch.device("cpu"), platform)
    ids, aux, hidden, out, nxt, combined = run_sequence(model, platform, torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16 or (
        model.lm_head.method.packed_dtype == torch.bfloat16)
    # (the embedding's rows through its module: a tied head's packed copy may hold them)
    vocab = torch.arange(target.embed_tokens.num_embeddings)
    with torch.inference_mode():
        embedding = target.embed_tokens(vocab).float()
    ref_out, ref_next = reference(cfg, t, embedding, ids, hidden)
    for got, ref in ((out, ref_out), (nxt, ref_next)):
        assert ((got - ref).norm() / ref.norm()) < 3e-2


def test_draft_token_ids_map_through_d2t(drafts, target_fp32):
    path, cfg, t = drafts("own_embed_prefixed")
    model = load_eagle3_drafter(path, target_fp32, torch.float32, torch.device("cpu"),
                                _platform(torch.float32, False))
    out = torch.randn(32, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = model.draft_token_ids(out)
    draft = (out @ t["lm_head.weight"].T).argmax(-1)
    expected = draft + t["d2t"][draft]
    assert got.dtype == torch.long and got.tolist() == expected.tolist()
    assert (got != draft).any()  # the map is not the identity here
    assert bool(model.t2d[got].all()) and int(model.t2d.sum()) == cfg["draft_vocab_size"]


# ---- loader errors --------------------------------------------------------------------
def _load(path, target):
    return load_eagle3_drafter(str(path), target, torch.float32, torch.device("cpu"),
                               _platform(torch.float32, False))


def _write(path, cfg=None, tensors=None, **kw):
    cfg = cfg or eagle3_config(TINY)
    tensors = tensors if tensors is not None else eagle3_tensors(TINY)
    return write_eagle3_checkpoint(str(path), cfg, tensors, **kw)


@pytest.mark.parametrize("drop", ["midlayer.self_attn.k_proj.weight", "norm.weight", "d2t"])
def test_missing_tensor_is_named(tmp_path, target_fp32, drop):
    t = eagle3_tensors(TINY)
    del t[drop]
    with pytest.raises(ValueError, match=f"lacks .*{drop}"):
        _load(_write(tmp_path, tensors=t, prefix="model."), target_fp32)


def test_unknown_tensor_is_named(tmp_path, target_fp32):
    t = eagle3_tensors(TINY)
    t["midlayer.self_attn.extra_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="no place for.*midlayer.self_attn.extra_proj.weight"):
        _load(_write(tmp_path, tensors=t), target_fp32)


def test_a_second_layer_is_refused_by_name(tmp_path, target_fp32):
    """`layers.0.*` is the one layer; a head with `layers.1.*` has a layer this drafter
    does not build."""
    t = eagle3_tensors(TINY)
    t["layers.1.input_layernorm.weight"] = torch.ones(64)
    with pytest.raises(ValueError, match="no place for.*layers.1.input_layernorm.weight"):
        _load(_write(tmp_path, tensors=t), target_fp32)


def test_vocab_mismatch(tmp_path, target_fp32):
    cfg = eagle3_config(TINY, vocab_size=500)
    with pytest.raises(ValueError, match="vocab_size 500 != the target's 384"):
        _load(_write(tmp_path, cfg=cfg), target_fp32)


def test_fc_width_mismatch(tmp_path, target_fp32):
    t = eagle3_tensors(TINY, num_aux=2)  # fc [64, 128]; the target wants 3 x 64
    with pytest.raises(ValueError, match=r"fc.weight is \(64, 128\).*192 wide"):
        _load(_write(tmp_path, tensors=t), target_fp32)


def test_shape_mismatch_and_bad_d2t(tmp_path, target_fp32):
    t = eagle3_tensors(TINY)
    t["lm_head.weight"] = torch.zeros(95, TINY["hidden_size"])
    with pytest.raises(ValueError, match="lm_head.weight: checkpoint shape"):
        _load(_write(tmp_path / "a", tensors=t), target_fp32)
    t = eagle3_tensors(TINY)
    t["d2t"][-1] = TINY["vocab_size"]  # the last draft id past the target vocabulary
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        _load(_write(tmp_path / "b", tensors=t), target_fp32)


# ---- aux layer ids --------------------------------------------------------------------
@pytest.mark.parametrize("layers,ids", [(32, (2, 16, 29)), (80, (2, 40, 77)), (7, (2, 3, 4)),
                                        (6, (1, 3, 5)), (4, (1, 2, 3)), (2, (1, 1, 1)),
                                        (1, (0, 0, 0))])
def test_default_aux_layer_ids(layers, ids):
    assert default_aux_layer_ids(layers) == ids


def test_aux_layer_ids_from_eagle_config(tmp_path, target_fp32):
    path = str(tmp_path / "ok")
    build_eagle3_checkpoint(path, TINY, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]})
    model = _load(path, target_fp32)
    assert model.aux_layer_ids == (0, 1) and model.fc.in_features == 2 * TINY["hidden_size"]
    assert _load(_write(tmp_path / "default"), target_fp32).aux_layer_ids == (1, 1, 1)
    with pytest.raises(ValueError, match=r"\[1, 2\].*0\.\.1"):
        Eagle3DraftModel(eagle3_config(TINY, eagle_config={
            "eagle_aux_hidden_state_layer_ids": [1, 2]}), target_fp32)


def test_kv_layer_and_positions_fit_the_target(drafts, target_fp32):
    """The drafter's one attention layer has the target's KV shape here (as the published
    Llama-3.1 drafters do), so it can join the target's KV cache group; its rotary table
    covers the target's positions although its own config says 64."""
    path, cfg, _ = drafts("shared_embed")
    model = _load(path, target_fp32)
    layer, tl = model.attention_layers()[0], target_fp32.attention_layers()[0]
    assert (layer.num_kv_heads, layer.head_size) == (tl.num_kv_heads, tl.head_size)
    assert cfg["max_position_embeddings"] == 64
    assert model.rotary.cos_cache.shape[0] == TINY["max_position_embeddings"]


def test_pytorch_model_bin(tmp_path, drafts, target_fp32):
    """Some published drafters ship pytorch_model.bin only: the same weights load from it."""
    path, cfg, t = drafts("own_embed_prefixed")
    write_eagle3_checkpoint(str(tmp_path), cfg, {})
    (tmp_path / "model.safetensors").unlink()
    torch.save(t, tmp_path / "pytorch_model.bin")
    a, b = _load(path, target_fp32), _load(tmp_path, target_fp32)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_write_kv_writes_what_forward_writes(drafts, target_fp32, native):
    """write_kv (the proposer's pass over a step's tokens) leaves the same K/V in the
    cache as the full forward, for a chunk at a cached prefix."""
    if native:
        _native_ops()
    platform = _platform(torch.float32, native)
    path, cfg, t = drafts(list(VARIANTS)[0])
    model = load_eagle3_drafter(path, target_fp32, torch.float32, torch.device("cpu"), platform)
    layer = model.attention_layers()[0]
    spec = FullAttentionSpec(BLOCK, layer.num_kv_heads, layer.head_size, "float32")
    g = torch.Generator().manual_seed(3)
    e = CHUNKS[-1][1]
    ids = torch.randint(0, TINY["vocab_size"], (e,), generator=g)
    aux = torch.randn(e, len(model.aux_layer_ids) * TINY["hidden_size"], generator=g)
    caches = []
    with torch.inference_mode():
        hid = model.combine_target_hidden(aux)
        for use_write_kv in (False, True):
            _bind(layer, spec, platform)
            for s, end in CHUNKS:
                meta = _chunk_meta(s, end)
                if use_write_kv:
                    model.write_kv(ids[s:end], torch.arange(s, end), hid[s:end], meta)
                else:
                    model(ids[s:end], torch.arange(s, end), hid[s:end], meta)
            caches.append(layer.kv_cache.clone())
    torch.testing.assert_close(caches[1], caches[0], atol=1e-5, rtol=1e-5)
    assert caches[0].abs().sum() > 0
