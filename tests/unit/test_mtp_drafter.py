"""The MTP draft head of Qwen3.5 / Qwen3-Next checkpoints (tokenmill/models/mtp.py).

HF transformers does not implement MTP (it ignores mtp.* on load), so the tiny
checkpoints of the hybrid parity suite get their MTP tensors from here: random,
seeded, in an extra `mtp.safetensors` shard listed by `model.safetensors.index.json`,
named and shaped like the target's own full-attention layer (per-expert MoE names,
as HF saves them).

  (1) draft steps through PagedAttention on a real paged KV cache (two sequences,
      scattered blocks: prompt chunks, a chunk that continues a prompt next to a
      decode row, then one-row decode steps that feed back the drafter's own token
      and hidden state) equal a dense reference written here with plain torch ops;
  (2) the loader's errors name the checkpoint and the problem;
  (3) the target still loads and generates HF's tokens from a checkpoint with mtp.*.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import hf_greedy, make_llm, make_prompts
from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk
from tokenmill.attention.torch_ref import TorchAttentionBackend
from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from tokenmill.kernels import cpu_ops
from tokenmill.models.loader import load_model
from tokenmill.models.mtp import MtpDraftModel, load_mtp_drafter, mtp_tensor_names
from tokenmill.spec_decode.random_drafters import mtp_tensors, write_folder
from tokenmill.worker.kv_cache import allocate_kv_caches
from tokenmill.platforms import create_platform

# The hybrid parity suite's tiny configs (tests/models is not on sys.path from here).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from test_hybrid_parity import HYBRID_SPECS, build_hybrid  # noqa: E402

CPU = torch.device("cpu")
BS = 4
TARGETS = ["qwen3_5", "qwen3_next"]  # dense MLP; MoE with a gated shared expert


# ---- checkpoints with an MTP head ------------------------------------------------------

class Ckpt:
    def __init__(self, base: str, path: str, hf, config: dict, mtp: dict):
        self.base, self.path, self.hf, self.config, self.mtp = base, path, hf, config, mtp


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cache: dict[str, Ckpt] = {}

    def get(name: str) -> Ckpt:
        if name not in cache:
            arch, overrides = HYBRID_SPECS[name]
            base = str(tmp_path_factory.mktemp(f"{name}_base"))
            hf = build_hybrid(base, arch, dict(overrides, mtp_num_hidden_layers=1))
            config = json.load(open(os.path.join(base, "config.json")))
            mtp = mtp_tensors(base, seed=7)
            path = str(tmp_path_factory.mktemp(f"{name}_mtp") / "ckpt")
            write_folder(path, base, config, mtp)
            cache[name] = Ckpt(base, path, hf, config, mtp)
        return cache[name]

    return get


# ---- the dense reference ---------------------------------------------------------------

def zc_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def rope(x, pos, rotary_dim, theta):
    """Neox rotary on the first rotary_dim features of each head of x [S, heads, D]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angle = pos.float()[:, None] * inv_freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def reference(cfg: dict, w: dict, embed, lm_head, ids, pos, hidden):
    """One sequence's draft rows, all at once: dense causal attention over rows 0..S-1.
    -> (out [S, H], logits [S, V])."""
    eps, hq, hkv, d = (cfg["rms_norm_eps"], cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], cfg["head_dim"])
    rp = cfg["rope_parameters"]
    rotary_dim = int(d * rp["partial_rotary_factor"])
    assert rotary_dim < d  # partial rotary is exercised
    m = lambda n: w[f"mtp.{n}"]  # noqa: E731
    a = "layers.0.self_attn."
    s = ids.shape[0]
    e = zc_norm(embed[ids], m("pre_fc_norm_embedding.weight"), eps)
    x = torch.cat([e, zc_norm(hidden, m("pre_fc_norm_hidden.weight"), eps)], -1) @ m("fc.weight").T
    # Attention: q_proj gives, per head, D query features then D output-gate features.
    y = zc_norm(x, m("layers.0.input_layernorm.weight"), eps)
    q, gate = (y @ m(a + "q_proj.weight").T).view(s, hq, 2 * d).chunk(2, dim=-1)
    k = (y @ m(a + "k_proj.weight").T).view(s, hkv, d)
    v = (y @ m(a + "v_proj.weight").T).view(s, hkv, d)
    q = rope(zc_norm(q, m(a + "q_norm.weight"), eps), pos, rotary_dim, rp["rope_theta"])
    k = rope(zc_norm(k, m(a + "k_norm.weight"), eps), pos, rotary_dim, rp["rope_theta"])
    k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, hq * d)
    x = x + (o * torch.sigmoid(gate.reshape(s, hq * d))) @ m(a + "o_proj.weight").T
    # MLP: dense, or routed experts (softmax, top-k, renormalised) plus a gated shared one.
    y = zc_norm(x, m("layers.0.post_attention_layernorm.weight"), eps)
    p = "layers.0.mlp."
    if cfg.get("num_experts"):
        probs = torch.softmax(y @ m(p + "gate.weight").T, dim=-1)
        top_w, top_e = probs.topk(cfg["num_experts_per_tok"], dim=-1)
        if cfg.get("norm_topk_prob", True):
            top_w = top_w / top_w.sum(-1, keepdim=True)
        mlp = torch.zeros_like(y)
        for t in range(s):
            for wt, ex in zip(top_w[t], top_e[t].tolist()):
                ep = f"{p}experts.{ex}."
                mlp[t] += wt * swiglu(y[t], m(ep + "gate_proj.weight"), m(ep + "up_proj.weight"),
                                      m(ep + "down_proj.weight"))
        sp = p + "shared_expert."
        mlp += torch.sigmoid(y @ m(p + "shared_expert_gate.weight").T) * swiglu(
            y, m(sp + "gate_proj.weight"), m(sp + "up_proj.weight"), m(sp + "down_proj.weight"))
    else:
        mlp = swiglu(y, m(p + "gate_proj.weight"), m(p + "up_proj.weight"),
                     m(p + "down_proj.weight"))
    out = zc_norm(x + mlp, m("norm.weight"), eps)
    return out, out @ lm_head.T


# ---- (1) paged draft steps vs the dense reference --------------------------------------

class Seq:
    """One request's draft rows so far and its (scattered) blocks."""

    def __init__(self, blocks):
        self.table = torch.tensor(blocks)
        self.ids, self.pos, self.hidden, self.out, self.drafts = [], [], [], [], []

    def __len__(self):
        return len(self.ids)


def run_step(drafter, rows):
    """rows: (seq, ids [n], hidden [n, H]) in batch order, one-token rows (decodes) first.
    Builds the step's AttentionMetadata as the runner does, runs one draft step and
    records inputs and outputs on each seq."""
    nd = 0
    while nd < len(rows) and rows[nd][1].shape[0] == 1:
        nd += 1
    ids, pos, hidden, blocks, offsets, prefills = [], [], [], [], [], []
    start = 0
    for i, (seq, tok, hid) in enumerate(rows):
        n, ctx = tok.shape[0], len(seq)
        p = torch.arange(ctx, ctx + n)
        ids.append(tok), pos.append(p), hidden.append(hid)
        blocks.append(seq.table[p // BS]), offsets.append(p % BS)
        if i >= nd:
            prefills.append(PrefillChunk(start, start + n, ctx, seq.table[:-(-(ctx + n) // BS)]))
        start += n
    meta = AttentionMetadata(num_decodes=nd, slot_block=torch.cat(blocks),
                             slot_offset=torch.cat(offsets), prefills=prefills)
    if nd:
        lens = torch.tensor([len(seq) + 1 for seq, _, _ in rows[:nd]], dtype=torch.int32)
        width = -(-int(lens.max()) // BS)
        meta.decode_block_table = torch.stack(
            [seq.table[:width] for seq, _, _ in rows[:nd]]).to(torch.int32)
        meta.decode_seq_lens = lens
    x_ids, x_pos, x_hidden = torch.cat(ids), torch.cat(pos), torch.cat(hidden)
    out, next_hidden = drafter(x_ids, x_pos, drafter.combine_target_hidden(x_hidden), meta)
    assert torch.equal(out, next_hidden)  # MTP feeds its normed output to the next step
    drafts = drafter.draft_token_ids(out)
    assert drafts.dtype == torch.long and drafts.shape == (out.shape[0],)
    start = 0
    for seq, tok, hid in rows:
        n = tok.shape[0]
        seq.ids += tok.tolist()
        seq.pos += x_pos[start:start + n].tolist()
        seq.hidden.append(hid)
        seq.out.append(out[start:start + n])
        seq.drafts += drafts[start:start + n].tolist()
        start += n


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("name", TARGETS)
@torch.inference_mode()
def test_paged_draft_steps_equal_dense_reference(ckpt, name, native):
    ops = cpu_ops() if native else None
    if native and ops is None:
        pytest.skip("no native CPU kernels (no compiler, or TOKENMILL_NO_NATIVE=1)")
    ck = ckpt(name)
    cfg = ck.config
    platform = create_platform(CPU, torch.float32)
    target = load_model(ck.path, cfg, torch.float32, CPU, platform)
    drafter = load_mtp_drafter(ck.path, target, torch.float32, CPU, platform)
    assert drafter.aux_layer_ids is None
    layer = drafter.layers[0]
    assert not layer.is_linear
    assert (type(layer.mlp).__name__ == "SparseMoeBlock") == bool(cfg.get("num_experts"))
    # The drafter owns no copy of the target's embedding or lm_head.
    assert {n.split(".")[0] for n, _ in drafter.named_parameters()} == {
        "fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "layers", "norm"}

    # The drafter's attention layer is one more layer of the target's KV cache group.
    spec = FullAttentionSpec(BS, cfg["num_key_value_heads"], cfg["head_dim"], "float32")
    caches = allocate_kv_caches(KVCacheConfig(16, [KVCacheGroup(["mtp.layers.0.attn"], spec)]),
                                CPU)
    cache = caches["mtp.layers.0.attn"]
    cache.normal_(0.0, 100.0)  # garbage where nothing was written: a stray read shows
    attn_layers = drafter.attention_layers()
    assert len(attn_layers) == 1
    attn_layers[0].kv_cache = cache
    # Its implementation, as the runner binds it: the platform's choice for the spec.
    pick = platform if native else create_platform(CPU, torch.float32, cpu_kernels="torch")
    backend = pick.attention_backend(spec)
    assert backend.name == ("cpu_native" if native else "torch")
    attn_layers[0].impl = backend.make_impl(attn_layers[0])

    g = torch.Generator().manual_seed(3)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]

    def prompt(n):  # target tokens and stand-ins for the target's final hidden states
        return torch.randint(0, vocab, (n,), generator=g), torch.randn(n, h, generator=g)

    def follow(seq):  # the next draft step of a chain: own draft and own hidden state
        return seq, torch.tensor(seq.drafts[-1:]), seq.out[-1][-1:].clone()

    a, b = Seq([5, 2, 9, 7, 12]), Seq([3, 11, 1, 6, 14])
    run_step(drafter, [(a, *prompt(6)), (b, *prompt(3))])  # two first chunks
    run_step(drafter, [follow(b), (a, *prompt(3))])  # a decode row, then a chunk at 6
    for _ in range(5):
        run_step(drafter, [follow(a), follow(b)])  # one-row steps across block edges
    assert (len(a), len(b)) == (14, 9)

    embed, lm_head = target.embed_tokens.weight, target.lm_head.dense_weight()
    for seq in (a, b):
        ref_out, ref_logits = reference(cfg, ck.mtp, embed, lm_head, torch.tensor(seq.ids),
                                        torch.tensor(seq.pos), torch.cat(seq.hidden))
        torch.testing.assert_close(torch.cat(seq.out), ref_out, atol=1e-5, rtol=1e-5)
        assert seq.drafts == ref_logits.argmax(-1).tolist()


# ---- (2) loader errors -----------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_next_target(ckpt):
    ck = ckpt("qwen3_next")
    return ck, load_model(ck.path, ck.config, torch.float32, CPU,
                          create_platform(CPU, torch.float32))


def _load(path, target):
    return load_mtp_drafter(path, target, torch.float32, CPU, create_platform(CPU, torch.float32))


def test_loader_errors_name_the_problem(qwen3_next_target, tmp_path):
    ck, target = qwen3_next_target
    no_field = {k: v for k, v in ck.config.items() if k != "mtp_num_hidden_layers"}
    cases = {
        "no_field": (no_field, ck.mtp, "sets no mtp_num_hidden_layers"),
        "no_tensors": (ck.config, None, "has no MTP weights"),
        "two_layers": (dict(ck.config, mtp_num_hidden_layers=2), ck.mtp,
                       "mtp_num_hidden_layers must be 1"),
    }
    for case, (config, mtp, message) in cases.items():
        path = str(tmp_path / case)
        write_folder(path, ck.base, config, mtp)
        with pytest.raises(ValueError, match=message) as err:
            _load(path, target)
        assert path in str(err.value)

    def broken(case, mtp, *names):
        path = str(tmp_path / case)
        write_folder(path, ck.base, ck.config, mtp)
        with pytest.raises(ValueError) as err:
            _load(path, target)
        text = str(err.value)
        assert path in text and "MTP" in text and all(n in text for n in names), text

    drop = lambda *names: {n: t for n, t in ck.mtp.items() if n not in names}  # noqa: E731
    broken("no_norm", drop("mtp.norm.weight"), "lacks weights", "norm.weight")
    broken("no_k_proj", drop("mtp.layers.0.self_attn.k_proj.weight"), "lacks",
           "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.qkv_proj")
    broken("no_expert", drop("mtp.layers.0.mlp.experts.2.up_proj.weight"), "lacks experts",
           "2.up_proj")
    broken("unknown", dict(ck.mtp, **{"mtp.layers.0.extra.weight": torch.zeros(3)}),
           "layers.0.extra.weight", "matches no parameter")
    broken("bad_shape", dict(ck.mtp, **{"mtp.fc.weight": torch.zeros(3, 3)}), "fc.weight",
           "(3, 3)")
    with pytest.raises(ValueError, match="needs a Qwen3-Next / Qwen3.5 or DeepSeek-V3 target"):
        _load(ck.path, torch.nn.Linear(2, 2))


def test_mtp_tensors_are_found_under_model_mtp_too(qwen3_next_target, tmp_path):
    ck, target = qwen3_next_target
    path = str(tmp_path / "nested")
    write_folder(path, ck.base, ck.config, {"model." + n: t for n, t in ck.mtp.items()})
    drafter = _load(path, target)
    assert isinstance(drafter, MtpDraftModel)
    assert torch.equal(drafter.norm.weight, ck.mtp["mtp.norm.weight"])


# ---- (3) the target is unchanged by an MTP head in its checkpoint -----------------------

@pytest.mark.parametrize("name", TARGETS)
def test_target_loads_and_runs_from_checkpoint_with_mtp(ckpt, name):
    ck = ckpt(name)
    assert len(mtp_tensor_names(ck.path)) == len(ck.mtp) and not mtp_tensor_names(ck.base)
    prompt = make_prompts([11], ck.config["vocab_size"], seed=9)[0]
    llm = make_llm(ck.path, max_model_len=64)
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(ck.hf, prompt, 8)


def _greedy(n):
    from tokenmill import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_write_kv_writes_what_forward_writes(qwen3_next_target):
    """write_kv (the proposer's pass over a step's tokens) leaves the same K/V in the
    cache as the full forward: a prompt chunk, then a chunk at a cached prefix."""
    ck, target = qwen3_next_target
    drafter = _load(ck.path, target)
    cfg = ck.config
    spec = FullAttentionSpec(BS, cfg["num_key_value_heads"], cfg["head_dim"], "float32")
    table = torch.tensor([3, 1, 4, 0, 5, 2, 6, 7])
    g = torch.Generator().manual_seed(5)
    n = 13
    ids = torch.randint(0, cfg["vocab_size"], (n,), generator=g)
    hidden = torch.randn(n, cfg["hidden_size"], generator=g)
    caches = []
    with torch.inference_mode():
        for use_write_kv in (False, True):
            cache = allocate_kv_caches(
                KVCacheConfig(9, [KVCacheGroup(["mtp.layers.0.attn"], spec)]), CPU)
            layer = drafter.attention_layers()[0]
            layer.kv_cache = cache["mtp.layers.0.attn"]
            layer.impl = TorchAttentionBackend().make_impl(layer)
            for s, e in ((0, 6), (6, n)):
                pos = torch.arange(s, e)
                meta = AttentionMetadata(
                    num_decodes=0, slot_block=table[pos // BS], slot_offset=pos % BS,
                    prefills=[PrefillChunk(0, e - s, s, table[:-(-e // BS)])])
                if use_write_kv:
                    drafter.write_kv(ids[s:e], pos, hidden[s:e], meta)
                else:
                    drafter(ids[s:e], pos, hidden[s:e], meta)
            caches.append(cache["mtp.layers.0.attn"].clone())
    torch.testing.assert_close(caches[1], caches[0], atol=1e-5, rtol=1e-5)
    assert caches[0].abs().sum() > 0
