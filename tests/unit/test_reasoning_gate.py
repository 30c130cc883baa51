"""A grammar held until the reasoning ends (--reasoning-parser): the manager's bitmask
rows for a gated request against an ungated twin of the same grammar (the reference):
none while it thinks, the grammar's plus the start tag before an output that may open a
block, the grammar's once the end tag is through; drafts that cross the end tag; where the
output starts, read from the prompt's ids; a tokenizer without the tag refused by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill import StructuredOutputsParams
from tokenmill.errors import ParamError
from tokenmill.parsers.registry import get_reasoning_parser
from tokenmill.sample.bitmask import unpack_bitmask
from tokenmill.structured_output.reasoning_gate import prompt_starts_in_reasoning

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(demo_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo_path)
    tok.add_tokens(["<think>", "</think>"])
    return tok


def manager_for(tok, parser: str | None):
    from tokenmill.structured_output.manager import StructuredOutputManager
    return StructuredOutputManager(tok, len(tok), [tok.eos_token_id],
                                   reasoning_parser=get_reasoning_parser(parser)
                                   if parser else None)


class _Req:
    def __init__(self, so_req):
        self.structured_output = so_req


def ready(manager, so_req):
    while not so_req.ready():
        manager.wait_for_grammars(1.0)
    return so_req


def rows_of(manager, so_req, drafts=None):
    """The request's rows this step (None: no row), as [R, V] bool."""
    spec = {"r": drafts} if drafts is not None else None
    rows, bm = manager.grammar_bitmask({"r": _Req(so_req)}, {"r": 1}, spec)
    if not rows:
        return None
    return unpack_bitmask(torch.from_numpy(bm), manager.vocab_size).numpy()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def gated(tok):
    return manager_for(tok, "qwen3"), manager_for(tok, None)


def test_prompt_says_where_the_output_starts(tok):
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert prompt_starts_in_reasoning(ids(tok, "hi<think>\n"), start, end) is True
    assert prompt_starts_in_reasoning(ids(tok, "hi<think>\n\n</think>\n\n"), start, end) is False
    assert prompt_starts_in_reasoning(ids(tok, "<think>x</think> then <think>"), start, end)
    assert prompt_starts_in_reasoning(ids(tok, "no tags at all"), start, end) is None
    # the text parser reads the same from the rendered prompt
    qwen3 = get_reasoning_parser("qwen3")
    for text in ("hi<think>\n", "a<think>\n\n</think>\n\n", "none"):
        assert prompt_starts_in_reasoning(ids(tok, text), start, end) == \
            qwen3.starts_in_reasoning(text)


def test_thinking_is_free_then_the_grammar_applies(tok, gated):
    gm, plain = gated
    sop = StructuredOutputsParams(json=SCHEMA)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    ref = ready(plain, plain.new_request("ref", sop))
    req = ready(gm, gm.new_request("r", sop, ids(tok, "<|im_start|>assistant\n")))
    first = rows_of(plain, ref)[0]
    # undecided (qwen3, no tag in the prompt): the grammar's tokens, and the start tag
    got = rows_of(gm, req)[0]
    assert got[start] and not first[start]
    got[start] = False
    assert np.array_equal(got, first)
    assert not req.advance(start)
    # thinking: no row at all, and tokens the grammar would refuse pass without a word
    for t in ids(tok, "hmm, not JSON }}]") + [start]:
        assert not req.advance(t)
        assert rows_of(gm, req) is None
    assert not req.advance(end)
    # the answer: exactly the ungated grammar, token for token
    for t in ids(tok, '{"a":'):
        assert np.array_equal(rows_of(gm, req)[0], rows_of(plain, ref)[0])
        assert not req.advance(t) and not ref.advance(t)
    assert np.array_equal(rows_of(gm, req)[0], rows_of(plain, ref)[0])


def test_an_answer_without_thinking_takes_the_grammar_at_once(tok, gated):
    gm, plain = gated
    sop = StructuredOutputsParams(json=SCHEMA)
    ref = ready(plain, plain.new_request("ref", sop))
    prompt = ids(tok, "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    req = ready(gm, gm.new_request("r", sop, prompt))
    brace = ids(tok, "{")[0]
    assert not req.advance(brace) and not ref.advance(brace)  # the first token is the answer's
    assert np.array_equal(rows_of(gm, req)[0], rows_of(plain, ref)[0])


def test_deepseek_r1_starts_in_reasoning_and_drafts_cross_the_end(tok):
    gm, plain = manager_for(tok, "deepseek_r1"), manager_for(tok, None)
    sop = StructuredOutputsParams(json=SCHEMA)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    ref = ready(plain, plain.new_request("ref", sop))
    req = ready(gm, gm.new_request("r", sop, ids(tok, "<|im_start|>assistant\n")))
    assert rows_of(gm, req) is None  # thinking from the first token
    word = ids(tok, "so")
    answer = ids(tok, '{"a":')
    drafts = word + [end] + answer
    rows = rows_of(gm, req, drafts)
    assert rows.shape[0] == 1 + len(drafts)
    assert rows[: len(word) + 1].all()  # up to and with the end tag: free
    ref_rows = rows_of(plain, ref, answer)
    assert np.array_equal(rows[len(word) + 1:], ref_rows)
    # the walk over the drafts left both the gate and the matcher where they were
    assert rows_of(gm, req) is None
    for t in drafts:
        assert not req.advance(t)
    for t in answer:
        assert not ref.advance(t)
    assert np.array_equal(rows_of(gm, req)[0], rows_of(plain, ref)[0])


def test_a_tokenizer_without_the_end_tag_is_refused_naming_both(demo_path):
    from transformers import AutoTokenizer
    plain_tok = AutoTokenizer.from_pretrained(demo_path)
    gm = manager_for(plain_tok, "qwen3")
    sop = StructuredOutputsParams(json=SCHEMA)
    sop._origin = "response_format"
    with pytest.raises(ParamError) as e:
        gm.validate(sop)
    assert e.value.param == "response_format"
    assert str(e.value).startswith("response_format: ")
    assert "--reasoning-parser qwen3" in str(e.value) and "</think>" in str(e.value)
