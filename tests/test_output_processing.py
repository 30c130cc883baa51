"""Output processing end to end on the built-in demo model (real byte-level BPE
tokenizer): stop strings (across tokens, multi-byte, streamed with hold-back),
output kinds (CUMULATIVE / DELTA / FINAL_ONLY), n completions with shared
prompt blocks, seeded reproducibility and detokenize=False.

Everything is derived at run time from the model's own greedy / seeded output,
so nothing depends on what the random demo weights happen to produce.
"""
from __future__ import annotations

import pytest

from conftest import word_tokens
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import RequestOutputKind

BLOCK = 16
NUM_BLOCKS = 64
FFFD = "\ufffd"
CUM, DELTA, FINAL = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                     RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def llm():
    # fp32: the random demo weights give nearly flat logits, so exact-equality
    # checks across batch compositions want the least rounding noise.
    return LLM(max_model_len=256, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_seqs=16,
               dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def generate(llm, prompts, params):
    if not isinstance(prompts, list):
        prompts = [prompts]
    return llm.generate(prompts, params, use_tqdm=False)


def one(llm, prompt, params):
    out = generate(llm, prompt, params)[0]
    assert out.finished and len(out.outputs) == params.n
    return out.outputs[0]


def assert_idle(llm):
    sched = llm.llm_engine.engine_core.scheduler
    assert sched.kv_cache_manager.num_used_blocks == 0
    assert not sched.requests and not sched.waiting and not sched.running
    assert llm.llm_engine.output_processor.requests == {}


def run_engine(engine, requests, max_steps=500):
    """Add (request_id, prompt, params) triples and step to the end.
    Returns {request_id: [RequestOutput, ...]} in arrival order."""
    outs = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            outs[o.request_id].append(o)
    assert not engine.has_unfinished_requests()
    return outs


# ---- a greedy reference with a clean (all ASCII) stretch ---------------------------------

GREEDY_PROMPT = "The town sat where"
GREEDY_LEN = 40


@pytest.fixture(scope="module")
def greedy(llm, tok):
    """The greedy output of GREEDY_PROMPT, with each token's text and where it ends."""
    c = one(llm, GREEDY_PROMPT, SamplingParams(temperature=0.0, max_tokens=GREEDY_LEN,
                                               ignore_eos=True))
    assert c.finish_reason == "length" and len(c.token_ids) == GREEDY_LEN
    pieces = [tok.decode([t]) for t in c.token_ids]
    # Use only the leading stretch where every token decodes on its own to clean
    # text, so token texts add up to the output text exactly.
    clean = 0
    while clean < len(pieces) and FFFD not in pieces[clean]:
        clean += 1
    assert clean >= 10, f"greedy output too noisy for these tests: {pieces}"
    assert c.text.startswith("".join(pieces[:clean]))
    ends = []
    pos = 0
    for p in pieces[:clean]:
        pos += len(p)
        ends.append(pos)
    return dict(ids=c.token_ids, text=c.text, pieces=pieces, clean=clean, ends=ends)


def spanning_stop(g, first=2, min_len=2):
    """A stop string made of the end of token k and the start of token k+1 that
    first occurs there. Returns (stop, start offset, k)."""
    for k in range(first, g["clean"] - 1):
        a, b = g["pieces"][k], g["pieces"][k + 1]
        if len(a) >= min_len and len(b) >= min_len:
            stop = a[-min_len:] + b[:min_len]
            start = g["ends"][k] - min_len
            if g["text"].find(stop) == start:
                return stop, start, k
    pytest.fail("no token pair to build a spanning stop string from")


def greedy_params(**kw):
    args = dict(temperature=0.0, max_tokens=GREEDY_LEN, ignore_eos=True)
    args.update(kw)
    return SamplingParams(**args)


# ---- 2. stop strings ---------------------------------------------------------------------

def test_stop_string_spanning_two_tokens(llm, greedy):
    stop, start, k = spanning_stop(greedy)
    # It really spans a token boundary: neither token contains it alone.
    assert stop not in greedy["pieces"][k] and stop not in greedy["pieces"][k + 1]
    c = one(llm, GREEDY_PROMPT, greedy_params(stop=[stop]))
    assert c.text == greedy["text"][:start]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    # Generation stops on the token that completed the stop string.
    assert c.token_ids == greedy["ids"][:k + 2]

    c = one(llm, GREEDY_PROMPT, greedy_params(stop=stop, include_stop_str_in_output=True))
    assert c.text == greedy["text"][:start + len(stop)]
    assert c.text.endswith(stop)
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == greedy["ids"][:k + 2]
    assert_idle(llm)


def test_stop_string_on_the_first_token(llm, greedy):
    first = greedy["pieces"][0]
    assert first
    c = one(llm, GREEDY_PROMPT, greedy_params(stop=[first]))
    assert c.text == "" and c.finish_reason == "stop" and c.stop_reason == first
    assert c.token_ids == greedy["ids"][:1]
    c = one(llm, GREEDY_PROMPT, greedy_params(stop=[first], include_stop_str_in_output=True))
    assert c.text == first and c.finish_reason == "stop" and c.stop_reason == first
    # A stop string that is a strict prefix of the first token's text.
    if len(first) >= 2:
        c = one(llm, GREEDY_PROMPT, greedy_params(stop=[first[:2]]))
        assert c.text == "" and c.stop_reason == first[:2]
        assert c.token_ids == greedy["ids"][:1]


def test_earliest_stop_string_wins(llm, greedy):
    early, e_start, k = spanning_stop(greedy, first=2)
    late, l_start, _ = spanning_stop(greedy, first=k + 3)
    assert e_start < l_start
    for stops in ([late, early], [early, late]):
        c = one(llm, GREEDY_PROMPT, greedy_params(stop=stops))
        assert c.text == greedy["text"][:e_start] and c.stop_reason == early
    # Two stop strings completed by the same token: the one that starts first
    # wins, whatever the list order.
    text = greedy["text"]
    for j in range(3, greedy["clean"]):
        end = greedy["ends"][j]
        short = text[end - 2:end]
        longer = text[end - len(greedy["pieces"][j]) - 2:end]  # reaches into token j-1
        if len(greedy["pieces"][j]) >= 2 and text.find(short) == end - 2 \
                and text.find(longer) == end - len(longer):
            break
    else:
        pytest.fail("no token to end two stop strings on")
    c = one(llm, GREEDY_PROMPT, greedy_params(stop=[short, longer]))
    assert c.text == text[:end - len(longer)] and c.stop_reason == longer
    assert c.token_ids == greedy["ids"][:j + 1]


def test_stop_string_waits_for_min_tokens(llm, greedy):
    """As vLLM: stop strings, like EOS and stop_token_ids, cannot end the output
    before min_tokens tokens; a stop string completed by token number m counts
    only when m > min_tokens."""
    stop, start, k = spanning_stop(greedy)  # completed by token k + 1, the (k + 2)-th
    assert greedy["text"].find(stop, start + 1) == -1  # occurs once
    c = one(llm, GREEDY_PROMPT, greedy_params(stop=[stop], min_tokens=k + 1))
    assert c.finish_reason == "stop" and c.text == greedy["text"][:start]
    c = one(llm, GREEDY_PROMPT, greedy_params(stop=[stop], min_tokens=k + 2))
    assert c.finish_reason == "length" and c.stop_reason is None
    assert c.text == greedy["text"] and c.token_ids == greedy["ids"]
    # The first token's text as the stop string, with min_tokens 3.
    first = greedy["pieces"][0]
    c = one(llm, GREEDY_PROMPT, greedy_params(stop=[first], min_tokens=3))
    assert len(c.token_ids) > 3
    text, j = greedy["text"], 0
    while j != -1 and j + len(first) <= greedy["ends"][2]:  # ends within 3 tokens: ignored
        j = text.find(first, j + 1)
    if j == -1:
        assert c.finish_reason == "length" and c.text == greedy["text"]
    else:
        assert c.text == greedy["text"][:j] and c.stop_reason == first


def test_stop_token_text_is_not_in_the_output(llm, tok, greedy):
    """As vLLM: a request ended by one of its stop_token_ids (or EOS) keeps that
    token in token_ids, but its text is left out of the output text unless
    include_stop_str_in_output is set; stop_reason is the token id."""
    k = next(k for k in range(2, greedy["clean"])
             if greedy["ids"][k] not in greedy["ids"][:k] and greedy["pieces"][k])
    stop_id = greedy["ids"][k]
    c = one(llm, GREEDY_PROMPT, greedy_params(stop_token_ids=[stop_id]))
    assert c.token_ids == greedy["ids"][:k + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.text == greedy["text"][:greedy["ends"][k - 1]]
    c = one(llm, GREEDY_PROMPT, greedy_params(stop_token_ids=[stop_id],
                                              include_stop_str_in_output=True))
    assert c.text == greedy["text"][:greedy["ends"][k]]
    # EOS with skip_special_tokens=False: its text is left out as well.
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos in llm.llm_engine.eos_token_ids
    c = one(llm, GREEDY_PROMPT, SamplingParams(temperature=0.0, max_tokens=5,
                                               logit_bias={eos: 100},
                                               skip_special_tokens=False))
    assert c.token_ids == [eos] and c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == ""
    # The same token merely generated (not a stop): its text stays.
    c = one(llm, GREEDY_PROMPT, SamplingParams(temperature=0.0, max_tokens=2,
                                               logit_bias={eos: 100}, ignore_eos=True,
                                               skip_special_tokens=False))
    assert c.text == "<|im_end|><|im_end|>" and c.finish_reason == "length"


def test_stop_string_never_produced(llm, greedy):
    stop = "§never§"
    assert stop not in greedy["text"]
    c = one(llm, GREEDY_PROMPT, greedy_params(stop=[stop, "~~~~~~~~~~"]))
    assert c.finish_reason == "length" and c.stop_reason is None
    assert c.text == greedy["text"] and c.token_ids == greedy["ids"]


# -- a multi-byte stop string ---------------------------------------------------------------

def _unicode_run(llm, tok, chars: str, seed: int, **kw):
    """Seeded sampling restricted to the single-byte tokens of `chars`' UTF-8: the
    model can only produce those bytes, in whatever order it samples them."""
    byte_tokens = sorted({t for ch in chars for t in tok.encode(ch, add_special_tokens=False)})
    assert len(byte_tokens) >= 2
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=30, ignore_eos=True,
                            allowed_token_ids=byte_tokens, **kw)
    return params, one(llm, "naïve café über", params)


@pytest.fixture(scope="module")
def unicode_case(llm, tok):
    """(seed, output) where the output contains 'é' made of two separate byte tokens."""
    for seed in range(20):
        _, c = _unicode_run(llm, tok, "é", seed)
        i = c.text.find("é")
        if i >= 1:
            return seed, c
    pytest.fail("no seed produced an é")


def test_multibyte_stop_string(llm, tok, unicode_case):
    seed, full = unicode_case
    i = full.text.find("é")
    assert len(tok.encode("é", add_special_tokens=False)) == 2  # é is two byte tokens here
    _, c = _unicode_run(llm, tok, "é", seed, stop=["é"])
    assert c.text == full.text[:i] and c.finish_reason == "stop" and c.stop_reason == "é"
    assert c.token_ids == full.token_ids[:len(c.token_ids)]
    assert tok.decode(c.token_ids).endswith("é")  # stopped on é's second byte
    _, c = _unicode_run(llm, tok, "é", seed, stop=["é"], include_stop_str_in_output=True)
    assert c.text == full.text[:i + 1]
    # A longer multi-byte stop string listed first changes nothing.
    _, c = _unicode_run(llm, tok, "é", seed, stop=["éééé", "é"])
    assert c.text == full.text[:i] and c.stop_reason == "é"


# -- streaming with a stop string: DELTA through the engine --------------------------------

def tok_text(llm, ids):
    return llm.get_tokenizer().decode(ids)


@pytest.mark.parametrize("include", [False, True])
def test_delta_stream_with_stop_holds_back_text(llm, greedy, include):
    engine = llm.llm_engine
    stop, start, k = spanning_stop(greedy, first=4, min_len=3)  # 6 chars over two tokens
    other = "~never~produced~"  # a longer stop string: more text held back
    final = one(llm, GREEDY_PROMPT, greedy_params(
        stop=[stop, other], include_stop_str_in_output=include))
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == greedy["text"][:start + (len(stop) if include else 0)]

    outs = run_engine(engine, [
        ("delta", GREEDY_PROMPT, greedy_params(stop=[stop, other], output_kind=DELTA,
                                               include_stop_str_in_output=include)),
        ("cum", GREEDY_PROMPT, greedy_params(stop=[stop, other], output_kind=CUM,
                                             include_stop_str_in_output=include))])
    deltas = [o.outputs[0] for o in outs["delta"]]
    assert len(deltas) > 3
    shown = ""
    for d in deltas:
        shown += d.text
        # Nothing streamed is ever taken back by the stop string.
        assert final.text.startswith(shown), (shown, final.text)
        assert FFFD not in d.text
    assert shown == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert [o.finished for o in outs["delta"]] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    for o in outs["cum"]:
        assert final.text.startswith(o.outputs[0].text)
    assert outs["cum"][-1].outputs[0].text == final.text
    if not include:
        # While running, at least len(longest stop) - 1 characters stayed back.
        hold = len(other) - 1
        for o in outs["cum"][:-1]:
            c = o.outputs[0]
            assert len(c.text) <= max(0, len(tok_text(llm, c.token_ids)) - hold)
    assert_idle(llm)


def test_delta_stream_multibyte_never_splits_a_character(llm, tok, unicode_case):
    seed, full = unicode_case
    params, _ = _unicode_run(llm, tok, "é", seed)
    outs = run_engine(llm.llm_engine, [("u", "naïve café über",
                                        params.clone(output_kind=DELTA))])
    texts = [o.outputs[0].text for o in outs["u"]]
    # Deltas are append-only, so this also says no delta ever showed a U+FFFD
    # where the final text has a whole character.
    assert "".join(texts) == full.text
    assert any("é" in t for t in texts)
    assert [t for o in outs["u"] for t in o.outputs[0].token_ids] == full.token_ids


# ---- 3. output kinds ---------------------------------------------------------------------

KIND_PROMPT = "Every morning before sunrise the baker"


def kind_params(kind, n=1, **kw):
    args = dict(temperature=1.0, seed=77, max_tokens=14, ignore_eos=True, logprobs=2, n=n,
                output_kind=kind)
    args.update(kw)
    return SamplingParams(**args)


@pytest.fixture(scope="module")
def kinds_alone(llm):
    """The same seeded request in each output kind, each run alone."""
    return {kind: run_engine(llm.llm_engine, [("k", KIND_PROMPT, kind_params(kind))])["k"]
            for kind in (CUM, DELTA, FINAL)}


def test_final_only_yields_one_output(kinds_alone):
    outs = kinds_alone[FINAL]
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs) == 1
    c = outs[0].outputs[0]
    assert len(c.token_ids) == 14 and len(c.logprobs) == 14 and c.finish_reason == "length"


def test_cumulative_outputs_grow_to_the_final_one(kinds_alone):
    final = kinds_alone[FINAL][0].outputs[0]
    outs = kinds_alone[CUM]
    assert len(outs) == 14  # one per decode step
    prev = None
    for o in outs:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        if prev is not None:
            assert c.text.startswith(prev.text)
            assert c.token_ids[:len(prev.token_ids)] == prev.token_ids
            assert c.logprobs[:len(prev.logprobs)] == prev.logprobs
            assert len(c.token_ids) == len(prev.token_ids) + 1
        prev = c
    assert [o.finished for o in outs] == [False] * 13 + [True]
    assert prev == final  # text, ids, logprobs, cumulative logprob, finish reason


def test_delta_pieces_concatenate_to_the_final_one(kinds_alone):
    final = kinds_alone[FINAL][0].outputs[0]
    pieces = [o.outputs[0] for o in kinds_alone[DELTA]]
    assert len(pieces) == 14
    assert all(len(p.token_ids) == 1 and len(p.logprobs) == 1 for p in pieces)
    assert "".join(p.text for p in pieces) == final.text
    assert [t for p in pieces for t in p.token_ids] == final.token_ids
    assert [lp for p in pieces for lp in p.logprobs] == final.logprobs
    assert pieces[-1].cumulative_logprob == pytest.approx(final.cumulative_logprob)
    assert pieces[-1].finish_reason == "length"
    for p, lp in zip(pieces, final.logprobs):
        # the sampled token plus the top 2
        assert p.token_ids[0] in lp and 2 <= len(lp) <= 3


def test_n3_delta_pieces_per_index_concatenate(llm):
    engine = llm.llm_engine
    final = run_engine(engine, [("f", KIND_PROMPT, kind_params(FINAL, n=3))])["f"]
    assert len(final) == 1 and final[0].finished
    final = final[0].outputs
    assert [c.index for c in final] == [0, 1, 2]
    outs = run_engine(engine, [("d", KIND_PROMPT, kind_params(DELTA, n=3))])["d"]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    for i in range(3):
        pieces = [c for o in outs for c in o.outputs if c.index == i]
        assert "".join(p.text for p in pieces) == final[i].text
        assert [t for p in pieces for t in p.token_ids] == final[i].token_ids
        assert [lp for p in pieces for lp in p.logprobs] == final[i].logprobs
        assert pieces[-1].finish_reason == "length"
    # CUMULATIVE with n=3: every output carries all three completions.
    outs = run_engine(engine, [("c", KIND_PROMPT, kind_params(CUM, n=3))])["c"]
    assert all(len(o.outputs) == 3 for o in outs)
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in final]
    assert_idle(llm)


# ---- 5. seeded sampling across batch compositions and output kinds ---------------------------

def test_seeded_tokens_same_across_kinds_and_batches(llm, kinds_alone):
    ref = kinds_alone[FINAL][0].outputs[0].token_ids
    others = [
        ("x1", "A much longer prompt about the two rivers that met below the town " * 2,
         SamplingParams(temperature=0.0, max_tokens=9)),
        ("x2", "short", SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=5)),
        ("x3", "Children liked to stand on the railing",
         SamplingParams(temperature=1.3, top_p=0.9, max_tokens=5, presence_penalty=0.5)),
    ]
    together = run_engine(llm.llm_engine, others[:2] + [
        ("c", KIND_PROMPT, kind_params(CUM)),
        ("d", KIND_PROMPT, kind_params(DELTA)),
        ("f", KIND_PROMPT, kind_params(FINAL))] + others[2:])
    assert together["c"][-1].outputs[0].token_ids == ref
    assert [t for o in together["d"] for t in o.outputs[0].token_ids] == ref
    assert together["f"][0].outputs[0].token_ids == ref
    assert_idle(llm)


# ---- 4. n completions -----------------------------------------------------------------------

N_PROMPT = "The baker on Mill Street made round loaves of rye"
SEED = 1000


def n_params(n=4, seed=SEED, **kw):
    args = dict(n=n, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
    args.update(kw)
    return SamplingParams(**args)


@pytest.fixture(scope="module")
def n4(llm):
    out = generate(llm, N_PROMPT, n_params())[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    return out


def test_n_completions_differ_and_reproduce(llm, n4):
    ids = [tuple(c.token_ids) for c in n4.outputs]
    assert len(set(ids)) == 4
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in n4.outputs)
    again = generate(llm, N_PROMPT, n_params())[0]
    assert [c.token_ids for c in again.outputs] == [list(i) for i in ids]
    assert [c.text for c in again.outputs] == [c.text for c in n4.outputs]
    assert_idle(llm)


def test_n_completions_independent_of_batch(llm, n4):
    prompts = ["The town sat where two rivers met " * 3, N_PROMPT, "rye", "Every morning"]
    params = [SamplingParams(temperature=0.0, max_tokens=20),
              n_params(),
              n_params(n=2, seed=3, max_tokens=25, top_k=40),
              SamplingParams(temperature=0.7, max_tokens=3, seed=9, frequency_penalty=1.0)]
    outs = generate(llm, prompts, params)
    assert [c.token_ids for c in outs[1].outputs] == [c.token_ids for c in n4.outputs]
    assert [c.text for c in outs[1].outputs] == [c.text for c in n4.outputs]
    assert len(outs[2].outputs) == 2
    assert_idle(llm)


def test_completion_i_equals_n1_with_seed_plus_i(llm, n4):
    singles = generate(llm, [N_PROMPT] * 4, [n_params(n=1, seed=SEED + i) for i in range(4)])
    for i, out in enumerate(singles):
        assert len(out.outputs) == 1
        assert out.outputs[0].token_ids == n4.outputs[i].token_ids
        assert out.outputs[0].text == n4.outputs[i].text
        assert out.outputs[0].index == 0


def _prompt_ids(tok, length):
    ids = tok.encode("The town sat where two rivers met, one brown with the silt of the "
                     "farmland to the north and one clear and cold from the hills. " * 4)
    assert len(ids) >= length
    return ids[:length]


def _step_all(engine, on_step=None, max_steps=500):
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        outs += engine.step()
        if on_step is not None:
            on_step()
    assert not engine.has_unfinished_requests()
    return outs


def test_n_shares_prompt_blocks(llm, tok):
    engine = llm.llm_engine
    sched = engine.engine_core.scheduler
    kvm = sched.kv_cache_manager
    runner = engine.engine_core.runner
    prompt = {"prompt_token_ids": _prompt_ids(tok, 70)}
    max_tokens = 20
    assert_idle(llm)

    # One sequence alone: its peak block count.
    peak = [0]
    engine.add_request("single", prompt, n_params(n=1, max_tokens=max_tokens))
    _step_all(engine, lambda: peak.__setitem__(0, max(peak[0], kvm.num_used_blocks)))
    single_blocks = peak[0]
    assert single_blocks == -(-(70 + max_tokens - 1) // BLOCK)
    assert kvm.num_used_blocks == 0

    before = sched.num_shared_prompt_blocks
    engine.add_request("par", prompt, n_params(n=4, max_tokens=max_tokens))
    core_ids = [f"{i}_par" for i in range(4)]
    seen = dict(peak=0, all_running=False)

    def check():
        seen["peak"] = max(seen["peak"], kvm.num_used_blocks)
        running = {r.request_id for r in sched.running}
        if running == set(core_ids):
            seen["all_running"] = True
            shared = (70 - 1) // BLOCK
            first = kvm.req_to_blocks[core_ids[0]][0]
            for cid in core_ids[1:]:
                blocks = kvm.req_to_blocks[cid][0]
                assert blocks[:shared] == first[:shared]
                assert not set(blocks[shared:]) & set(first)  # own blocks after the prefix
                assert runner.requests[cid].block_ids[0][:shared] == first[:shared]
            own = [set(kvm.req_to_blocks[c][0][shared:]) for c in core_ids]
            assert sum(len(s) for s in own) == len(set().union(*own))

    outs = _step_all(engine, check)
    assert seen["all_running"]
    assert sched.num_shared_prompt_blocks - before == 3 * ((70 - 1) // BLOCK)
    assert seen["peak"] < 4 * single_blocks
    assert seen["peak"] <= single_blocks + 3 * (single_blocks - (70 - 1) // BLOCK)
    final = [o for o in outs if o.finished]
    assert len(final) == 1 and len(final[0].outputs) == 4
    assert all(len(c.token_ids) == max_tokens for c in final[0].outputs)
    assert_idle(llm)
    # Sharing changes no tokens: the same request without a shareable sibling.
    singles = generate(llm, [prompt] * 4, [n_params(n=1, seed=SEED + i, max_tokens=max_tokens)
                                           for i in range(4)])
    assert [s.outputs[0].token_ids for s in singles] == [c.token_ids for c in final[0].outputs]


@pytest.fixture(scope="module")
def small_llm():
    """Too few KV blocks for four 110-token sequences: siblings get preempted."""
    return LLM(max_model_len=128, num_kv_blocks=12, block_size=BLOCK, dtype="float32",
               device="cpu")


def test_n_under_kv_pressure(llm, small_llm, tok):
    prompt = {"prompt_token_ids": _prompt_ids(tok, 70)}
    params = n_params(max_tokens=40, seed=5)
    ref = generate(llm, prompt, params)[0]
    sched = small_llm.llm_engine.engine_core.scheduler
    shared_before, preempt_before = sched.num_shared_prompt_blocks, sched.num_preemptions
    out = generate(small_llm, prompt, params)[0]
    num_preempted = sched.num_preemptions - preempt_before
    assert num_preempted > 0  # the point of this test
    # Preemption and re-admission change no tokens, and nothing leaks.
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert [c.text for c in out.outputs] == [c.text for c in ref.outputs]
    assert_idle(small_llm)
    # The counter counts blocks actually shared: at most one share per admission
    # of a sibling (three first admissions, plus one per preemption at most).
    per_share = (70 - 1) // BLOCK
    shared = sched.num_shared_prompt_blocks - shared_before
    assert shared <= per_share * (3 + num_preempted), (
        f"num_shared_prompt_blocks grew by {shared}: counts share attempts that were "
        f"undone when allocate_slots failed")


def test_abort_n_request_frees_everything(llm, tok):
    engine = llm.llm_engine
    sched = engine.engine_core.scheduler
    prompt = {"prompt_token_ids": _prompt_ids(tok, 70)}
    # Abort right after the first step (siblings still waiting for the prompt),
    # and after all four are decoding.
    for steps in (1, 4):
        engine.add_request("ab", prompt, n_params(n=4, max_tokens=50))
        for _ in range(steps):
            engine.step()
        assert sched.kv_cache_manager.num_used_blocks > 0
        if steps == 4:
            assert len(sched.running) == 4
        engine.abort_request("ab")
        assert not sched.requests and "ab" not in engine.unfinished_request_ids()
        # (a step may still be in flight with async scheduling: drain it)
        assert not any(o.request_id == "ab" for o in _step_all(engine))
        assert_idle(llm)
        assert not engine.engine_core.runner.requests or all(
            not rid.endswith("_ab") for rid in engine.engine_core.runner.requests)
    assert len(one(llm, "still works", n_params(n=2)).token_ids) == 12


def test_n_with_prompt_shorter_than_a_block(llm, tok):
    sched = llm.llm_engine.engine_core.scheduler
    before = sched.num_shared_prompt_blocks
    prompt = {"prompt_token_ids": tok.encode("rye")[:BLOCK - 1]}
    out = generate(llm, prompt, n_params(n=3))[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert sched.num_shared_prompt_blocks == before
    # Exactly one block's worth: (16 - 1) // 16 = 0 full blocks shareable either.
    out = generate(llm, {"prompt_token_ids": _prompt_ids(tok, BLOCK)}, n_params(n=3))[0]
    assert len(out.outputs) == 3
    assert sched.num_shared_prompt_blocks == before
    assert_idle(llm)


def test_n_with_stop_string(llm, tok):
    """Completions stop independently; the request finishes when all have. Sampled from
    word tokens only (allowed_token_ids: clean text, 4 or more characters a token), so
    completion 1's text always has the stop string taken below."""
    words = word_tokens(tok)
    full = generate(llm, N_PROMPT, n_params(allowed_token_ids=words))[0]
    # a stop string taken from completion 1's text (past its first character)
    stop = full.outputs[1].text[3:6]
    assert len(stop) == 3 and FFFD not in stop
    out = generate(llm, N_PROMPT, n_params(stop=[stop], allowed_token_ids=words))[0]
    for c, ref in zip(out.outputs, full.outputs):
        j = ref.text.find(stop)
        if j == -1:
            assert c.text == ref.text and c.finish_reason == "length"
        else:
            assert c.text == ref.text[:j] and c.finish_reason == "stop" and c.stop_reason == stop
            assert c.token_ids == ref.token_ids[:len(c.token_ids)]
    assert out.outputs[1].finish_reason == "stop"
    assert_idle(llm)


@pytest.mark.parametrize("abort_parent", [False, True])
def test_request_id_like_a_finished_child_id(llm, n4, abort_parent):
    """Completion i of request "r" runs in the core as "{i}_r". Once completion 0
    has finished (a stop string), the id "0_r" is free in the core and a new
    request may take it; finishing or aborting "r" must not take it away."""
    engine = llm.llm_engine
    t0, t1 = n4.outputs[0].text, n4.outputs[1].text
    stop = next((t0[i:i + 3] for i in range(1, len(t0) - 3)
                 if t0[i:i + 3] not in t1 and FFFD not in t0[i:i + 3]), None)
    assert stop is not None
    engine.add_request("r", N_PROMPT, n_params(n=2, stop=[stop]))
    finished = {}
    for _ in range(100):
        outs = engine.step()
        if any(o.request_id == "r" and o.outputs[0].finish_reason for o in outs):
            break
    assert "0_r" not in engine.engine_core.scheduler.requests  # completion 0 is done
    assert "1_r" in engine.engine_core.scheduler.requests
    engine.add_request("0_r", "hello", SamplingParams(max_tokens=20, ignore_eos=True))
    if abort_parent:
        engine.abort_request("r")
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert "0_r" in finished, "the new request never finished"
    assert len(finished["0_r"].outputs[0].token_ids) == 20
    assert ("r" in finished) != abort_parent
    assert_idle(llm)


# ---- 6. detokenize=False ----------------------------------------------------------------------

def test_detokenize_false(llm, greedy):
    c = one(llm, GREEDY_PROMPT, greedy_params(detokenize=False))
    assert c.text == "" and c.token_ids == greedy["ids"]
    outs = run_engine(llm.llm_engine, [
        ("nd", GREEDY_PROMPT, greedy_params(detokenize=False, output_kind=DELTA, max_tokens=5))])
    assert all(o.outputs[0].text == "" for o in outs["nd"])
    assert [t for o in outs["nd"] for t in o.outputs[0].token_ids] == greedy["ids"][:5]
    # n > 1 too
    out = generate(llm, N_PROMPT, n_params(detokenize=False))[0]
    assert all(c.text == "" for c in out.outputs) and len(out.outputs) == 4


def test_detokenize_false_logprobs_have_no_text(llm, greedy):
    """outputs.Logprob: decoded_token is None when the request does not detokenize."""
    out = generate(llm, GREEDY_PROMPT, greedy_params(detokenize=False, logprobs=2,
                                                     prompt_logprobs=1, max_tokens=4))[0]
    c = out.outputs[0]
    assert c.token_ids == greedy["ids"][:4]
    assert all(lp.decoded_token is None for row in c.logprobs for lp in row.values())
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) > 1
    assert all(lp.decoded_token is None for row in out.prompt_logprobs[1:]
               for lp in row.values())
    c = one(llm, GREEDY_PROMPT, greedy_params(logprobs=2, max_tokens=4))
    assert [row[t].decoded_token for row, t in zip(c.logprobs, c.token_ids)] == \
        greedy["pieces"][:4]


def test_detokenize_false_with_stop_is_refused(llm):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(detokenize=False, stop=["x"])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(detokenize=False, stop="x")
    # stop_token_ids need no text and are fine.
    SamplingParams(detokenize=False, stop_token_ids=[5])
    assert_idle(llm)
