"""Structured output, the pieces: StructuredOutputsParams checks, the packed bitmask
on the logits (CPU numpy path and tensor path), its place in the sampler, the
runner's compact-row -> batch-row mapping, and the manager (cache, bitmask rows)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.sample.bitmask import apply_grammar_bitmask, unpack_bitmask
from tokenmill.sample.sampler import Sampler, SamplingMetadata


# ---- params ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(), "structured_outputs"),
    (dict(json={"type": "object"}, regex="a+"), "structured_outputs"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice="yes"), "structured_outputs.choice"),
    (dict(choice=["a", 1]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(grammar=5), "structured_outputs.grammar"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json="[1, 2]"), "structured_outputs.json"),
    (dict(json_object="yes"), "structured_outputs.json_object"),
    (dict(regex="a", disable_any_whitespace=1), "structured_outputs.disable_any_whitespace"),
])
def test_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kwargs)
    assert str(e.value).startswith(field)


def test_params_kinds_keys_and_sampling_params():
    sop = StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert sop.kind == "json" and sop.json["properties"] == {"b": {}, "a": {}}
    # JSON keeps its key order in the key (property order is output order)
    other = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert sop.cache_key() != other.cache_key()
    assert sop.cache_key() == StructuredOutputsParams(json=dict(sop.json)).cache_key()
    assert StructuredOutputsParams(regex="a", disable_any_whitespace=True).cache_key() != \
        StructuredOutputsParams(regex="a").cache_key()
    assert StructuredOutputsParams(json_object=False, regex="x").kind == "regex"
    sp = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert isinstance(sp.structured_outputs, StructuredOutputsParams)
    assert sp.clone(n=2, temperature=1.0).structured_outputs is sp.structured_outputs
    with pytest.raises(ValueError, match="^structured_outputs: unknown field 'regexp'"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(ValueError, match="^structured_outputs must be an object"):
        SamplingParams(structured_outputs="a+")


# ---- the bitmask on the logits -----------------------------------------------------
def pack(allowed: np.ndarray) -> torch.Tensor:
    """[R, V] bool -> [R, ceil(V / 32)] int32 in xgrammar's layout, the slow obvious way."""
    r, v = allowed.shape
    words = np.zeros((r, -(-v // 32)), dtype=np.uint32)
    for i in range(r):
        for t in np.nonzero(allowed[i])[0]:
            words[i, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return torch.from_numpy(words.view(np.int32))


@pytest.mark.parametrize("vocab", [64, 70, 1000])
def test_unpack_matches_the_bit_layout(vocab):
    rng = np.random.default_rng(vocab)
    allowed = rng.random((5, vocab)) < 0.3
    allowed[:, 31] = True  # bit 31: the sign bit of the int32 word
    bm = pack(allowed)
    assert torch.equal(unpack_bitmask(bm, vocab), torch.from_numpy(allowed))


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 0], [2]])
def test_apply_masks_only_the_given_rows(rows):
    rng = np.random.default_rng(1)
    n, vocab = 4, 100
    logits = torch.randn(n, vocab)
    allowed = rng.random((len(rows), vocab)) < 0.2
    bm = pack(allowed)
    out = apply_grammar_bitmask(logits.clone(), torch.tensor(rows), bm)
    expect = logits.clone()
    for i, r in enumerate(rows):
        expect[r, ~torch.from_numpy(allowed[i])] = float("-inf")
    assert torch.equal(out, expect)
    # the tensor-op path (used off the CPU) gives the same
    sub = logits.clone()
    idx = torch.tensor(rows)
    part = sub.index_select(0, idx).masked_fill_(~unpack_bitmask(bm, vocab), float("-inf"))
    assert torch.equal(sub.index_copy_(0, idx, part), expect)


@pytest.mark.parametrize("vocab", [1, 31, 32, 70, 1000, 32000])
def test_native_bitmask_equals_the_numpy_path(ops, vocab):
    """The native grammar_bitmask_ at every level against the numpy unpacking: words
    allowing everything, forbidding everything, single bits, bit 31; vocabularies that
    are not whole words; a bitmask wider than the vocabulary (its extra bits ignored);
    a subset of the rows in any order."""
    rng = np.random.default_rng(vocab)
    n = 9
    logits = torch.randn(n, vocab)
    rows = [7, 0, 3, 8, 5]
    allowed = rng.random((len(rows), vocab)) < np.array([0.0, 0.05, 0.5, 0.97, 1.0])[:, None]
    allowed[1, :min(vocab, 32)] = True  # a whole word allowed (where there is one)
    allowed[2, 32:64] = False  # a whole word forbidden
    allowed[3, 31::32] = True  # bit 31
    bm = pack(allowed)
    wide = torch.cat([bm, torch.zeros(len(rows), 2, dtype=torch.int32)], dim=1)
    for bitmask in (bm, wide):
        want = apply_grammar_bitmask(logits.clone(), torch.tensor(rows), bitmask)
        got = apply_grammar_bitmask(logits.clone(), torch.tensor(rows), bitmask, ops)
        assert torch.equal(got, want)
    assert torch.isinf(want[7]).all() and torch.equal(want[[1, 2, 4, 6]], logits[[1, 2, 4, 6]])


def test_native_bitmask_refuses_bad_input(ops):
    logits, bm = torch.randn(2, 64), torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the batch"):
        ops.grammar_bitmask_(logits, torch.tensor([2]), bm)
    with pytest.raises(RuntimeError, match="outside the batch"):
        ops.grammar_bitmask_(logits, torch.tensor([-1]), bm)
    with pytest.raises(RuntimeError, match="bitmask must be"):
        ops.grammar_bitmask_(logits, torch.tensor([0, 1]), bm)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.grammar_bitmask_(logits.bfloat16(), torch.tensor([0]), bm)


def _md(n, greedy=True, logprobs=None):
    return SamplingMetadata(
        temperature=torch.ones(n), greedy_mask=torch.full((n,), greedy), all_greedy=greedy,
        all_random=not greedy, top_k=None, top_p=None, max_num_logprobs=logprobs)


def test_sampler_applies_the_grammar_after_raw_logprobs_before_processors():
    torch.manual_seed(0)
    n, vocab = 3, 50
    logits = torch.randn(n, vocab)
    allowed = np.zeros((1, vocab), dtype=bool)
    allowed[0, [7, 11]] = True
    md = _md(n, logprobs=2)
    md.grammar_bitmask = (torch.tensor([1]), pack(allowed))
    # logit_bias pushes a forbidden token up: the grammar still wins (it masks first)
    md.logit_bias = (torch.tensor([1]), torch.tensor([3]), torch.tensor([100.0]))
    raw = logits.log_softmax(-1)
    out = Sampler()(logits.clone(), md)
    ids = out.sampled_token_ids.tolist()
    assert ids[1] == (7 if logits[1, 7] > logits[1, 11] else 11)
    assert ids[0] == int(logits[0].argmax()) and ids[2] == int(logits[2].argmax())
    # logprobs are the model's, before the grammar
    assert torch.allclose(out.logprobs.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert torch.allclose(out.logprobs.logprobs[1, 1:], raw[1].topk(2).values)


def test_random_rows_sample_only_allowed_tokens():
    torch.manual_seed(0)
    n, vocab = 4, 300
    allowed = np.zeros((2, vocab), dtype=bool)
    allowed[0, [5, 250]] = True
    allowed[1, 17] = True
    for _ in range(20):
        md = _md(n, greedy=False)
        md.grammar_bitmask = (torch.tensor([3, 0]), pack(allowed))
        ids = Sampler()(torch.randn(n, vocab), md).sampled_token_ids.tolist()
        assert ids[3] in (5, 250) and ids[0] == 17


# ---- the manager -------------------------------------------------------------------
@pytest.fixture(scope="module")
def manager():
    from transformers import AutoTokenizer

    from tokenmill.demo_model import ensure_demo_model
    from tokenmill.structured_output.manager import StructuredOutputManager
    tok = AutoTokenizer.from_pretrained(ensure_demo_model())
    return StructuredOutputManager(tok, 4096, [tok.eos_token_id])


class _Req:
    def __init__(self, so_req):
        self.structured_output = so_req


@pytest.mark.parametrize("sop, field", [
    (StructuredOutputsParams(json={"type": "foo"}), "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "object", "properties": 3}),
     "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "string", "minLength": "x"}),
     "structured_outputs.json"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(regex="[a-z"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= foo"), "structured_outputs.grammar"),
    (StructuredOutputsParams(grammar="root := 'a'"), "structured_outputs.grammar"),
    (StructuredOutputsParams(structural_tag={"type": "structural_tag",
                                             "format": {"type": "bogus"}}),
     "structured_outputs.structural_tag"),
])
def test_manager_rejects_bad_grammars_naming_the_field(manager, sop, field):
    before = manager.num_compiled
    with pytest.raises(ValueError) as e:
        manager.validate(sop)
    msg = str(e.value)
    assert msg.startswith(field + ": invalid"), msg
    assert "/project/" not in msg and ".cc:" not in msg  # xgrammar's C++ location stripped
    assert manager.num_compiled == before


def test_manager_caches_compiles_and_builds_compact_rows(manager):
    from tokenmill.structured_output.manager import StructuredOutputRequest
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    before = manager.num_compiled
    r1 = manager.new_request("r1", StructuredOutputsParams(json=schema))
    r2 = manager.new_request("r2", StructuredOutputsParams(json=json.dumps(schema)))
    r3 = manager.new_request("r3", StructuredOutputsParams(choice=["yes", "no"]))
    assert manager.num_compiled == before + 2  # r1 and r2 share one compilation
    for r in (r1, r2, r3):
        assert isinstance(r, StructuredOutputRequest)
        while not r.ready():
            manager.wait_for_grammars(1.0)
    tok = manager.tokenizer
    for t in tok.encode('{"a":', add_special_tokens=False):
        assert not r1.advance(t)
    requests = {"r1": _Req(r1), "x": _Req(None), "r3": _Req(r3)}
    rows, bm = manager.grammar_bitmask(requests, {"x": 1, "r3": 1, "gone": 1, "r1": 1})
    assert rows == {"r3": 0, "r1": 1}
    assert bm.shape == (2, 4096 // 32) and bm.dtype == np.int32
    allowed = unpack_bitmask(torch.from_numpy(bm), 4096)
    digits = tok.encode("7", add_special_tokens=False)
    assert allowed[1, digits[0]] and not allowed[1, tok.encode("}", add_special_tokens=False)[0]]
    yes = tok.encode("yes", add_special_tokens=False)
    assert allowed[0, yes[0]]
    for t in tok.encode("7}", add_special_tokens=False):
        assert not r1.advance(t)
    assert r1.advance(tok.eos_token_id) and r1.is_terminated()  # the grammar ended: stop
    assert manager.grammar_bitmask({}, {"r1": 1}) == ({}, None)


# ---- the runner: compact rows -> its batch rows -----------------------------------
def test_runner_maps_compact_rows_to_batch_rows():
    from types import SimpleNamespace

    from tokenmill.core.sched_output import GrammarOutput
    from tokenmill.worker.model_runner import ModelRunner
    bm = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)
    grammar = GrammarOutput({"c": 0, "a": 1, "gone": 2}, bm)
    # after the decode-first reorder the batch holds d, c, b, a
    fake = SimpleNamespace(_grammar=grammar, device=torch.device("cpu"),
                           input_batch=SimpleNamespace(req_id_to_index={"d": 0, "c": 1, "b": 2,
                                                                        "a": 3}))
    rows, got = ModelRunner._grammar_bitmask_rows(fake)
    assert rows.tolist() == [1, 3] and got.numpy().tolist() == bm[[0, 1]].tolist()
    fake._grammar = None  # sample_tokens() got none
    assert ModelRunner._grammar_bitmask_rows(fake) is None
    fake._grammar = GrammarOutput({}, np.zeros((0, 4), dtype=np.int32))
    assert ModelRunner._grammar_bitmask_rows(fake) is None


def test_drafts_past_the_grammars_stop_token(manager):
    """A drafter may propose tokens after the stop token that completes the grammar
    (an oracle's drafts past the end, an n-gram's continuation): the rows up to the
    stop token are the grammar's, the rows after it stay all-allowed (the request ends
    at the stop token, they are never read) instead of xgrammar failing on a
    terminated matcher; the matcher is back where it was."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = manager.new_request("r", StructuredOutputsParams(json=schema))
    while not r.ready():
        manager.wait_for_grammars(1.0)
    tok = manager.tokenizer
    for piece in ('{"a":', "7"):
        for t in tok.encode(piece, add_special_tokens=False):
            assert not r.advance(t)
    close = tok.encode("}", add_special_tokens=False)
    assert len(close) == 1
    drafts = [close[0], tok.eos_token_id, 5, 6]
    rows, bm = manager.grammar_bitmask({"r": _Req(r)}, {"r": 1 + len(drafts)}, {"r": drafts})
    assert rows == {"r": 0} and bm.shape[0] == 1 + len(drafts)
    allowed = unpack_bitmask(torch.from_numpy(bm), 4096)
    assert allowed[0, close[0]] and not allowed[0, 5]  # after "7": a digit or "}"
    assert allowed[1, tok.eos_token_id] and not allowed[1, close[0]]  # complete: the stop
    assert allowed[2:].all()  # after the stop token: never read
    assert not r.is_terminated()  # rolled back: "}" and the stop token still to come
    assert not r.advance(close[0]) and r.advance(tok.eos_token_id)
