"""Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE hybrids): images in, text out,
token for token with HF (fp32, greedy).

Tiny random checkpoints with their tokenizer and image processor
(tests/vl_checkpoint.py). The HF reference gets the same prompt text, expanded as
HF's processor does (each <|image_pad|> -> t*h*w/merge^2 copies), and the same
image processor's pixel values. The parity runs also ask for the top-5 logprobs of
every generated token, which must be HF's (within 1e-4, logprob_check.py): the
log_softmax of one dense fp32 forward over prompt + generated tokens with every
input HF's generate got (pixel_values, image_grid_thw, and mm_token_type_ids, 0 for
the generated tokens: without it transformers silently falls back to 1-D
positions).
"""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from conftest import make_llm, runner_of, scheduler_of
from logprob_check import K, check_completion
from tokenmill import SamplingParams
from tokenmill.errors import ParamError
from tokenmill.platforms import create_platform
from vl_checkpoint import (build_qwen3_5_vl_checkpoint, build_qwen3_vl_checkpoint,
                           build_vl_checkpoint, make_image)

pytest.importorskip("PIL")

N = 12
ONE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>describe the picture"
       "<|im_end|>\n<|im_start|>assistant\n")
TWO = ("<|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|>"
       "<|vision_end|> what color is the cat")
LONG = ("<|vision_start|><|image_pad|><|vision_end|> " + "the big red house is left of a "
        "small tree and there are two cat , " * 6 + "how many")
TEXT = "what is the color of the sky ?"


class VL:
    def __init__(self, path, build=build_vl_checkpoint):
        import transformers as tf
        self.path = path
        self.hf = build(path)
        self.tok = tf.AutoTokenizer.from_pretrained(path)
        self.ip = tf.AutoImageProcessor.from_pretrained(path)
        self.image_token_id = self.hf.config.image_token_id
        self.img = [make_image(30, 45, 0), make_image(40, 24, 1), make_image(20, 60, 2)]
        self._refs = {}

    def hf_inputs(self, text, images):
        ids = self.tok(text)["input_ids"]
        if not images:
            return ids, {}
        x = self.ip(images=images, return_tensors="pt")
        out, k = [], 0
        for t in ids:
            if t == self.image_token_id:
                out += [t] * (int(x["image_grid_thw"][k].prod()) // 4)
                k += 1
            else:
                out.append(t)
        mm = torch.tensor([[int(t == self.image_token_id) for t in out]])
        return out, dict(pixel_values=x["pixel_values"], image_grid_thw=x["image_grid_thw"],
                         mm_token_type_ids=mm)

    @torch.inference_mode()
    def reference(self, text, image_ids, n=N):
        key = (text, tuple(image_ids), n)
        if key not in self._refs:
            ids, kw = self.hf_inputs(text, [self.img[i] for i in image_ids])
            out = self.hf.generate(input_ids=torch.tensor([ids]),
                                   attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   pad_token_id=0, eos_token_id=None, **kw)
            self._refs[key] = out[0, len(ids):].tolist()
        return self._refs[key]

    @torch.inference_mode()
    def hf_logprobs(self, text, image_ids, tokens):
        """[len(tokens), vocab]: HF's log-distributions after each prefix of `tokens` (the
        expanded prompt, then generated tokens), one dense forward with the inputs
        `reference` gives generate."""
        key = ("logprobs", text, tuple(image_ids), tuple(tokens))
        if key not in self._refs:
            ids, kw = self.hf_inputs(text, [self.img[i] for i in image_ids])
            assert list(tokens[:len(ids)]) == ids
            if "mm_token_type_ids" in kw:  # generated tokens are text
                mm = kw["mm_token_type_ids"]
                kw["mm_token_type_ids"] = torch.cat(
                    [mm, mm.new_zeros(1, len(tokens) - len(ids))], dim=1)
            logits = self.hf(input_ids=torch.tensor([tokens]),
                             attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                             **kw).logits
            self._refs[key] = logits[0].float().log_softmax(-1)
        return self._refs[key]

    def prompt(self, text, image_ids):
        if not image_ids:
            return text
        return {"prompt": text, "multi_modal_data": {"image": [self.img[i] for i in image_ids]}}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return VL(str(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def vl3(tmp_path_factory):
    return VL(str(tmp_path_factory.mktemp("qwen3_vl")), build_qwen3_vl_checkpoint)


@pytest.fixture(scope="module")
def vl35(tmp_path_factory):
    return VL(str(tmp_path_factory.mktemp("qwen3_5_vl")), build_qwen3_5_vl_checkpoint)


@pytest.fixture(scope="module")
def vl35moe(tmp_path_factory):
    return VL(str(tmp_path_factory.mktemp("qwen3_5_moe_vl")),
              lambda path: build_qwen3_5_vl_checkpoint(path, moe=True))


MODELS = {"qwen2_5_vl": "vl", "qwen3_vl": "vl3", "qwen3_5_vl": "vl35", "qwen3_5_moe_vl": "vl35moe"}


GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=K)
# (text, images) of a batch that mixes text-only and image requests
CASES = [(ONE, [0]), (TEXT, []), (TWO, [0, 1]), (LONG, [2]), (TWO, [1, 2])]


def run(llm, vl, cases):
    outs = llm.generate([vl.prompt(t, ims) for t, ims in cases], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_with_logprobs(llm, vl, cases) -> list:
    """The RequestOutputs of greedy runs that report the top-K logprobs of each token."""
    return llm.generate([vl.prompt(t, ims) for t, ims in cases], GREEDY_LOGPROBS,
                        use_tqdm=False)


def assert_parity(vl, cases, outs, where=""):
    """HF's greedy tokens, then each generated token's top-K logprobs against HF's dense
    forward over the expanded prompt + generated tokens, with the images."""
    for (text, images), out in zip(cases, outs):
        comp = out.outputs[0]
        assert comp.token_ids == vl.reference(text, images), (where, text[:30], images)
    for i, ((text, images), out) in enumerate(zip(cases, outs)):
        ids, _ = vl.hf_inputs(text, [vl.img[j] for j in images])
        assert list(out.prompt_token_ids) == ids, (where, i)  # the same expanded prompt
        check_completion(lambda toks, t=text, ims=images: vl.hf_logprobs(t, ims, toks), ids,
                         out.outputs[0], K, f"{where} case {i} {text[:20]!r} {images}",
                         greedy=True)


@pytest.mark.parametrize("which", list(MODELS))
def test_mrope_positions_match_get_rope_index(request, which):
    vl = request.getfixturevalue(MODELS[which])
    from tokenmill.models.loader import load_model
    import json
    cfg = json.load(open(f"{vl.path}/config.json"))
    from tokenmill.config import flatten_text_config
    model = load_model(vl.path, flatten_text_config(cfg), torch.float32, torch.device("cpu"),
                       create_platform("cpu", torch.float32))
    for text, images in [(ONE, [0]), (TWO, [0, 1]), (TWO, [2, 0]), (LONG, [1])]:
        ids, kw = vl.hf_inputs(text, [vl.img[i] for i in images])
        ref, delta = vl.hf.model.get_rope_index(torch.tensor([ids]), kw["mm_token_type_ids"],
                                                image_grid_thw=kw["image_grid_thw"])
        runs, grids = [], kw["image_grid_thw"].tolist()
        arr = np.array(ids)
        starts = np.nonzero((arr == vl.image_token_id) & (np.r_[-1, arr[:-1]] != vl.image_token_id))[0]
        for s, g in zip(starts.tolist(), grids):
            runs.append((s, g[0] * g[1] * g[2] // 4, tuple(g)))
        got, got_delta = model.mrope_positions(len(ids), runs)
        np.testing.assert_array_equal(got, ref[:, 0].numpy())
        assert got_delta == int(delta)
    # the vision tower itself, against HF's (fp32, different summation order)
    x = vl.ip(images=vl.img[:2], return_tensors="pt")
    with torch.inference_mode():
        ref = vl.hf.model.get_image_features(x["pixel_values"], x["image_grid_thw"]).pooler_output
        hf_out = vl.hf.model.get_image_features(x["pixel_values"], x["image_grid_thw"])
        ref = hf_out.pooler_output
        deep = getattr(hf_out, "deepstack_features", None)
        if deep:  # Qwen3-VL: each image's rows carry its DeepStack features after it
            deep = [torch.cat(d) if isinstance(d, (tuple, list)) else d for d in deep]
            bounds = np.cumsum([0] + [r.shape[0] for r in ref])
            ref = [torch.cat([r] + [d[a:b] for d in deep], dim=1)
                   for r, a, b in zip(ref, bounds[:-1], bounds[1:])]
        got = model.encode_images(x["pixel_values"], [tuple(g) for g in x["image_grid_thw"].tolist()])
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, atol=2e-4, rtol=1e-4)
    # M-RoPE's cos / sin against HF's rotary for the same 3-D positions
    ids, kw = vl.hf_inputs(TWO, vl.img[:2])
    pos, _ = vl.hf.model.get_rope_index(torch.tensor([ids]), kw["mm_token_type_ids"],
                                        image_grid_thw=kw["image_grid_thw"])
    dummy = torch.zeros(1, dtype=torch.float32)
    ref_cos, ref_sin = vl.hf.model.language_model.rotary_emb(dummy, pos)
    cos, sin = model.rotary.cos_sin(pos[:, 0], torch.float32)
    torch.testing.assert_close(cos[:, 0], ref_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], ref_sin[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("config", [
    dict(),
    # chunked prefill through the images: 8-token chunks split every placeholder run
    dict(max_num_batched_tokens=8),
    dict(max_num_batched_tokens=24, block_size=8, enable_prefix_caching=True),
    dict(max_num_batched_tokens=16, async_scheduling=True),
    # the engine core in its own process: the images cross as msgpack messages
    dict(max_num_batched_tokens=16, engine_process=True),
], ids=["whole", "chunked", "chunked_prefix", "async", "engine_process"])
def test_mixed_batch_parity(vl, config):
    llm = make_llm(vl.path, **config)
    try:
        assert_parity(vl, CASES, run_with_logprobs(llm, vl, CASES), "qwen2_5_vl")
        if not config.get("engine_process"):
            # three distinct images among five requests: each encoded once
            assert runner_of(llm).num_encoded_images == 3
    finally:
        llm.llm_engine.shutdown()


def test_preemption_parity_and_no_reencoding(vl):
    llm = make_llm(vl.path, block_size=8, num_kv_blocks=18, max_num_batched_tokens=32)
    cases = [(ONE, [0]), (LONG, [2]), (TWO, [0, 1])]
    outs = run_with_logprobs(llm, vl, cases)
    assert scheduler_of(llm).num_preemptions > 0
    assert_parity(vl, cases, outs, "qwen2_5_vl preempted")
    assert runner_of(llm).num_encoded_images == 3


def test_encoder_budget_per_step(vl):
    """Two requests with images of 24 and 16 tokens under an encoder budget of 30: no
    step encodes both (the second request waits a step), and both still match HF."""
    llm = make_llm(vl.path, max_num_encoder_input_tokens=30)
    runner = runner_of(llm)
    per_step = []
    execute = runner.execute_model

    def spy(so):
        per_step.append(sum(runner.requests[rid].mm_features[i].length if rid in runner.requests
                            else so_feat(so, rid, i)
                            for rid, idx in so.scheduled_encoder_inputs.items() for i in idx))
        return execute(so)

    def so_feat(so, rid, i):
        new = {r.req_id: r for r in so.scheduled_new_reqs}
        return new[rid].mm_features[i].length
    runner.execute_model = spy
    cases = [(ONE, [0]), (ONE, [2])]
    got = run(llm, vl, cases)
    for (text, images), tokens in zip(cases, got):
        assert tokens == vl.reference(text, images)
    assert [n for n in per_step if n] == [24, 16]
    # an image larger than the budget is refused when the request is made
    with pytest.raises(ParamError) as ei:
        llm.generate(vl.prompt(TWO, [0, 0]) | {"multi_modal_data": {"image": [
            make_image(64, 64), vl.img[0]]}}, GREEDY, use_tqdm=False)
    assert ei.value.param == "multi_modal_data.image"


def test_prefix_cache_keys_on_the_image(vl):
    """Same tokens, different images: no cache hit over the placeholders; the same
    image again: a hit, and the same output."""
    llm = make_llm(vl.path, block_size=8, enable_prefix_caching=True)
    stats = scheduler_of(llm).kv_cache_manager
    first = run(llm, vl, [(ONE, [0])])[0]
    other = run(llm, vl, [(ONE, [2])])[0]
    assert other == vl.reference(ONE, [2])
    hits_before = stats.prefix_cache_stats.hits
    again = run(llm, vl, [(ONE, [0])])[0]
    assert again == first == vl.reference(ONE, [0])
    assert stats.prefix_cache_stats.hits - hits_before >= 24


def test_chat_with_image_parts(vl):
    """LLM.chat with OpenAI content parts (a base64 PNG data URL, an image object) gives
    what generate() gives for the rendered prompt and the same image."""
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(vl.img[0]).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = make_llm(vl.path)
    msgs = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "describe the picture"},
        {"type": "image", "image": vl.img[1]}]}]
    chat = llm.chat(msgs, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    text = vl.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat == vl.reference(text, [0, 1])


def test_bad_multimodal_input_names_the_field(vl):
    llm = make_llm(vl.path)
    with pytest.raises(ParamError) as ei:  # two images, one placeholder
        llm.generate(vl.prompt(ONE, [0, 1]), GREEDY, use_tqdm=False)
    assert ei.value.param == "multi_modal_data.image"
    with pytest.raises(ParamError) as ei:
        llm.generate({"prompt": ONE, "multi_modal_data": {"image": "cat.png"}}, GREEDY,
                     use_tqdm=False)
    assert ei.value.param == "multi_modal_data.image"
    with pytest.raises(ParamError) as ei:
        llm.generate({"prompt": ONE, "multi_modal_data": {"video": [vl.img[0]]}}, GREEDY,
                     use_tqdm=False)
    assert ei.value.param == "multi_modal_data"
    assert run(llm, vl, [(ONE, [0])])[0] == vl.reference(ONE, [0])  # still serving


@pytest.mark.parametrize("config", [dict(), dict(max_num_batched_tokens=8),
                                    dict(block_size=8, num_kv_blocks=18,
                                         max_num_batched_tokens=32)],
                         ids=["whole", "chunked", "preempt"])
@pytest.mark.parametrize("which", ["qwen3_vl", "qwen3_5_vl", "qwen3_5_moe_vl"])
def test_qwen3_vl_parity(request, which, config):
    """Qwen3-VL (DeepStack, interleaved M-RoPE, Qwen3 text) and Qwen3.5 dense / MoE (no
    DeepStack, interleaved M-RoPE over a partial rotary, hybrid text: the Gated
    DeltaNet layers see the images through the embeddings, the attention layers
    through M-RoPE too): a mixed batch, whole, in chunks through the images (8-token
    chunks split every placeholder run, so the recurrent state is carried through an
    image), and under preemption (a hybrid starts over: its state is recomputed, its
    images come from the encoder cache)."""
    vl = request.getfixturevalue(MODELS[which])
    llm = make_llm(vl.path, **config)
    assert_parity(vl, CASES, run_with_logprobs(llm, vl, CASES), which)
    if "num_kv_blocks" in config:
        assert scheduler_of(llm).num_preemptions > 0
    assert runner_of(llm).num_encoded_images == 3


@pytest.mark.parametrize("config", [
    dict(max_num_batched_tokens=16, async_scheduling=True),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                             "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
], ids=["async", "ngram"])
def test_qwen3_5_vl_async_and_drafts(vl35, config):
    """The hybrid with images under async scheduling (chunks through the images) and
    with n-gram drafts verified on top of an image prompt (a verifying row's tokens
    at position + delta, its state slots stepping per draft): HF's tokens."""
    llm = make_llm(vl35.path, **config)
    assert_parity(vl35, CASES, run_with_logprobs(llm, vl35, CASES), "qwen3_5_vl")
    llm.llm_engine.shutdown()


def test_ngram_drafts_and_n_completions(vl):
    """Drafts verified on top of an image prompt (positions + delta past the prompt),
    and n = 2 completions sharing an image prompt's blocks: HF's tokens, each image
    encoded once."""
    llm = make_llm(vl.path, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    assert_parity(vl, CASES, run_with_logprobs(llm, vl, CASES), "qwen2_5_vl ngram")
    llm = make_llm(vl.path, block_size=8, enable_prefix_caching=True)
    outs = llm.generate([vl.prompt(t, ims) for t, ims in CASES],
                        SamplingParams(n=2, max_tokens=N, temperature=1.0, top_k=1,
                                       ignore_eos=True), use_tqdm=False)
    for (text, images), out in zip(CASES, outs):
        assert [c.token_ids for c in out.outputs] == [vl.reference(text, images)] * 2
    assert runner_of(llm).num_encoded_images == 3


@pytest.mark.parametrize("which", list(MODELS))
def test_tensor_parallel_parity(request, which):
    """tensor_parallel_size=2: the language model sharded (Qwen3.5's Gated DeltaNet heads
    too), the vision tower whole on each rank (each encodes the step's images itself);
    HF's tokens, chunked through the images."""
    model = request.getfixturevalue(MODELS[which])
    llm = make_llm(model.path, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        assert_parity(model, CASES, run_with_logprobs(llm, model, CASES), f"{which} tp=2")
    finally:
        llm.llm_engine.shutdown()
