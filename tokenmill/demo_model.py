"""A small built-in demo checkpoint, built locally on first use (no network).

`ensure_demo_model()` returns the path of a Hugging Face-format folder holding:

* a Qwen3ForCausalLM with random weights (seeded, so always the same weights;
  saved in bfloat16, about 8 MB): hidden 256, 4 layers, 4 heads, 2 KV heads,
  head_dim 64, tied embeddings;
* a real byte-level BPE tokenizer (about 4096 tokens) trained with the
  `tokenizers` library on the English text below, with the ChatML special tokens
  and a Qwen-style chat template.

Its output is noise (the weights are random); it exists so that the engine, the
CLI and the tests can run end to end anywhere, without downloading a model.

The folder is built in a temporary sibling and renamed into place in one step,
so a process never sees a half-written model, and two processes racing to
build it both end up with the same complete folder.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "demo-qwen3-v1"
# Written last, inside the temporary folder, before the rename: a folder with
# this file is complete.
COMPLETE_MARKER = ".tokenmill-demo-complete"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TARGET_VOCAB_SIZE = 4096
SEED = 0

# ChatML, as Qwen writes it: "<|im_start|>{role}\n{content}<|im_end|>\n" per
# message, then "<|im_start|>assistant\n" when add_generation_prompt is set.
# Content may be a string or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = r"""{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\n' -}}
{%- set content = message['content'] if message['content'] is defined else none -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is string -%}
{{- part -}}
{%- elif part['type'] == 'text' -%}
{{- part['text'] -}}
{%- else -%}
{{- raise_exception('the demo model only takes text content, got a part of type ' + part['type']|string) -}}
{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}
{{- raise_exception('message content must be a string or a list of text parts') -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}"""

# The tokenizer's training text, written for this module.
CORPUS = """\
The town sat where two rivers met, one brown with the silt of the farmland to the north and \
one clear and cold from the hills. For a mile below the bridge you could see the two colors \
running side by side before they finally gave up and mixed. Children liked to stand on the \
railing and argue about exactly where the line disappeared, and nobody ever won the argument, \
because the line moved with the weather, the season and the time of day.

Every morning before sunrise the baker on Mill Street lit her ovens. She made round loaves of \
rye, long white loaves with a crust that cracked when you pressed it, and on Fridays a sweet \
bread braided with raisins and orange peel. She said the secret was patience: dough that was \
hurried tasted of nothing, while dough that was given the whole night tasted of wheat, of salt, \
and a little of the cellar where it rested. By seven o'clock there was a queue at her door, and \
by nine the shelves were empty.

The railway came late to the valley. When the first train arrived, the whole town walked down \
to the station to watch it, and the driver, who had seen a hundred such crowds, waved his cap \
as though he were a king. Within a year people were taking the train to the city to sell \
cheese and wool, and coming back with newspapers, sewing machines, and opinions. Some of the \
old families complained that the town had become noisy. Most of them bought tickets anyway.

A library is a strange kind of machine. It takes in paper and gives back attention, and it \
works best when nobody notices that it is working at all. The librarian knew which readers \
wanted to be left alone and which wanted to talk, which ones would return a book early and \
which would keep it until the spine split. She kept a notebook of recommendations, and over \
forty years it grew into seven volumes that were, in their own way, a history of the town.

Gardening teaches you to think in seasons rather than days. In spring you plant more seeds \
than you need, because some will fail and you cannot know which. In summer you water in the \
evening, when the soil is warm and the sun will not steal the water before the roots can \
drink it. In autumn you collect seeds from the strongest plants, dry them on paper, and label \
the envelopes carefully. In winter you read catalogues, make plans, and forget half of them.

On clear nights the old teacher carried a small telescope up the hill behind the school. He \
showed the students the craters of the moon, the rings of Saturn, and the four bright moons of \
Jupiter that Galileo had seen. He told them that light from some of the stars had left them \
before anyone in the valley was born, and that looking up was therefore a way of looking back. \
One student asked whether the stars could see us too. He thought about it for a long time and \
said that, if they could, they were seeing a valley with no town in it at all.

Computers count in binary, but people count in stories. A program reads numbers such as 0, 1, \
2, 3, 10, 42, 100, 256, 1024, 2048 and 4096; it adds, compares, and stores them, and it never \
wonders what they mean. A person reading the same numbers asks questions: How many? How much? \
How long ago? Is that a lot? The answer to the last question is almost always: it depends. \
Good software, like a good teacher, helps people ask better questions instead of giving them \
answers they did not need.

Weather in the valley changed quickly. A bright morning could turn grey by noon, and a storm \
that looked as if it would last all week could vanish overnight, leaving the air washed and \
the roads steaming. Farmers watched the clouds over the western ridge; fishermen watched the \
color of the water; the baker watched the way her dough rose. Each of them was sure that their \
own method was the only reliable one, and each of them was wrong about once a month.

In the end, what people remembered about the town was not the bridge, the trains, or the \
bread, but the feeling of walking home on a summer evening, when the light lay long across the \
fields, the swallows flew low over the water, and someone, somewhere, was always practicing \
the piano with the window open.
"""


def _corpus_lines() -> list[str]:
    """The training text with a few deterministic variations, so BPE has enough pairs to merge."""
    paragraphs = [p.strip() for p in CORPUS.split("\n\n") if p.strip()]
    lines: list[str] = []
    for p in paragraphs:
        lines += [p, p.lower(), p.upper(), p.title()]
        # Sentences one per line, as chat turns and short prompts look.
        lines += [s.strip() + "." for s in p.split(". ") if s.strip()]
    # Numbers, dates and a little code-shaped text.
    lines.append(" ".join(str(i) for i in range(1000)))
    lines.append(" ".join(f"{y}-{m:02d}-{d:02d}" for y in (1999, 2024, 2025)
                          for m in range(1, 13) for d in (1, 15, 28)))
    lines.append("def main():\n    for i in range(10):\n        print(i, i * i)\n\n"
                 "if __name__ == \"__main__\":\n    main()\n")
    lines.append("{\"name\": \"demo\", \"size\": 256, \"layers\": 4, \"ok\": true}")
    # The shape of a chat (the special tokens themselves are not trained on).
    lines += ["system\nYou are a helpful assistant.\nuser\nWhat is the weather like in the "
              "valley today?\nassistant\nIt changes quickly, so bring a coat.\n"] * 8
    lines.append("\n\n".join(paragraphs))
    # Every word on its own line (so without a leading space), in four spellings.
    words = sorted(set(re.findall(r"[A-Za-z']+", CORPUS)))
    for spell in (str, str.lower, str.title, str.upper):
        lines.append("\n".join(spell(w) for w in words))
    return lines


def default_demo_model_dir() -> str:
    root = os.environ.get("TOKENMILL_CACHE")
    if not root:
        root = os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return os.path.join(root, DEMO_MODEL_NAME)


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def ensure_demo_model(cache_dir: str | None = None) -> str:
    """The path of the demo checkpoint, building it there on first use.

    `cache_dir` is the model folder itself; without it, $TOKENMILL_CACHE/demo-qwen3-v1,
    else ~/.cache/tokenmill/demo-qwen3-v1. An existing folder is reused if it is
    complete; an empty one is filled; any other existing folder is an error
    (nothing of the caller's is overwritten).
    """
    final = os.path.abspath(os.path.expanduser(cache_dir) if cache_dir else default_demo_model_dir())
    if is_complete(final):
        return final
    if os.path.isdir(final) and os.listdir(final):
        raise ValueError(f"{final} exists and is not a complete tokenmill demo model "
                         f"(no {COMPLETE_MARKER}); remove it or choose another folder")
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)  # mode 0o777 less the umask, as the final folder should be
    logger.info("building the demo model in %s (once)", final)
    try:
        build_demo_model(tmp)
        marker = os.path.join(tmp, COMPLETE_MARKER)
        with open(marker, "w") as f:
            json.dump({"name": DEMO_MODEL_NAME}, f)
            f.write("\n")
        # Some writers create 0o600 files; give them all the marker's (umask) mode.
        mode = os.stat(marker).st_mode & 0o777
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), mode)
        try:
            # Atomic; replaces `final` only if it is missing or an empty folder.
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (or the folder was filled meanwhile).
            if not is_complete(final):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---- building --------------------------------------------------------------
def train_tokenizer():
    """A byte-level BPE `tokenizers.Tokenizer`, the same every time."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    return tok


def build_tokenizer(out_dir: str):
    """Train the tokenizer, wrap it for transformers and save it to `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode(encode(text)) == text
        model_max_length=4096,
    )
    hf_tok.save_pretrained(out_dir)
    _make_tokenizer_config_portable(os.path.join(out_dir, "tokenizer_config.json"))
    return hf_tok


def _make_tokenizer_config_portable(path: str) -> None:
    """transformers 5 writes names that transformers 4 cannot load; write the ones both read."""
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, list):  # 4.x wants a dict here; both read the old key
        del cfg["extra_special_tokens"]
        cfg["additional_special_tokens"] = extra
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


def build_demo_model(out_dir: str) -> None:
    """Write the demo tokenizer, config, generation config and weights into `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tok = build_tokenizer(out_dir)
    eos_id = tok.eos_token_id
    pad_id = tok.pad_token_id
    # Qwen has no BOS token in the tokenizer; its config names <|endoftext|>.
    bos_id = tok.bos_token_id
    if bos_id is None:
        bos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        # Wider than the usual 0.02: with 0.02 greedy decoding collapses into one token
        # repeated, which makes a poor check that an engine computes the right thing.
        initializer_range=0.1,
        # rope_parameters left at the default (theta 10000): transformers 4, which reads
        # only `rope_theta`, then gets the same value from this config as 5 does.
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        architectures=["Qwen3ForCausalLM"],
    )
    # Seeded without disturbing the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        with _default_dtype(torch.float32):
            model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id,
                                               pad_token_id=pad_id)
    with _no_hf_progress_bars():
        model.save_pretrained(out_dir, safe_serialization=True)


@contextlib.contextmanager
def _no_hf_progress_bars():
    from transformers.utils import logging as hf_logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
