"""Shared fixtures: tiny random HF checkpoints, built once per session, and HF references.

No network and no downloaded weights: every checkpoint is a freshly initialised
transformers model saved with `save_pretrained` into a session temp folder.
Random tiny models have nearly flat logits, so the weights get a large scale
(initializer_range=0.2) and the norms/biases are randomised too (so a loader
that skips them cannot pass by luck). Everything is fp32.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

from tokenmill.platforms.cpu import settle_vector_math

# The HF references compute RoPE with torch's CPU cos / sin, whose first large call in a
# process can come out wrong (tokenmill/platforms/cpu.py, VECTOR_MATH_OPS).
settle_vector_math()

# transformers (5.x) binds flash-linear-attention's kernels into its Gated DeltaNet
# models when the modeling module is imported, wherever `fla` imports, the CPU
# included, where they cannot run: the HF references must stay on PyTorch. fla-core is
# in the test extras for tokenmill's own fla path; `import_fla_kernels` lets it be
# imported for a moment and hands out its kernels (tokenmill's platform, which asks
# whether fla imports, keeps the PyTorch path in the tests).
_FLA = sys.modules.setdefault("fla", None)


def pytest_addoption(parser):
    parser.addoption("--web-ui-screenshots", metavar="DIR", default=None,
                     help="tests/test_web_ui.py writes a PNG of each view of the web page here "
                          "(default: the test's tmp_path)")


# The models are tiny: one intra-op thread is as fast, and on a shared 2-core
# machine it avoids OpenMP threads spinning against each other (10x slower).
torch.set_num_threads(1)

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2, rms_norm_eps=1e-6,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)

# What both DeepSeek configs share: MLA widths (kv_lora_rank 32, rope 16, nope 16,
# v 16), 3 layers (first_k_dense_replace 1), 8 routed experts + 1 shared. HF's MLA
# attention repeats K/V by num_attention_heads / num_key_value_heads: equal here.
DEEPSEEK_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                    num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1,
                    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    n_shared_experts=1, tie_word_embeddings=False)

# Gemma 4 text: four layers, local (head_dim 16, window 12) and global (head_dim 32,
# proportional rope) alternating, soft-capped logits, tied; the features the hub
# checkpoints use are switched on per spec below.
GEMMA4 = dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=12,
              hidden_size_per_layer_input=0,
              layer_types=["sliding_attention", "full_attention"] * 2,
              final_logit_softcapping=30.0, tie_word_embeddings=True)
GEMMA4_PLE = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=384)
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2,
                  moe_intermediate_size=32)

# name -> (architecture, config overrides). Every parity config lives here.
MODEL_SPECS: dict[str, tuple[str, dict]] = {
    # Llama, GQA (4 q heads / 2 kv heads), tied embeddings, default rope.
    "llama_gqa_tied": ("llama", dict(tie_word_embeddings=True)),
    # Llama, MQA (1 kv head), untied, llama3 rope scaling that actually moves frequencies.
    "llama_mqa_llama3": ("llama", dict(
        num_key_value_heads=1, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Llama, GQA, untied, linear rope scaling.
    "llama_linear": ("llama", dict(
        tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Llama with attention_bias (q/k/v/o) and mlp_bias (gate/up/down), GQA, untied.
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    # Qwen2 (qkv bias), GQA, tied.
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    # Qwen2 with yarn (HF's Qwen2 rotary supports every ROPE_INIT_FUNCTIONS type).
    "qwen2_yarn": ("qwen2", dict(
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 64})),
    # Qwen3 (q/k norm), head_dim 32 != hidden / heads = 16, untied.
    "qwen3_headdim": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    # Mistral: Llama's decoder, head_dim from the config, a sliding window wider than
    # the context (so full attention); untied.
    "mistral_window": ("mistral", dict(head_dim=32, sliding_window=4096,
                                       tie_word_embeddings=False)),
    # Mistral with a sliding window (12) shorter than most prompts: windowed attention,
    # blocks before the window given back while the request runs.
    "mistral_swa": ("mistral", dict(head_dim=32, sliding_window=12,
                                    tie_word_embeddings=False)),
    # Phi-3 / Phi-4-mini: q/k/v and gate/up fused in the checkpoint, partial rotary
    # (0.75 of head_dim), a sliding window past the context; untied.
    "phi3_partial": ("phi3", dict(partial_rotary_factor=0.75, sliding_window=2047,
                                  tie_word_embeddings=False)),
    # Gemma 3: local (window 12) and global layers alternating (4 layers: two KV cache
    # groups of two), head_dim 32, local rope base, q/k norms, tied; soft-capped logits.
    "gemma3": ("gemma3", dict(num_hidden_layers=4, head_dim=32, sliding_window=12,
                              sliding_window_pattern=2, query_pre_attn_scalar=24,
                              final_logit_softcapping=30.0, tie_word_embeddings=True)),
    # Gemma 4 (text, no per-layer inputs): local layers of head_dim 16 (window 12),
    # global ones of head_dim 32 with proportional rope: two KV cache groups of
    # different page layouts sharing buffers; tied.
    "gemma4": ("gemma4", dict(GEMMA4)),
    # Gemma 4 with MoE blocks (8 experts, top-2, beside every dense MLP) and k = v
    # attention on the global layers (no v_proj; one global KV head).
    "gemma4_moe_keqv": ("gemma4", dict(GEMMA4, **GEMMA4_MOE, attention_k_eq_v=True,
                                       num_global_key_value_heads=1)),
    # Gemma 4 with per-layer inputs (8 per layer, from each token's id and embedding).
    "gemma4_ple": ("gemma4", dict(GEMMA4, **GEMMA4_PLE)),
    # Gemma 4 with KV sharing: layers 2 and 3 read the K/V (and cache) of 0 and 1 (the
    # last local and global layer before them); their MLPs double-wide. With per-layer
    # inputs, as the E2B / E4B checkpoints have them (HF's generate cannot run KV
    # sharing without: it slices the shared layers' per-layer inputs unconditionally).
    "gemma4_kvshare": ("gemma4", dict(GEMMA4, **GEMMA4_PLE, num_kv_shared_layers=2,
                                      use_double_wide_mlp=True)),
    # Everything at once, as the hub's checkpoints combine them: per-layer inputs, MoE,
    # k = v, and 3 of 6 layers sharing (3 and 4 read local layer 1, 5 reads global 2).
    "gemma4_all": ("gemma4", dict(GEMMA4, **GEMMA4_PLE, **GEMMA4_MOE, num_hidden_layers=6,
                                  layer_types=["sliding_attention", "sliding_attention",
                                               "full_attention"] * 2,
                                  attention_k_eq_v=True, num_global_key_value_heads=1,
                                  num_kv_shared_layers=3, use_double_wide_mlp=True)),
    # Qwen2 with its sliding window in use above max_window_layers (layer 0 full, layer 1
    # sliding: two KV cache groups of one spec layout each); untied.
    "qwen2_swa": ("qwen2", dict(use_sliding_window=True, sliding_window=12,
                                max_window_layers=1, tie_word_embeddings=False)),
    # Qwen3, MQA, tied.
    "qwen3_mqa_tied": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    # DeepSeek-V2: MLA with a plain q_proj (q_lora_rank None), latent cache of 32 + 16;
    # layer 0 dense, 1-2 MoE (top-2 of 8, softmax, group_limited_greedy: 2 of 4 groups,
    # scaled weights) plus a shared expert; default rope; untied.
    "deepseek_v2": ("deepseek_v2", dict(
        DEEPSEEK_MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, routed_scaling_factor=1.5)),
    # DeepSeek-V3: MLA with the low-rank q (q_lora_rank 24), yarn with mscale /
    # mscale_all_dim (softmax scale corrected); sigmoid routing with a (randomised)
    # e_score_correction_bias over 2 of 4 groups, renormalised and scaled; untied.
    "deepseek_v3": ("deepseek_v3", dict(
        DEEPSEEK_MLA, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.7,
                      "original_max_position_embeddings": 64})),
}

PARITY_MODELS = list(MODEL_SPECS)

# Head shapes the Triton kernels serve through a masked tail of their power-of-two
# block, and soft-capped scores (tests/models/test_triton_path.py, tests/gpu); kept
# out of MODEL_SPECS, or every parity suite would run them.
HEAD_SHAPE_SPECS: dict[str, tuple[str, dict]] = {
    # Phi-3 / Phi-4-mini's head size 96 (hidden 192, 2 q heads over 1 KV head), partial
    # rotary, fused qkv / gate_up in the checkpoint; untied.
    "phi3_hd96": ("phi3", dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1,
                               partial_rotary_factor=0.75, sliding_window=2047,
                               tie_word_embeddings=False)),
    # Gemma 4: local layers of head size 16 (window 12), global ones of 512 (two KV
    # groups of different page layouts); tied.
    "gemma4_hd512": ("gemma4", dict(num_hidden_layers=4, head_dim=16, global_head_dim=512,
                                    sliding_window=12, hidden_size_per_layer_input=0,
                                    layer_types=["sliding_attention", "full_attention"] * 2,
                                    final_logit_softcapping=30.0, tie_word_embeddings=True)),
    # Gemma 3 (local window 12 + global layers, two KV groups) with attention
    # soft-capping tight enough to bite (2.0); HF's eager attention (transformers'
    # Gemma 3 drops the cap otherwise: see test_triton_path's _hf_capped).
    "gemma3_softcap": ("gemma3", dict(num_hidden_layers=4, head_dim=32, sliding_window=12,
                                      sliding_window_pattern=2, query_pre_attn_scalar=24,
                                      attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                                      attn_implementation="eager", tie_word_embeddings=True)),
}

# Models with sliding layers give blocks back as the windows move: the
# preemption tests need a smaller pool to force preemption (and, for the smallest
# pool a sequence may have, smaller prompt chunks). (name, block_size) -> overrides
SLIDING_PREEMPT = {("mistral_swa", 8): dict(num_kv_blocks=8, max_num_batched_tokens=24),
                   ("mistral_swa", 4): dict(num_kv_blocks=13),
                   ("gemma3", 8): dict(num_kv_blocks=20, max_num_batched_tokens=24),
                   ("gemma4", 8): dict(num_kv_blocks=20, max_num_batched_tokens=24),
                   ("gemma4_moe_keqv", 8): dict(num_kv_blocks=20, max_num_batched_tokens=24),
                   ("gemma4_ple", 8): dict(num_kv_blocks=20, max_num_batched_tokens=24),
                   ("gemma4_kvshare", 8): dict(num_kv_blocks=20, max_num_batched_tokens=24),
                   ("gemma4_all", 8): dict(num_kv_blocks=30, max_num_batched_tokens=24)}


def preempt_pool(name: str, config: dict) -> dict:
    """A preemption test's engine arguments for model `name`."""
    return {**config, **SLIDING_PREEMPT.get((name, config["block_size"]), {})}


def _classes(arch: str):
    import transformers as tf
    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "gemma4": (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
    }[arch]


def build_checkpoint(path: str, arch: str, overrides: dict | None = None, seed: int = 0,
                     max_shard_size: str | None = None, generation_config: dict | None = None):
    """Save a tiny random fp32 model to `path`; return the HF model (eval, fp32)."""
    cfg_cls, model_cls = _classes(arch)
    kw = dict(TINY)
    kw.update(overrides or {})
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = cfg_cls(**kw)
        model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias
                b.normal_(0.0, 0.1)
            elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
                b.copy_(1.0 + 0.2 * torch.randn_like(b))
    save_kw = {}
    if max_shard_size is not None:
        save_kw["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kw)
    if generation_config is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation_config, f)
    return model


def make_prompts(n_lengths, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in n_lengths]


PROMPT_LENGTHS = [5, 17, 33, 8, 70, 3, 40, 12]
NUM_NEW = 20


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF generate(do_sample=False) for one prompt, exactly n new tokens."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_greedy_batch(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF generate(do_sample=False) for a left-padded batch (one call, same tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, width:].tolist()


@torch.inference_mode()
def hf_next_token(model, tokens: list[int]) -> int:
    """Dense HF forward over all tokens, argmax of the last row."""
    return int(model(torch.tensor([tokens])).logits[0, -1].argmax())


class TinyModel:
    """A saved checkpoint, its HF twin and (lazily) HF greedy references."""

    def __init__(self, name: str, path: str, arch: str, hf_model):
        self.name, self.path, self.arch, self.hf = name, path, arch, hf_model
        self.hf_config = json.load(open(os.path.join(path, "config.json")))
        self.vocab_size = self.hf_config.get("text_config", self.hf_config)["vocab_size"]
        self._refs: dict[tuple, list[int]] = {}

    def reference(self, prompt: list[int], n: int = NUM_NEW) -> list[int]:
        """HF greedy tokens; the standard prompts are generated together in one batch."""
        key = (tuple(prompt), n)
        if key not in self._refs:
            prompts = self.prompts
            if n == NUM_NEW and prompt in prompts:
                for p, ref in zip(prompts, hf_greedy_batch(self.hf, prompts, n)):
                    self._refs[(tuple(p), n)] = ref
            else:
                self._refs[key] = hf_greedy(self.hf, prompt, n)
        return self._refs[key]

    @property
    def prompts(self) -> list[list[int]]:
        return make_prompts(PROMPT_LENGTHS, self.vocab_size)


@pytest.fixture(scope="session")
def demo_path(tmp_path_factory) -> str:
    """The built-in demo model (random weights, a real byte-level BPE tokenizer), built
    once for the session."""
    from tokenmill.demo_model import DEMO_MODEL_NAME, ensure_demo_model
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / DEMO_MODEL_NAME))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in cache:
            arch, overrides = MODEL_SPECS[name]
            path = str(tmp_path_factory.mktemp(name))
            hf = build_checkpoint(path, arch, overrides)
            cache[name] = TinyModel(name, path, arch, hf)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def llama_tiny(tiny_model_factory) -> TinyModel:
    """The default model for unit tests: Llama, GQA, tied."""
    return tiny_model_factory("llama_gqa_tied")


@pytest.fixture(scope="session")
def eos_model(tmp_path_factory) -> TinyModel:
    """A Llama checkpoint whose generation_config.json (not config.json) names the EOS ids.

    The EOS id is picked from the model's own greedy output for `eos_prompt`, so
    greedy generation provably meets it: eos_ref[eos_index] == eos_id, first
    occurrence. stop_index is another first occurrence, for stop_token_ids tests.
    """
    path = str(tmp_path_factory.mktemp("llama_eos"))
    hf = build_checkpoint(path, "llama", dict(tie_word_embeddings=True), seed=3)
    tm = TinyModel("llama_eos", path, "llama", hf)
    for seed in range(20):
        prompt = make_prompts([9], tm.vocab_size, seed=100 + seed)[0]
        ref = tm.reference(prompt, 20)
        firsts = [k for k in range(2, 12) if ref[k] not in ref[:k]]
        eos_idx = next((k for k in firsts if k >= 3 and ref[k] in ref[k + 1:]), None)
        stop_idx = next((k for k in firsts if k != eos_idx), None)
        if eos_idx is not None and stop_idx is not None:
            break
    else:
        raise AssertionError("no usable EOS candidate in the greedy outputs")
    unused = next(t for t in range(tm.vocab_size) if t not in ref)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ref[eos_idx], unused]}, f)
    tm.eos_prompt, tm.eos_ref, tm.eos_id, tm.eos_index = prompt, ref, ref[eos_idx], eos_idx
    tm.stop_index = stop_idx
    return tm


def word_tokens(tok) -> list[int]:
    """The vocabulary's tokens that decode to a space and 3 or more ASCII letters: text
    generated from them alone (allowed_token_ids) is clean words, always with pieces
    to take stop strings from, whatever the weights."""
    ids = []
    for i in range(len(tok)):
        s = tok.decode([i])
        if len(s) >= 4 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
            ids.append(i)
    return ids


def interpret_triton_or_skip(module_name: str):
    """For a test module of Triton kernels on CPU tensors: TRITON_INTERPRET=1 before
    triton is imported (Triton reads it at import), or the module skipped when an
    earlier module imported triton without it. Returns triton (skips without it)."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(f"{module_name}: triton was imported without TRITON_INTERPRET (an "
                    f"earlier module): run this file on its own or after one that "
                    f"interprets", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
    return pytest.importorskip("triton")


def random_quantized_weight(n: int, k: int, bits: int, group: int, perm: bool = False,
                            seed: int = 0, scale: float = 0.02, floor: float = 1e-3):
    """A canonical QuantizedWeight of random codes and zero points, scales uniform in
    [floor, floor + scale), in groups of `group` columns (-1: one group), act-order
    (`perm`) a random permutation."""
    from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight
    g = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    groups = -(-k // group)
    top = 1 << bits
    return QuantizedWeight(torch.randint(0, top, (n, k), generator=g).to(torch.uint8),
                           torch.rand(n, groups, generator=g) * scale + floor,
                           torch.randint(0, top, (n, groups), generator=g).to(torch.uint8),
                           bits, group, torch.randperm(k, generator=g) if perm else None).check()


def make_llm(path: str, **kw):
    """An LLM on CPU in fp32 with small defaults (callers override)."""
    from tokenmill import LLM
    args = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=16)
    args.update(kw)
    return LLM(path, **args)


def scheduler_of(llm):
    return llm.llm_engine.engine_core.scheduler


def record_model_drafts(runner, strict: bool = False) -> dict[tuple, list[int]]:
    """Every draft-model proposal of the runner from now on: (prompt, position of the
    request's last token) -> drafts. `strict`: a request proposing twice from one
    position (recomputed after preemption) must propose the same."""
    drafter = runner.drafter
    seen, inner = {}, drafter.propose_with_model

    def propose_with_model(*args, **kw):
        out = inner(*args, **kw)
        batch = runner.input_batch
        for r, d in enumerate(out):
            if d:
                rid = batch.req_ids[r]
                key = (tuple(runner.requests[rid].prompt_token_ids),
                       int(batch.num_tokens_no_spec[r]) - 1)
                if strict:
                    assert seen.setdefault(key, list(d)) == list(d), key
                seen[key] = list(d)
        return out
    drafter.propose_with_model = propose_with_model
    return seen


def runner_of(llm):
    return llm.llm_engine.engine_core.runner


@pytest.fixture
def fla_interpreted(monkeypatch):
    """flash-linear-attention's real Gated DeltaNet kernels, run by Triton's interpreter
    on CPU tensors (the caller's module set TRITON_INTERPRET before triton's import).
    Two things only a GPU run has are stood in for: the autotuner keeps its first
    config (its benchmarker needs a GPU), and the loop counter of fla's state kernel is
    a Triton scalar, as compiled code has it, not a Python int."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton's import")
    import builtins

    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    monkeypatch.setattr(Autotuner, "prune_configs", lambda self, kw: prune(self, kw)[:1])
    kernels = import_fla_kernels()
    monkeypatch.setattr(sys.modules["fla.ops.common.chunk_delta_h"], "range",
                        lambda *a: map(interpreter._implicit_cvt, builtins.range(*a)),
                        raising=False)
    return kernels


def import_fla_kernels():
    """fla's (chunk, fused recurrent) Gated DeltaNet kernels, imported with `fla`
    visible for that moment only (see the top of this file)."""
    global _FLA
    if _FLA is None:
        del sys.modules["fla"]
        try:
            import fla.ops.gated_delta_rule  # noqa: F401
        except ImportError:
            pytest.skip("fla-core is not installed")
        finally:
            _FLA = sys.modules.get("fla")
            sys.modules["fla"] = None
    kernels = sys.modules["fla.ops.gated_delta_rule"]
    return kernels.chunk_gated_delta_rule, kernels.fused_recurrent_gated_delta_rule
