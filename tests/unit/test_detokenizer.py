"""IncrementalDetokenizer on a byte-level BPE tokenizer (the demo model's).

Properties checked, for tokens fed one at a time and in random chunks:
* the concatenated deltas plus finish() equal decoding all the output ids at once;
* when that full decode is clean (no U+FFFD), no delta ever carries U+FFFD (no
  broken multi-byte character), the text shown so far is always a prefix of
  the full text, and nothing is held back once the tokens end on a whole character.
"""
from __future__ import annotations

import random

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"

TEXTS = [
    "The baker on Mill Street lit her ovens before sunrise.",
    "héllo wörld — 日本語 🙂 emoji",
    "naïve café, Ünïcödé tëxt: ½ ∑ ≠ 𝄞 👩‍👩‍👧 ok",
    "<|im_start|>user\nhé 日本<|im_end|>\n<|im_start|>assistant\n🙂<|im_end|>",
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tokenmill.demo_model import ensure_demo_model
    return AutoTokenizer.from_pretrained(ensure_demo_model())


def _byte_alphabet() -> dict[int, str]:
    """GPT-2 style byte -> printable char map used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) \
        + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


@pytest.fixture(scope="module")
def byte_ids(tok) -> list[int]:
    """byte value -> the id of the single-byte token for it."""
    alphabet = _byte_alphabet()
    ids = [tok.convert_tokens_to_ids(alphabet[b]) for b in range(256)]
    assert len(set(ids)) == 256 and tok.unk_token_id not in ids
    for b in (0x41, 0x20, 0x0A):  # sanity: they decode to the byte
        assert tok.decode([ids[b]]) == bytes([b]).decode()
    return ids


def bytes_as_tokens(byte_ids, data: bytes) -> list[int]:
    """The worst case: every byte its own token, so every multi-byte char is split."""
    return [byte_ids[b] for b in data]


def chunks(ids: list[int], rng: random.Random | None):
    """One token at a time (rng None) or random chunk sizes 1..5 (some empty)."""
    i = 0
    while i < len(ids):
        k = 1 if rng is None else rng.choice([0, 1, 1, 2, 3, 5])
        yield ids[i:i + k]
        i += k


def run(tok, prompt_ids, ids, skip_special_tokens=True, rng=None, check_prefix=False):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    clean = FFFD not in full
    deltas, fed = [], []
    for piece in chunks(ids, rng):
        fed += piece
        d = detok.update(piece)
        deltas.append(d)
        if clean:
            assert FFFD not in d, (fed, deltas)
            so_far = "".join(deltas)
            assert full.startswith(so_far), (so_far, full)
            if check_prefix:
                now = tok.decode(fed, skip_special_tokens=skip_special_tokens)
                if not now.endswith(FFFD):  # ends on a whole character: all of it shown
                    assert so_far == now, (fed, so_far, now)
    tail = detok.finish()
    deltas.append(tail)
    assert "".join(deltas) == full, (ids, deltas, full)
    assert detok.text == full
    if clean:
        assert FFFD not in tail
    return deltas


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("text_idx", range(len(TEXTS)))
def test_real_tokenization_one_at_a_time_and_chunked(tok, text_idx, skip):
    ids = tok.encode(TEXTS[text_idx])
    context = tok.encode("Once upon a time,")
    for prompt in ([], context):
        run(tok, prompt, ids, skip, rng=None, check_prefix=True)
        for seed in range(5):
            run(tok, prompt, ids, skip, rng=random.Random(seed), check_prefix=True)


def test_unicode_text_splits_characters_across_tokens(tok):
    # The demo vocabulary has no merges for these characters: their bytes are
    # separate tokens, which is the case the hold-back exists for.
    text = "héllo wörld — 日本語 🙂 emoji"
    ids = tok.encode(text)
    assert any(FFFD in tok.decode([t]) for t in ids)
    deltas = run(tok, [], ids, rng=None, check_prefix=True)
    assert "".join(deltas) == text
    assert "" in deltas  # something was held back while a character was incomplete
    for ch in "éö—日本語🙂":
        assert ch in deltas, f"{ch!r} not emitted whole: {deltas}"


def test_every_multibyte_char_split_into_single_bytes(tok, byte_ids):
    rng = random.Random(7)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x52F), (0x3040, 0x30FF),
              (0x4E00, 0x9FFF), (0x1F300, 0x1F64F), (0x1D400, 0x1D4FF)]
    for trial in range(60):
        chars = []
        for _ in range(rng.randint(1, 12)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        text = "".join(chars)
        ids = bytes_as_tokens(byte_ids, text.encode("utf-8"))
        assert tok.decode(ids) == text
        for r in (None, random.Random(trial)):
            deltas = run(tok, [], ids, rng=r, check_prefix=True)
            # every delta is whole characters of the text, in order
            assert "".join(deltas) == text


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_random_token_ids_join_to_the_full_decode(tok, byte_ids, skip):
    """Random ids may form invalid UTF-8; after finish() the text must still be
    exactly the full decode (with its U+FFFD where the bytes are invalid)."""
    rng = random.Random(1234 if skip else 4321)
    vocab = len(tok)
    specials = list(tok.all_special_ids)
    high_bytes = [byte_ids[b] for b in range(0x80, 0x100)]
    for trial in range(150):
        n = rng.randint(1, 30)
        pool = rng.choice(["vocab", "bytes", "mixed"])
        ids = []
        for _ in range(n):
            if pool == "vocab" or (pool == "mixed" and rng.random() < 0.4):
                ids.append(rng.randrange(vocab))
            elif pool == "mixed" and rng.random() < 0.2:
                ids.append(rng.choice(specials))
            else:
                ids.append(rng.choice(high_bytes))
        run(tok, [], ids, skip, rng=None)
        run(tok, [], ids, skip, rng=rng)
        # A prompt context changes nothing, whatever it ends with.
        run(tok, tok.encode("Mill Street"), ids, skip, rng=rng)
        prompt = [rng.choice(high_bytes + specials + [rng.randrange(vocab)])
                  for _ in range(rng.randint(1, 8))]
        run(tok, prompt, ids, skip, rng=rng)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>assistant\nhi 日<|im_end|>")
    assert "".join(run(tok, [], ids, True)) == "assistant\nhi 日"
    assert "".join(run(tok, [], ids, False)) == "<|im_start|>assistant\nhi 日<|im_end|>"


def test_lone_invalid_bytes_are_flushed_by_finish(tok, byte_ids):
    # A lead byte with nothing after it: held back until finish().
    ids = bytes_as_tokens(byte_ids, b"ok\xe6")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.update(ids[:2]) == "ok"
    assert detok.update(ids[2:]) == ""
    assert detok.finish() == FFFD
    assert detok.finish() == ""  # nothing twice
    # A lead byte followed by ASCII: both come out as soon as the ASCII arrives.
    ids = bytes_as_tokens(byte_ids, b"\xe6\x97A")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.update(ids[:1]) == "" and detok.update(ids[1:2]) == ""
    assert detok.update(ids[2:]) == FFFD + "A"
    assert detok.finish() == ""


@pytest.mark.parametrize("cut", [1, 2])
def test_prompt_ending_inside_a_character(tok, byte_ids, cut):
    """The prompt (as token ids) ends with the first bytes of a character and the
    output starts with the rest. The output must not silently lose those bytes:
    its text is the decode of its own ids (U+FFFD for the orphan continuation
    bytes), like every other output."""
    data = "ab日cd".encode("utf-8")  # 日 = e6 97 a5, bytes 2..4
    tokens = bytes_as_tokens(byte_ids, data)
    prompt, out = tokens[:2 + cut], tokens[2 + cut:]
    expected = tok.decode(out)
    assert expected == FFFD * (3 - cut) + "cd"  # one U+FFFD per orphan byte
    for r in (None, random.Random(cut)):
        detok = IncrementalDetokenizer(tok, prompt)
        text = "".join(detok.update(p) for p in chunks(out, r)) + detok.finish()
        assert text == expected
