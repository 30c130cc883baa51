"""The DFlash drafter (tokenmill/models/dflash.py) against a naive reference.

The reference below reads the draft's safetensors and the HF target's embedding /
lm_head directly and runs the block position by position, head by head, in fp64:
context rows fc -> hidden_norm -> k/v projection -> k-norm -> rotary at the row's
position; block rows embedded [last token, mask x k] at p..p+k, each query attending
to every context row and every block row (no causal mask); drafts from rows 1..k.

The drafter keeps its context in a paged KV cache (the runner's, in the engine):
`PagedContext` below gives its layers one, with a block table row per request, and
writes and reads it through the CPU platform's attention backend and builder.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import numpy as np

from conftest import build_checkpoint, make_prompts
from tokenmill.core.kv_cache_spec import FullAttentionSpec
from tokenmill.spec_decode.random_drafters import build_dflash_checkpoint
from tokenmill.models.dflash import load_dflash_drafter
from tokenmill.worker.block_table import BlockTable
from tokenmill.models.loader import load_model
from tokenmill.platforms import create_platform

CPU = torch.device("cpu")
TAPS = (0, 1)  # target layers whose outputs the context reads (of 3)
K = 4


class Pair:
    def __init__(self, root):
        self.target_path = os.path.join(root, "target")
        self.hf = build_checkpoint(self.target_path, "qwen3",
                                   dict(num_hidden_layers=3, tie_word_embeddings=False))
        self.target_config = json.load(open(os.path.join(self.target_path, "config.json")))
        self.target = load_model(self.target_path, self.target_config, torch.float32, CPU,
                                 create_platform(CPU, torch.float32))

    def draft(self, name, root, **kw):
        path = os.path.join(root, name)
        kw.setdefault("target_layer_ids", TAPS)
        build_dflash_checkpoint(path, self.target_config, **kw)
        return path

    @torch.inference_mode()
    def target_hidden(self, tokens):
        """The target's hidden states after the TAPS layers, concatenated [T, 2H]."""
        hs = self.hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        return torch.cat([hs[i + 1][0] for i in TAPS], dim=-1)

    @torch.inference_mode()
    def next_token(self, tokens):
        return int(self.hf(torch.tensor([tokens])).logits[0, -1].argmax())


class PagedContext:
    """The draft layers' paged KV cache as the runner keeps it: caches bound to the
    drafter's layers, one block table row per request (blocks of 4, none shared),
    the context written and the blocks drafted through the platform's builder."""

    BLOCK, PER_REQ = 4, 16

    def __init__(self, drafter, num_reqs: int = 4, backend=None):
        """`backend`: the platform's (None) or another attention backend."""
        self.drafter = drafter
        layers = drafter.attention_layers()
        dtype = drafter.norm.weight.dtype
        spec = FullAttentionSpec(self.BLOCK, layers[0].num_kv_heads, layers[0].head_size,
                                 str(dtype).removeprefix("torch."), None)
        backend = backend or create_platform(CPU, dtype).attention_backend(spec)
        self.builder = backend.make_builder(CPU)
        num_blocks = 1 + num_reqs * self.PER_REQ  # block 0: the null block
        for layer in layers:
            layer.kv_cache = torch.zeros(spec.cache_shape(num_blocks), dtype=dtype)
            layer.kv_group, layer.impl = None, backend.make_impl(layer)
        self.table = BlockTable(num_reqs, self.PER_REQ, self.BLOCK)
        for r in range(num_reqs):
            self.table.add_row(list(range(1 + r * self.PER_REQ, 1 + (r + 1) * self.PER_REQ)), r)
        self.rows: dict[str, int] = {}

    def row(self, req_id: str) -> int:
        return self.rows.setdefault(req_id, len(self.rows))

    def append_batch(self, req_ids, counts, positions, hidden) -> None:
        rows = np.repeat([self.row(r) for r in req_ids], counts)
        pos = np.asarray(positions, dtype=np.int64)
        self.drafter.write_context(hidden, torch.from_numpy(pos),
                                   self.builder.write_only(self.table, rows, pos))

    def append(self, req_id, positions, hidden) -> None:
        self.append_batch([req_id], [len(positions)], positions, hidden)

    def kv(self, req_id: str, n: int) -> torch.Tensor:
        """Every layer's K/V at positions 0..n-1 of the request [L, 2, n, Hkv, D]."""
        blocks = self.table.block_table[self.row(req_id)]
        pos = np.arange(n)
        return torch.stack([layer.kv_cache[blocks[pos // self.BLOCK], :, pos % self.BLOCK]
                            .transpose(0, 1) for layer in self.drafter.attention_layers()])

    def metas(self, req_ids, positions, k):
        return self.drafter.block_metas(self.builder, self.table,
                                        np.array([self.row(r) for r in req_ids]),
                                        np.asarray(positions, dtype=np.int64), k)

    def logits(self, req_ids, lasts, positions, k, drafter=None):
        return (drafter or self.drafter).draft_logits(lasts, positions, k,
                                                      self.metas(req_ids, positions, k))

    def propose(self, req_ids, lasts, positions, k):
        return self.drafter.propose(lasts, positions, k, self.metas(req_ids, positions, k))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dflash"))
    p = Pair(root)
    p.root = root
    p.draft_path = p.draft("draft", root)
    p.drafter = load_dflash_drafter(p.draft_path, p.target, torch.float32, CPU,
                                    create_platform(CPU, torch.float32))
    return p


def naive_block_logits(draft_path, embed, lm_head, ctx_hidden, ctx_pos, last, p, k):
    """Logits [k, V] of the block rows 1..k, with plain loops (fp64)."""
    w = {n: t.double() for n, t in load_file(os.path.join(draft_path,
                                                          "model.safetensors")).items()}
    cfg = json.load(open(os.path.join(draft_path, "config.json")))
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    mask_id = cfg["dflash_config"]["mask_token_id"]
    embed, lm_head = embed.detach().double(), lm_head.detach().double()

    def rms(x, weight):
        return x / math.sqrt(float((x * x).mean()) + eps) * weight

    def rope(x, pos):  # neox: pairs (i, i + d/2)
        out, half = x.clone(), d // 2
        for i in range(half):
            ang = pos / theta ** (2 * i / d)
            c, s = math.cos(ang), math.sin(ang)
            out[i] = x[i] * c - x[i + half] * s
            out[i + half] = x[i + half] * c + x[i] * s
        return out

    def heads(x, n):
        return [x[j * d:(j + 1) * d] for j in range(n)]

    ctx = [rms(w["fc.weight"] @ row.double(), w["hidden_norm.weight"]) for row in ctx_hidden]
    ids = [last] + [mask_id] * k
    pos = [p + i for i in range(k + 1)]
    h = [embed[t].clone() for t in ids]
    for layer in range(cfg["num_hidden_layers"]):
        L = lambda name: w[f"layers.{layer}.{name}.weight"]  # noqa: E731
        keys, vals = [], []  # one entry per key row: [Hkv] of [d]

        def add_kv(x, ps):
            keys.append([rope(rms(kh, L("self_attn.k_norm")), ps)
                         for kh in heads(L("self_attn.k_proj") @ x, nkv)])
            vals.append(heads(L("self_attn.v_proj") @ x, nkv))

        for row, ps in zip(ctx, ctx_pos):  # context: no input norm
            add_kv(row, ps)
        normed = [rms(x, L("input_layernorm")) for x in h]
        qs = []
        for x, ps in zip(normed, pos):
            qs.append([rope(rms(qh, L("self_attn.q_norm")), ps)
                       for qh in heads(L("self_attn.q_proj") @ x, nh)])
            add_kv(x, ps)
        # A sliding layer: causal, and only keys within the window (its own position in).
        window = (cfg["sliding_window"] if (cfg.get("layer_types") or [None] * 99)[layer]
                  == "sliding_attention" else None)
        key_pos = list(ctx_pos) + pos
        new_h = []
        for i in range(k + 1):
            seen = [j for j in range(len(keys)) if window is None
                    or 0 <= pos[i] - key_pos[j] < window]
            out = []
            for hd in range(nh):
                g = hd // (nh // nkv)
                scores = torch.stack([qs[i][hd] @ keys[j][g] for j in seen])
                probs = torch.softmax(scores / math.sqrt(d), dim=0)
                out.append(sum(p_ * vals[j][g] for p_, j in zip(probs, seen)))
            x = h[i] + L("self_attn.o_proj") @ torch.cat(out)
            m = rms(x, L("post_attention_layernorm"))
            new_h.append(x + L("mlp.down_proj") @ (F.silu(L("mlp.gate_proj") @ m)
                                                   * (L("mlp.up_proj") @ m)))
        h = new_h
    return torch.stack([lm_head @ rms(x, w["norm.weight"]) for x in h[1:]])


def requests(pair, seed=5):
    """(req_id, tokens, first context position written here): different lengths; "c"
    has its first 3 rows written apart (as a prefix-cache hit's blocks hold them)."""
    prompts = make_prompts([6, 11, 9], pair.target_config["vocab_size"], seed=seed)
    return [("a", prompts[0], 0), ("b", prompts[1], 0), ("c", prompts[2], 3)]


def batch_and_reference(pair, drafter, draft_path, backend=None):
    """The requests' contexts written in one batch -> (context, ids, last tokens, block
    positions, the naive logits of each request's block)."""
    ctx, reqs = PagedContext(drafter, backend=backend), requests(pair)
    hidden, positions, counts, lasts, ps, naive = [], [], [], [], [], []
    for rid, tokens, start in reqs:
        h = pair.target_hidden(tokens)
        if start:  # the rows before `start`: written by another step (a hit's blocks)
            ctx.append(rid, list(range(start)), h[:start])
        hidden.append(h[start:])
        positions += list(range(start, len(tokens)))
        counts.append(len(tokens) - start)
        lasts.append(pair.next_token(tokens))
        ps.append(len(tokens))
        naive.append(naive_block_logits(
            draft_path, pair.hf.model.embed_tokens.weight, pair.hf.lm_head.weight,
            h, list(range(len(tokens))), lasts[-1], ps[-1], K))
    ctx.append_batch([r[0] for r in reqs], counts, positions, torch.cat(hidden))
    return ctx, [r[0] for r in reqs], lasts, ps, naive


def test_propose_matches_naive_reference(pair):
    drafter = pair.drafter
    ctx, ids, lasts, ps, naive = batch_and_reference(pair, drafter, pair.draft_path)
    logits = ctx.logits(ids, lasts, ps, K)
    assert logits.shape == (3, K, pair.target_config["vocab_size"])
    for i in range(3):
        torch.testing.assert_close(logits[i].double(), naive[i], atol=2e-4, rtol=1e-4)
    drafts = ctx.propose(ids, lasts, ps, K)
    assert drafts.tolist() == [n.argmax(-1).tolist() for n in naive]
    # Not by luck: every row's top logit leads the next by far more than the tolerance,
    # and the requests get different drafts.
    for n in naive:
        top2 = n.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    assert len({tuple(d) for d in drafts.tolist()}) == 3
    # One by one gives the same drafts as the batch.
    for i, rid in enumerate(ids):
        assert ctx.propose([rid], [lasts[i]], [ps[i]], K).tolist() == [drafts[i].tolist()]
    # Any k up to the trained block size - 1 (here 8 - 1); past it, refused.
    assert ctx.propose(ids, lasts, ps, 2).shape == (3, 2)
    with pytest.raises(ValueError, match="blocks of 8"):
        ctx.propose(ids, lasts, ps, 8)


@pytest.mark.parametrize("types", [["full_attention"] * 2,
                                   ["sliding_attention", "full_attention"]])
def test_the_pytorch_attention_backend_drafts_the_same(pair, types):
    """The PyTorch reference backend (any device) through the same paged path: a full
    layer's block as one wide decode query, a sliding layer's rows as their own."""
    from tokenmill.attention.torch_ref import TorchAttentionBackend
    path = pair.draft(f"torch_{types[0]}", pair.root, seed=4,
                      config_overrides=dict(layer_types=types, sliding_window=5))
    drafter = load_dflash_drafter(path, pair.target, torch.float32, CPU,
                                  create_platform(CPU, torch.float32))
    ctx, ids, lasts, ps, naive = batch_and_reference(pair, drafter, path,
                                                     TorchAttentionBackend())
    assert type(drafter.attention_layers()[0].impl).__name__ == "TorchAttentionImpl"
    logits = ctx.logits(ids, lasts, ps, K)
    for i in range(len(ids)):
        torch.testing.assert_close(logits[i].double(), naive[i], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("types,window", [
    (["sliding_attention", "full_attention"], 5),   # the window cuts into the context
    (["full_attention", "sliding_attention"], 2),   # shorter than the block itself
    (["sliding_attention", "sliding_attention"], 64)])  # only causal in effect
def test_sliding_layers_are_causal_and_windowed(pair, types, window):
    """The reference's SWA draft layers: causal inside the block, the last `window`
    positions only; batched requests of different context lengths and starts."""
    name = f"swa_{'_'.join(t[0] for t in types)}_{window}"
    path = pair.draft(name, pair.root, seed=4,
                      config_overrides=dict(layer_types=types, sliding_window=window))
    drafter = load_dflash_drafter(path, pair.target, torch.float32, CPU,
                                  create_platform(CPU, torch.float32))
    assert drafter.config.layer_windows == [window if t == "sliding_attention" else None
                                            for t in types]
    ctx, ids, lasts, ps, naive = batch_and_reference(pair, drafter, path)
    logits = ctx.logits(ids, lasts, ps, K)
    for i in range(len(ids)):
        torch.testing.assert_close(logits[i].double(), naive[i], atol=2e-4, rtol=1e-4)


def test_a_draft_step_writes_past_the_context_and_leaves_it(pair):
    """The block's K/V go into the request's slots p..p+k, past its context: the
    context rows stay as written, so a later step sees the same context; a request
    with no context yet drafts from its block alone."""
    drafter = pair.drafter
    ctx, ids, lasts, ps, naive = batch_and_reference(pair, drafter, pair.draft_path)
    before = {rid: ctx.kv(rid, p) for rid, p in zip(ids, ps)}
    first = ctx.logits(ids, lasts, ps, K)
    for rid, p in zip(ids, ps):
        assert torch.equal(ctx.kv(rid, p), before[rid])
        assert ctx.kv(rid, p + K + 1)[:, :, p:].abs().sum() > 0  # the block's rows
    assert torch.equal(ctx.logits(ids, lasts, ps, K), first)
    alone = ctx.logits(["fresh"], [lasts[0]], [0], K)
    assert alone.shape == (1, K, pair.target_config["vocab_size"])


def test_own_embedding_is_used(pair):
    path = pair.draft("own_embed", pair.root, own_embed=True, seed=1)
    drafter = load_dflash_drafter(path, pair.target, torch.float32, CPU,
                                  create_platform(CPU, torch.float32))
    assert drafter.embed_tokens is not None and drafter.lm_head is None
    tokens = requests(pair)[1][1]
    ctx = PagedContext(drafter)
    h = pair.target_hidden(tokens)
    ctx.append("r", list(range(len(tokens))), h)
    last = pair.next_token(tokens)
    own = load_file(os.path.join(path, "model.safetensors"))["embed_tokens.weight"]
    naive = naive_block_logits(path, own, pair.hf.lm_head.weight, h,
                               list(range(len(tokens))), last, len(tokens), K)
    logits = ctx.logits(["r"], [last], [len(tokens)], K)[0]
    torch.testing.assert_close(logits.double(), naive, atol=2e-4, rtol=1e-4)


def _reduced_vocab_draft(pair, name, dv=96, d2t=None, drop=()):
    """A draft with its own lm_head over `dv` draft ids and a d2t map to a sorted random
    subset of the target's ids (EAGLE-3's convention: target = draft + d2t[draft])."""
    from safetensors.torch import save_file
    path = pair.draft(name, pair.root, seed=2, config_overrides=dict(draft_vocab_size=dv))
    file = os.path.join(path, "model.safetensors")
    t = load_file(file)
    g = torch.Generator().manual_seed(3)
    v, h = pair.target_config["vocab_size"], pair.target_config["hidden_size"]
    targets = torch.randperm(v, generator=g)[:dv].sort().values
    t["lm_head.weight"] = 0.2 * torch.randn(dv, h, generator=g)
    t["d2t"] = targets - torch.arange(dv) if d2t is None else d2t
    save_file({k: x for k, x in t.items() if k not in drop}, file)
    return path, targets


def test_reduced_draft_vocabulary_maps_drafts_to_target_ids(pair):
    path, targets = _reduced_vocab_draft(pair, "reduced")
    drafter = load_dflash_drafter(path, pair.target, torch.float32, CPU,
                                  create_platform(CPU, torch.float32))
    assert drafter.lm_head is not None and not drafter.shares_target_lm_head
    tokens = requests(pair)[0][1]
    ctx = PagedContext(drafter)
    h = pair.target_hidden(tokens)
    ctx.append("r", list(range(len(tokens))), h)
    last = pair.next_token(tokens)
    own_head = load_file(os.path.join(path, "model.safetensors"))["lm_head.weight"]
    naive = naive_block_logits(path, pair.hf.model.embed_tokens.weight, own_head, h,
                               list(range(len(tokens))), last, len(tokens), K)
    logits = ctx.logits(["r"], [last], [len(tokens)], K)[0]
    assert logits.shape == (K, 96)
    torch.testing.assert_close(logits.double(), naive, atol=2e-4, rtol=1e-4)
    drafts = ctx.propose(["r"], [last], [len(tokens)], K)[0]
    assert drafts.tolist() == targets[naive.argmax(-1)].tolist()  # target ids, not draft ids
    assert drafter.t2d.sum() == 96 and drafter.t2d[targets].all()


def test_reduced_draft_vocabulary_refusals(pair):
    def load(path):
        return load_dflash_drafter(path, pair.target, torch.float32, CPU,
                                   create_platform(CPU, torch.float32))
    with pytest.raises(ValueError, match="no d2t map"):
        load(_reduced_vocab_draft(pair, "no_d2t", drop=("d2t",))[0])
    with pytest.raises(ValueError, match="needs the draft's own lm_head"):
        load(_reduced_vocab_draft(pair, "no_head", drop=("lm_head.weight",))[0])
    with pytest.raises(ValueError, match=r"DFlash checkpoint .*d2t maps draft ids outside"):
        load(_reduced_vocab_draft(pair, "bad_d2t", d2t=torch.full((96,), 1000))[0])


@pytest.mark.parametrize("form", ["pt_file", "tensor"])
def test_a_dedicated_mask_embedding_stands_in_for_the_mask_rows(pair, form):
    """mask_embedding.pt (or a `mask_embedding` tensor in the safetensors): the block's
    mask rows embed as it, not as the embedding's mask_token_id row."""
    from safetensors.torch import save_file
    path = pair.draft(f"mask_{form}", pair.root, seed=6)
    h = pair.target_config["hidden_size"]
    mask = torch.randn(h, generator=torch.Generator().manual_seed(8))
    if form == "pt_file":
        torch.save(mask, os.path.join(path, "mask_embedding.pt"))
    else:
        file = os.path.join(path, "model.safetensors")
        save_file(dict(load_file(file), mask_embedding=mask), file)
    drafter = load_dflash_drafter(path, pair.target, torch.float32, CPU,
                                  create_platform(CPU, torch.float32))
    assert torch.equal(drafter.mask_embedding, mask)
    tokens = requests(pair)[1][1]
    ctx = PagedContext(drafter)
    hidden = pair.target_hidden(tokens)
    ctx.append("r", list(range(len(tokens))), hidden)
    last = pair.next_token(tokens)
    mask_id = json.load(open(os.path.join(path, "config.json")))["dflash_config"]["mask_token_id"]
    embed = pair.hf.model.embed_tokens.weight.detach().clone()
    embed[mask_id] = mask
    naive = naive_block_logits(path, embed, pair.hf.lm_head.weight, hidden,
                               list(range(len(tokens))), last, len(tokens), K)
    logits = ctx.logits(["r"], [last], [len(tokens)], K)[0]
    torch.testing.assert_close(logits.double(), naive, atol=2e-4, rtol=1e-4)
    # Not the plain row's logits: the substitution matters here.
    plain = naive_block_logits(path, pair.hf.model.embed_tokens.weight, pair.hf.lm_head.weight,
                               hidden, list(range(len(tokens))), last, len(tokens), K)
    assert (plain - naive).abs().max() > 1e-2
    torch.save(torch.zeros(h + 1), os.path.join(path, "mask_embedding.pt"))
    with pytest.raises(ValueError, match=f"mask embedding must be {h} floats"):
        load_dflash_drafter(path, pair.target, torch.float32, CPU,
                            create_platform(CPU, torch.float32))


def test_context_written_in_pieces_equals_written_at_once(pair):
    """Prompt chunks and verified steps write the context piece by piece: the same cache
    rows and drafts as one write; rows of rejected drafts written by mistake past the
    block's first position are overwritten by the block and leave no trace."""
    drafter = pair.drafter
    tokens = requests(pair)[1][1]  # 11 tokens
    n = len(tokens)
    h = pair.target_hidden(tokens)
    last = pair.next_token(tokens)
    ctx = PagedContext(drafter)
    ctx.append("whole", list(range(n)), h)
    for a, b in ((0, 4), (4, 5), (5, 11)):
        ctx.append("pieces", list(range(a, b)), h[a:b])
    torch.testing.assert_close(ctx.kv("pieces", n), ctx.kv("whole", n), atol=1e-5, rtol=1e-5)
    want = ctx.propose(["whole"], [last], [n], K)
    assert ctx.propose(["pieces"], [last], [n], K).tolist() == want.tolist()
    ctx.append("pieces", [n, n + 1, n + 2], torch.randn(3, h.shape[1]))
    assert ctx.propose(["pieces"], [last], [n], K).tolist() == want.tolist()
    # Both requests in one batch: the same drafts as alone.
    both = ctx.propose(["whole", "pieces"], [last, last], [n, n], K)
    assert both.tolist() == [want[0].tolist()] * 2


def test_loader_errors_name_the_problem(pair):
    def load(name, **kw):
        return load_dflash_drafter(pair.draft(name, pair.root, **kw), pair.target,
                                   torch.float32, CPU, create_platform(CPU, torch.float32))

    with pytest.raises(ValueError, match=r"lacks weights for: \['hidden_norm.weight'\]"):
        load("no_hidden_norm", drop=("hidden_norm.weight",))
    with pytest.raises(ValueError, match=r"lacks layers.1.self_attn.k_proj.weight"):
        load("no_k_proj", drop=("layers.1.self_attn.k_proj.weight",))
    with pytest.raises(ValueError, match=r"target_layer_ids \[0, 3\]: \[3\] outside the "
                                         r"target's 3 layers"):
        load("bad_ids", target_layer_ids=(0, 3))
    with pytest.raises(ValueError, match="vocab_size 500 != the target's 384"):
        load("bad_vocab", config_overrides=dict(vocab_size=500))
    with pytest.raises(ValueError, match="mask_token_id 384 is outside the vocabulary"):
        load("bad_mask", mask_token_id=384)
    with pytest.raises(ValueError, match="lacks dflash_config.target_layer_ids"):
        load("no_ids", dflash_overrides=dict(target_layer_ids=None))
    with pytest.raises(ValueError, match="dflash_config.use_swa"):
        load("swa", dflash_overrides=dict(use_swa=True))
    with pytest.raises(ValueError, match="sliding_attention layers but sliding_window is None"):
        load("swa_no_window", config_overrides=dict(
            layer_types=["sliding_attention", "full_attention"], sliding_window=None))
    with pytest.raises(ValueError, match="target hidden states of size 32, the target's "
                                         "are 64"):
        load("target_hidden", config_overrides=dict(target_hidden_size=32))


def test_bf16_follows_fp32(pair):
    """In bf16 the platform packs the draft's Linear layers (the target's are its own):
    the paged context keeps bf16 K/V and the logits stay near the fp32 ones."""
    platform = create_platform(CPU, torch.bfloat16)
    target = load_model(pair.target_path, pair.target_config, torch.bfloat16, CPU, platform)
    drafter = load_dflash_drafter(pair.draft_path, target, torch.bfloat16, CPU, platform)
    reqs = requests(pair)
    logits = {}
    for model in (pair.drafter, drafter):
        ctx = PagedContext(model)
        for rid, tokens, start in reqs:
            h = pair.target_hidden(tokens)[start:].to(model.norm.weight.dtype)
            ctx.append(rid, list(range(start, len(tokens))), h)
        assert ctx.kv("a", 1).dtype == model.norm.weight.dtype
        logits[model] = ctx.logits([r[0] for r in reqs],
                                   [pair.next_token(r[1]) for r in reqs],
                                   [len(r[1]) for r in reqs], K)
    torch.testing.assert_close(logits[drafter].float(), logits[pair.drafter],
                               atol=0.25, rtol=0.05)
