"""A tiny random Qwen2.5-VL checkpoint with its tokenizer and image processor, built
locally (no network): the multimodal tests' model.

The vision tower is small enough that an image of a few dozen pixels a side
becomes a few dozen patches: patch 4, temporal patch 2, 2 x 2 spatial merge (one
placeholder token per 8 x 8 pixels), windows of 2 x 2 merged tokens (so the
window attention blocks see several windows), block 1 full attention. The
tokenizer is a word-level one over a small vocabulary plus the Qwen-VL special
tokens, with a chat template that renders an image part as
<|vision_start|><|image_pad|><|vision_end|>.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch

WORDS = ("user assistant system the a an of to and in is it that this what describe picture image color "
         "red green blue big small left right top bottom cat dog sky tree house car "
         "there are how many one two three please short answer yes no see").split()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
           "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = r"""{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\n' -}}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}{{- part['text'] -}}
{%- elif part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

VL_TEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-6, initializer_range=0.2,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 3, 3]})
VL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                 temporal_patch_size=2, spatial_merge_size=2, window_size=16,
                 out_hidden_size=64, fullatt_block_indexes=[1], initializer_range=0.2)
# Images are resized to multiples of 8 pixels, between 8 x 8 and 64 x 64 pixels worth.
IMAGE_PROCESSOR = dict(patch_size=4, temporal_patch_size=2, merge_size=2,
                       min_pixels=8 * 8, max_pixels=64 * 64)


def build_tokenizer(path: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS + ["[UNK]", "\n", "?", ".", ","])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    # words, punctuation and newlines are tokens; spaces separate them
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"<\|[a-z_]+\|>|\n|[?.,]"), behavior="isolated"),
        pre_tokenizers.WhitespaceSplit()])
    tk.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def _build(path: str, config_cls, model_cls, text: dict, vision: dict, seed: int,
           larger: tuple[str, ...] = ("norm",), finish=None):
    """Save a tiny random VL model (fp32), the tokenizer and the image processor to
    `path`; return the HF model (eval). Biases, norms (names containing one of
    `larger`) and the vision weights are drawn wider than HF's init, so that every
    part moves the output; then `finish(model)`, if given, before saving."""
    import transformers as tf
    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_cls(
            text_config=dict(text, bos_token_id=None, eos_token_id=None),
            vision_config=dict(vision),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
        model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif any(k in name for k in larger):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "visual" in name:  # larger vision weights: image features that matter
                p.normal_(0.0, 0.3)
    if finish is not None:
        finish(model)
    model.save_pretrained(path)
    tf.Qwen2VLImageProcessor(**IMAGE_PROCESSOR).save_pretrained(path)
    return model


def build_vl_checkpoint(path: str, seed: int = 0):
    """Save the tiny Qwen2.5-VL model, tokenizer and image processor to `path`; return
    the HF model (eval, fp32)."""
    import transformers as tf
    return _build(path, tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration, VL_TEXT,
                  VL_VISION, seed, larger=("norm", "ln_q"))


QWEN3_VL_TEXT = dict(VL_TEXT, head_dim=16,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "mrope_section": [2, 3, 3], "mrope_interleaved": True})
# Qwen3-VL's tower: no windows, a learned 4 x 4 position grid resampled to each
# image, LayerNorm, gelu-tanh MLP, deepstack features from blocks 0 and 1.
QWEN3_VL_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                       patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                       out_hidden_size=64, num_position_embeddings=16,
                       deepstack_visual_indexes=[0, 1], initializer_range=0.2)


def build_qwen3_vl_checkpoint(path: str, seed: int = 0):
    """The tiny Qwen3-VL counterpart of build_vl_checkpoint (same tokenizer and image
    processor)."""
    import transformers as tf
    return _build(path, tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration, QWEN3_VL_TEXT,
                  QWEN3_VL_VISION, seed)


# Qwen3.5: the hybrid text model (Gated DeltaNet layers 0 and 2, gated attention layers
# 1 and 3; 2 key heads serve 4 value heads), partial rotary over 16 of 32 head dims
# with interleaved M-RoPE; Qwen3-VL's tower without DeepStack. Weights drawn with std
# 0.1 and the Gated DeltaNet / norm parameters of hybrid_like_trained: see there.
QWEN3_5_VL_TEXT = dict(VL_TEXT, num_hidden_layers=4, head_dim=32, initializer_range=0.1,
                       layer_types=["linear_attention", "full_attention"] * 2,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=8,
                       linear_conv_kernel_dim=4,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.5,
                                        "mrope_section": [2, 3, 3], "mrope_interleaved": True})
QWEN3_5_MOE_VL_TEXT = dict(QWEN3_5_VL_TEXT, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48)
QWEN3_5_VL_VISION = {k: v for k, v in QWEN3_VL_VISION.items() if k != "deepstack_visual_indexes"}


def hybrid_like_trained(model) -> None:
    """Draw a Qwen3.5 / Qwen3-Next model's Gated DeltaNet decay parameters and its
    zero-centred norms the way trained checkpoints have them (the last step of the tiny
    hybrid test checkpoints; the vision tower is left alone), all far from HF's
    defaults, so that a loader that drops or mistransforms one of them fails.

    - A token's decay g = -exp(A_log) * softplus(a + dt_bias): A_log ~ N(-1, 0.3) and
      dt_bias ~ N(-2, 0.3) make g ~ -0.05 (as Mamba-style A in [1, 16] times dt in
      [1e-3, 0.1]): the state keeps tens of tokens. Around A_log = dt_bias = 0 it kept
      one or two, so a head's output was about one key's (q . k) v, near 0 whenever q
      is near orthogonal to k, and the gated RMSNorm over the head's values scaled that
      cancellation, fp32 error included, up to unit size.
    - The other RMSNorms scale by 1 + weight, and trained weights sit around 0:
      N(0, 0.2). (The 1 + 0.2 * randn meant for weight-scaled norms doubled every
      block's input and the logits, and made the attention logits 4x.)

    With the weights' std 0.1 (HYBRID, QWEN3_5_VL_TEXT), fp32 rounding moves these
    checkpoints' logprobs by ~1e-5 (it was up to 7e-4: past the parity suites' 1e-4).
    """
    with torch.no_grad():
        for name, m in model.named_modules():
            if "visual" in name:
                continue
            if type(m).__name__.endswith("RMSNorm"):  # (...RMSNormGated scales by its weight)
                m.weight.normal_(0.0, 0.2)
            elif hasattr(m, "A_log") and hasattr(m, "dt_bias"):
                m.A_log.normal_(-1.0, 0.3)
                m.dt_bias.normal_(-2.0, 0.3)


def build_qwen3_5_vl_checkpoint(path: str, seed: int = 0, moe: bool = False):
    """Tiny Qwen3_5ForConditionalGeneration (or, `moe`, Qwen3_5MoeForConditionalGeneration)
    with the same tokenizer and image processor."""
    import transformers as tf
    if moe:
        return _build(path, tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration,
                      QWEN3_5_MOE_VL_TEXT, QWEN3_5_VL_VISION, seed, finish=hybrid_like_trained)
    return _build(path, tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration, QWEN3_5_VL_TEXT,
                  QWEN3_5_VL_VISION, seed, finish=hybrid_like_trained)


def hf_processor(path: str):
    import transformers as tf
    return tf.AutoProcessor.from_pretrained(path)


def make_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A random RGB image [h, w, 3] uint8."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
