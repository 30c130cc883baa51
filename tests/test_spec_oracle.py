"""Speculative decoding with oracle drafters: every method's real proposer path, with
only the draft model's (or the n-gram lookup's) guess replaced by the plain run's
tokens, some of them corrupted on purpose.

The random drafters of test_spec_decode.py can only show that the output is the
target's; with them nobody knows how many drafts should pass. Here the drafts are
the tokens the engine without speculation emitted (the right answer), except at the
draft positions a pattern marks, where another token stands. So each run knows in
advance what the verifier must do:

  "all"     no draft corrupted: every draft is accepted;
  "partial" draft j of a request that has n tokens is corrupted where j == 1 + n % 3:
            the first 1, 2 or 3 drafts pass (all of them when fewer were verified);
  "none"    draft 0 always corrupted: nothing is accepted.

Each test checks that (1) the output equals the plain engine's tokens, (2) every
verified draft list is the oracle's for the request's position at that step (no
stale or shifted drafts), (3) the spec metrics (verifications, draft tokens,
accepted tokens, accepted count per draft position) equal what the pattern implies,
computed here: with unlimited budgets from a model of the scheduler and the adaptive
drafter (every verification of every request, in order); with chunked prefill and
preemption (where the token budget cuts drafts) from the drafts that were scheduled.
The oracles also check what the proposer feeds them (input token, position, the
DFlash context's length) and record any mismatch.

What is replaced, per method (everything else runs as in production):
  ngram   NgramProposer._lookup: the Drafter's eligibility / adaptive k / backoff,
          NgramProposer.propose (its per-request index, caps) run for real. (A prompt
          the lookup would continue correctly needs the plain output inside the
          prompt, which changes that output; wrapping the lookup keeps the plain
          run as the oracle.)
  eagle3, mtp  the drafter's token choice: the real drafter runs every forward and
          write_kv (its K/V in the target's paged cache, deferred rows, the k - 1
          chained steps fed with its own hidden state), and its output rows are
          mapped to the oracle's tokens (draft_token_ids reads them). The greedy
          lm_head shortcut is off for the wrapped drafter (the oracle picks the id).
  dflash  DFlashDraftModel.propose: the real block forward over the real context
          runs; its [R, k] result is replaced by the oracle's.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from conftest import make_llm, runner_of, scheduler_of
from test_spec_decode import (assert_no_leaks, generate, greedy,  # noqa: F401
                              mtp_checkpoint, spec_stats)

from tokenmill.spec_decode.drafter import MAX_BACKOFF, MIN_RECORD_DRAFTS, PRIOR_MISSES, backoff

MAX_TOKENS = 24

PATTERNS = {
    "all": lambda n, j: False,
    "partial": lambda n, j: j == 1 + n % 3,
    "none": lambda n, j: j == 0,
}
# First drafts rejected in alternate 4-token windows: requests back off in a bad window
# and their (shadow) probe misses or hits, as the window it falls in says.
CORRUPTIONS = dict(PATTERNS, bursts=lambda n, j: j == 0 and (n // 4) % 2 == 0)

# Chunked prefill (a 16-token budget: long prompts in chunks, drafts cut to fit) and
# a KV cache too small for every request at once (preemption by recompute).
CHUNKED = {"max_num_batched_tokens": 16, "num_kv_blocks": 14, "block_size": 8,
           "max_model_len": 96}


@pytest.fixture(autouse=True)
def no_row_budget(monkeypatch):
    """No CPU row budget: the drafts of a step do not depend on the batch size, so the
    expected verifications follow from each request alone."""
    from tokenmill.platforms.cpu import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))


# ---- the oracle ---------------------------------------------------------------------------

class Oracle:
    """The plain run's sequences (prompt + output), keyed by prompt, and the pattern."""

    def __init__(self, seqs: dict[tuple, list[int]], pattern: str, vocab: int):
        self.seqs = seqs
        self.corrupt = CORRUPTIONS[pattern]
        self.vocab = vocab
        self.errors: list[str] = []
        self.calls = 0  # draft rows the oracle answered
        self.waited: list[bool] = []  # per drafter pass: did some decode row wait

    def seq(self, prompt) -> list[int]:
        return self.seqs[tuple(int(t) for t in prompt)]

    def seq_of_row(self, row: np.ndarray, length: int) -> list[int] | None:
        """The plain sequence whose prompt starts this token row (no prompt is a prefix
        of another); None (and an error) where the row left the plain run."""
        for prompt, seq in self.seqs.items():
            if tuple(row[:len(prompt)].tolist()) == prompt:
                if row[:min(length, len(seq))].tolist() != seq[:length]:
                    self.errors.append(f"row of {prompt[:3]}... left the plain run")
                return seq
        self.errors.append(f"no prompt starts row {row[:8].tolist()}")
        return None

    def token(self, seq: list[int], i: int) -> int | None:
        """The plain run's token i; None past its end (a request that stopped on a stop
        token inside this step's accepted drafts is drafted for once more before the
        scheduler finishes it: its tokens past the plain run are not checked)."""
        return seq[i] if i < len(seq) else None

    def draft(self, seq: list[int], n: int, j: int) -> int:
        """Draft j of a request with n tokens: the plain run's token at n + j, or, where
        the pattern says so, a different one. Past the plain run (drafts the scheduler
        cuts, as they would pass max_tokens): 0."""
        if n + j >= len(seq):
            return 0
        t = seq[n + j]
        return (t + 1 + j) % self.vocab if self.corrupt(n, j) else t

    def drafts(self, seq: list[int], n: int, d: int) -> list[int]:
        return [self.draft(seq, n, j) for j in range(d)]

    def accepted(self, n: int, d: int) -> int:
        """Drafts a verification of d drafts from n tokens accepts: up to the first
        corrupted one."""
        return next((j for j in range(d) if self.corrupt(n, j)), d)


class OracleEagleModel:
    """An EAGLE-3 or MTP drafter whose guesses are the oracle's. Every call runs the
    real drafter first (its K/V writes, the hidden state the next chained step takes);
    its `out` rows are replaced by the oracle's tokens, which draft_token_ids returns.
    The batch row of each call's rows comes from the proposer's _decode_meta (wrapped
    by install_oracle), the request's token count from the batch: a row at position p
    is draft j = p + 2 - n of its request."""

    shares_target_lm_head = False  # the oracle, not the greedy lm_head, picks the id

    def __init__(self, model, runner, oracle: Oracle, k: int):
        self.model, self.runner, self.oracle, self.k = model, runner, oracle, k
        self.rows: list[int] = []

    def __getattr__(self, name):  # aux_layer_ids, combine_target_hidden, write_kv, ...
        return getattr(self.__dict__["model"], name)

    def __call__(self, input_ids, positions, hidden, meta):
        out, next_hidden = self.model(input_ids, positions, hidden, meta)
        batch, oracle = self.runner.input_batch, self.oracle
        tokens = []
        assert len(self.rows) == input_ids.shape[0]
        for r, p, t_in in zip(self.rows, positions.tolist(), input_ids.tolist()):
            rid = batch.req_ids[r]
            seq = oracle.seq(self.runner.requests[rid].prompt_token_ids)
            n = int(batch.num_tokens_no_spec[r])
            j = p + 2 - n
            want_in = oracle.token(seq, n - 1) if j == 0 else oracle.draft(seq, n, j - 1)
            if not 0 <= j < self.k or (n <= len(seq) and t_in != want_in):
                oracle.errors.append(f"{rid}: draft step at position {p} with {n} tokens "
                                     f"took token {t_in}, expected {want_in}")
            tokens.append(oracle.draft(seq, n, j))
            oracle.calls += 1
        return torch.tensor(tokens, dtype=torch.long, device=out.device).view(-1, 1), \
            next_hidden

    def draft_token_ids(self, out):
        return out[:, 0]


class OracleDFlashModel:
    """A DFlash drafter whose block's guesses are the oracle's: the real propose runs
    (its block over the request's context in the paged cache), its [R, k] drafts are
    replaced. The batch row of each block comes from the proposer's _block_metas
    (wrapped by install_oracle). Checks that the block starts at the request's last
    token and that its context was written up to the block."""

    shares_target_lm_head = False

    def __init__(self, model, runner, oracle: Oracle):
        self.model, self.runner, self.oracle = model, runner, oracle
        self.rows: list[int] = []

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def propose(self, last_token_ids, positions, k, metas):
        real = self.model.propose(last_token_ids, positions, k, metas)
        oracle = self.oracle
        if tuple(real.shape) != (len(positions), k) or len(self.rows) != len(positions):
            oracle.errors.append(f"DFlash drafts of shape {tuple(real.shape)}")
        ends = self.runner.drafter.model_proposer.context_end
        out = []
        for r, t, p in zip(self.rows, np.asarray(last_token_ids).tolist(),
                           np.asarray(positions).tolist()):
            rid = self.runner.input_batch.req_ids[r]
            seq = oracle.seq(self.runner.requests[rid].prompt_token_ids)
            if (p < len(seq) and t != seq[p]) or ends.get(rid) != p:
                oracle.errors.append(f"{rid}: block at {p} from token {t} (expected "
                                     f"{oracle.token(seq, p)}), context to {ends.get(rid)}")
            out.append(oracle.drafts(seq, p + 1, k))
            oracle.calls += k
        return torch.tensor(out, dtype=torch.long)


def install_oracle(llm, method: str, oracle: Oracle, k: int) -> None:
    runner = runner_of(llm)
    drafter = runner.drafter
    if method == "ngram":
        ngram = drafter.ngram
        inner = ngram._lookup

        def lookup(index, row, length, cap):
            real = inner(index, row, length, cap)
            if len(real) > cap:
                oracle.errors.append(f"n-gram lookup gave {len(real)} drafts for cap {cap}")
            seq = oracle.seq_of_row(row, length)
            oracle.calls += cap
            return oracle.drafts(seq, length, cap) if seq is not None else []
        ngram._lookup = lookup
        return
    proposer = drafter.model_proposer
    deferred = proposer.deferred
    wait_all, step = deferred.wait_all, deferred.step

    def wait_all_seen(*args):
        ok = wait_all(*args)
        oracle.waited.append(bool(ok))
        return ok

    def step_seen(*args):
        out = step(*args)
        oracle.waited.append(bool(out[0].any()))
        return out
    deferred.wait_all, deferred.step = wait_all_seen, step_seen
    if method == "dflash":
        wrapped_d = OracleDFlashModel(proposer.model, runner, oracle)
        inner_metas = proposer._block_metas

        def block_metas(runner_, rows, positions, k_):
            wrapped_d.rows = [int(r) for r in rows]
            return inner_metas(runner_, rows, positions, k_)
        proposer._block_metas = block_metas
        proposer.model = wrapped_d
        return
    wrapped = OracleEagleModel(proposer.model, runner, oracle, k)
    inner_meta = proposer._decode_meta

    def decode_meta(runner_, rows, positions):
        wrapped.rows = [int(r) for r in rows]
        return inner_meta(runner_, rows, positions)
    proposer._decode_meta = decode_meta
    proposer.model = wrapped


def record_verifications(llm) -> list[tuple[tuple, int, list[int]]]:
    """Every draft list the scheduler sends to verification: (prompt, the request's
    tokens at that step, the drafts)."""
    sched = scheduler_of(llm)
    seen, inner = [], sched.schedule

    def schedule():
        so = inner()
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            req = sched.requests[rid]
            seen.append((tuple(req.prompt_token_ids), req.num_tokens, list(drafts)))
        return so
    sched.schedule = schedule
    return seen


def simulate(prompts, oracle: Oracle, k: int, adaptive: bool, max_tokens: int = MAX_TOKENS,
             poor_record: bool = False, probes: list | None = None):
    """The verifications a run must make with no budget limit: per request, after its
    prompt's step (one token), each step verifies the drafts proposed after the step
    before, cut so an all-accepted run stays within max_tokens, and emits accepted + 1
    tokens. The adaptive drafter (spec_decode/drafter.py) asks next for one more than
    it accepted (k after a full acceptance), and after the second verification in a
    row with nothing accepted skips 4, then 16, then 64 steps, then probes with one
    draft. `poor_record`: the requests start under a poor server-wide record
    (PRIOR_MISSES misses: backed off from the prompt's step on, then a probe), and
    their probes are shadows until one hits (one draft, not verified: the next step's
    token says hit or miss; on a hit the request drafts from that step on).
    `probes`: gets (prompt, tokens before the probe, hit) of each shadow probe.
    -> [(prompt, tokens before the drafts, drafts)] in each request's order."""
    out = []
    for prompt in prompts:
        num_out, next_k, misses, skip, doubted = 1, k, 0, 0, False
        if poor_record:
            next_k, misses, skip = 1, PRIOR_MISSES, backoff(PRIOR_MISSES)
            doubted = adaptive
        while num_out < max_tokens:
            if skip:
                skip, want = skip - 1, 0
            else:
                want = next_k
            if doubted and want:  # a shadow probe (a doubted request drafts only to probe)
                hit = oracle.accepted(len(prompt) + num_out, 1)
                if probes is not None:
                    probes.append((tuple(prompt), len(prompt) + num_out, hit))
                num_out += 1
                next_k, misses, doubted = (min(k, 2), 0, False) if hit else (1, misses + 1,
                                                                             True)
                if misses >= 2:  # (the next decision, the step that told, is its first)
                    skip = backoff(misses)
                continue
            d = min(want, max_tokens - num_out - 1)
            if d <= 0:
                num_out += 1
                continue
            n = len(prompt) + num_out
            a = oracle.accepted(n, d)
            out.append((tuple(prompt), n, d))
            num_out += a + 1
            if adaptive:
                next_k = min(k, d + 1 if a == d else a + 1)
                misses = 0 if a else misses + 1
                if misses >= 2:
                    skip = min(4 ** (misses - 1), MAX_BACKOFF)
    return out


def expected_stats(verifications, oracle: Oracle, k: int) -> dict:
    """verifications: [(prompt, tokens before the drafts, number of drafts)]."""
    per_pos = [0] * k
    accepted = 0
    for _, n, d in verifications:
        a = oracle.accepted(n, d)
        accepted += a
        for j in range(a):
            per_pos[j] += 1
    return {"num_drafts": len(verifications),
            "num_draft_tokens": sum(d for _, _, d in verifications),
            "num_accepted_tokens": accepted, "accepted_per_position": per_pos}


# ---- the targets ----------------------------------------------------------------------------

class Setup:
    def __init__(self, path: str, spec: dict, vocab: int, prompts: list[list[int]]):
        self.path, self.spec, self.vocab, self.prompts = path, spec, vocab, prompts
        self.k = spec["num_speculative_tokens"]
        plain = generate(make_llm(path), prompts, greedy(MAX_TOKENS))
        self.seqs = {tuple(p): p + list(o) for p, o in zip(prompts, plain)}
        self.plain = plain


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    """Four prompts, 7 to 30 tokens (the longer ones take chunks under CHUNKED); none a
    prefix of another (their first tokens differ)."""
    rng = np.random.default_rng(seed)
    firsts = rng.choice(vocab - 1, size=4, replace=False)
    return [[int(f)] + rng.integers(0, vocab - 1, size=n - 1).tolist()
            for f, n in zip(firsts, (7, 13, 21, 30))]


def _vocab(path: str) -> int:
    cfg = json.load(open(os.path.join(path, "config.json")))
    return cfg.get("text_config", cfg)["vocab_size"]


@pytest.fixture(scope="module")
def setups(request, tmp_path_factory, tiny_model_factory):
    """method -> Setup (target, speculative config, prompts, plain run), built on use."""
    from tokenmill.spec_decode import random_drafters as rd
    cache: dict[str, Setup] = {}

    def get(method: str) -> Setup:
        if method in cache:
            return cache[method]
        if method == "mtp":  # a hybrid (Gated DeltaNet) Qwen3.5 target with its MTP head
            path = request.getfixturevalue("mtp_checkpoint")
            spec = {"method": "mtp", "num_speculative_tokens": 3}
        elif method in ("ngram", "eagle3"):
            path = tiny_model_factory("llama_gqa_tied").path
            spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3}
            if method == "eagle3":
                draft = str(tmp_path_factory.mktemp("oracle_eagle3"))
                rd.build_eagle3_checkpoint(draft, json.load(open(os.path.join(path,
                                                                               "config.json"))))
                spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": draft}
        else:
            path = tiny_model_factory("qwen3_headdim").path
            draft = str(tmp_path_factory.mktemp("oracle_dflash"))
            rd.build_dflash_checkpoint(draft, json.load(open(os.path.join(path, "config.json"))),
                                       target_layer_ids=(0, 1), block_size=5)
            spec = {"method": "dflash", "num_speculative_tokens": 4, "model": draft}
        vocab = _vocab(path)
        cache[method] = Setup(path, spec, vocab, _prompts(vocab, seed=len(cache) + 3))
        return cache[method]
    return get


def run_oracle(setup: Setup, pattern: str, adaptive: bool, **extra):
    llm = make_llm(setup.path, speculative_config=dict(setup.spec, adaptive=adaptive), **extra)
    oracle = Oracle(setup.seqs, pattern, setup.vocab)
    install_oracle(llm, setup.spec["method"], oracle, setup.k)
    seen = record_verifications(llm)
    got = generate(llm, setup.prompts, greedy(MAX_TOKENS))
    return llm, oracle, seen, got


def check_run(llm, setup: Setup, oracle: Oracle, seen, got):
    """What holds in every run: the plain tokens, each verified draft list the oracle's,
    the metrics those drafts imply, nothing leaked."""
    assert got == setup.plain
    assert not oracle.errors, oracle.errors[:5]
    assert oracle.calls > 0
    for prompt, n, drafts in seen:
        assert drafts == oracle.drafts(setup.seqs[prompt], n, len(drafts)), (prompt[:3], n)
    s = spec_stats(llm).as_dict()
    want = expected_stats([(p, n, len(d)) for p, n, d in seen], oracle, setup.k)
    assert {key: s[key] for key in want} == want
    assert_no_leaks(llm)
    runner = runner_of(llm)
    if setup.spec["method"] == "mtp":  # the hybrid target's state slot groups are all back
        slots = runner.state_slots
        assert not slots.slot_of and slots.num_free == slots.num_slots
    if setup.spec["method"] == "dflash":
        assert not runner.drafter.model_proposer.context_end
    if setup.spec["method"] in ("eagle3", "mtp", "dflash"):
        assert not runner.drafter.model_proposer.deferred._slot
    return s


METHODS = ["ngram", "eagle3", "mtp", "dflash"]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_k", "adaptive"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("method", METHODS)
def test_oracle_acceptance_is_exact(setups, method, pattern, adaptive):
    """Full, partial and zero acceptance through each method's real proposer: the plain
    tokens, and exactly the verifications (request, position, number of drafts) and
    metrics that the corruption pattern implies - the adaptive drafter's k and backoff
    (rows waiting for the draft model meanwhile) included."""
    setup = setups(method)
    llm, oracle, seen, got = run_oracle(setup, pattern, adaptive)
    want = simulate(setup.prompts, oracle, setup.k, adaptive)
    assert sorted((p, n, len(d)) for p, n, d in seen) == sorted(want)
    s = check_run(llm, setup, oracle, seen, got)
    assert s == dict(s, **expected_stats(want, oracle, setup.k))
    if pattern == "all":
        assert s["num_accepted_tokens"] == s["num_draft_tokens"] > 0
    elif pattern == "none":
        assert s["num_accepted_tokens"] == 0 < s["num_draft_tokens"]
        if adaptive and method != "ngram":  # backing off: decode rows waited for the drafter
            assert any(oracle.waited)
    else:
        assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"]
        assert s["accepted_per_position"][0] > s["accepted_per_position"][1] > 0


@pytest.mark.parametrize("method", METHODS)
def test_oracle_shadow_probes_miss_and_hit(setups, method):
    """Requests that start under a poor record, and bursts of rejected first drafts:
    their probes out of a back-off are shadows (no verification at their positions); a
    miss backs off longer, a hit resumes drafting from the next step: exactly the
    verifications that implies, with the plain tokens, and no probe left waiting."""
    setup = setups(method)
    llm = make_llm(setup.path, speculative_config=dict(setup.spec, adaptive=True))
    oracle = Oracle(setup.seqs, "bursts", setup.vocab)
    install_oracle(llm, setup.spec["method"], oracle, setup.k)
    runner_of(llm).drafter.poor_record = lambda: True  # requests start doubted
    seen = record_verifications(llm)
    got = generate(llm, setup.prompts, greedy(MAX_TOKENS))
    probes = []
    want = simulate(setup.prompts, oracle, setup.k, True, poor_record=True, probes=probes)
    assert {hit for _, _, hit in probes} == {0, 1}  # (the pattern gives both)
    hits = [(q, m) for q, m, hit in probes if hit]  # a hit, then verified drafts after it
    assert any(p == q and n > m for q, m in hits for p, n, _ in want)
    assert sorted((p, n, len(d)) for p, n, d in seen) == sorted(want)
    assert not {(p, n) for p, n, _ in probes} & {(p, n) for p, n, _ in seen}
    check_run(llm, setup, oracle, seen, got)
    assert not runner_of(llm).drafter._shadow


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_shadow_probes_of_sampled_requests(setups, method):
    """Sampled requests (temperature 1, n = 2, unseeded) that start under a poor record:
    each probe is a shadow settled against the token the sampler gave the request at
    that index, once, into the record; none is left when the requests finish."""
    from tokenmill import SamplingParams
    setup = setups(method)
    llm = make_llm(setup.path, speculative_config=dict(setup.spec, adaptive=True))
    runner = runner_of(llm)
    drafter = runner.drafter
    drafter.poor_record = lambda: True
    settled, inner = [], drafter._settle_shadows

    def settle(index, token_ids, num_tokens):
        before = dict(drafter._shadow)
        inner(index, token_ids, num_tokens)
        for rid in before.keys() - drafter._shadow.keys():
            i = before[rid][0]
            req = runner.requests[rid]
            assert token_ids[index[rid], i] == (req.prompt_token_ids + req.output_token_ids)[i]
            settled.append(rid)
    drafter._settle_shadows = settle
    params = SamplingParams(temperature=1.0, n=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in setup.prompts], params,
                        use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [MAX_TOKENS] * 8
    assert len(set(settled)) == 8 <= len(settled)  # every request probed in shadow
    assert drafter._drafted >= len(settled) and not drafter._shadow
    assert_no_leaks(llm)


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("method", METHODS)
def test_oracle_acceptance_with_chunked_prefill_and_preemption(setups, method, pattern):
    """The same with prompts in chunks, drafts cut to the token budget and requests
    preempted (their drafts dropped; on resume the prompt and output are recomputed,
    the drafter's K/V rewritten, the DFlash context cut back to where the request
    resumes): the plain tokens, the oracle's drafts at every verification, and the
    metrics those verifications imply."""
    setup = setups(method)
    llm, oracle, seen, got = run_oracle(setup, pattern, True, **CHUNKED)
    assert scheduler_of(llm).num_preemptions > 0
    s = check_run(llm, setup, oracle, seen, got)
    assert s["num_draft_tokens"] > 0
    assert (s["num_accepted_tokens"] == s["num_draft_tokens"] if pattern == "all"
            else s["num_accepted_tokens"] < s["num_draft_tokens"])
    if pattern == "none":
        assert s["num_accepted_tokens"] == 0


@pytest.mark.parametrize("pattern", ["partial", "none"])
@pytest.mark.parametrize("method", METHODS)
def test_oracle_new_requests_start_from_the_record(setups, method, pattern):
    """The same prompts three times in one engine: once the verifications of earlier
    requests accepted almost nothing ("none"), new ones start at one draft with the
    longer back-off (spec_decode/drafter.py's record), and make exactly the fewer
    verifications that implies; where drafts pass ("partial") they start as before.
    The plain tokens every time, nothing leaked."""
    setup = setups(method)
    llm = make_llm(setup.path, speculative_config=dict(setup.spec, adaptive=True))
    oracle = Oracle(setup.seqs, pattern, setup.vocab)
    install_oracle(llm, setup.spec["method"], oracle, setup.k)
    seen = record_verifications(llm)
    drafter = runner_of(llm).drafter
    cold = simulate(setup.prompts, oracle, setup.k, True)
    batches = 0
    while drafter._drafted < MIN_RECORD_DRAFTS:  # the record fills with cold requests
        before = len(seen)
        assert generate(llm, setup.prompts, greedy(MAX_TOKENS)) == setup.plain
        assert sorted((p, n, len(d)) for p, n, d in seen[before:]) == sorted(cold)
        batches += 1
    assert drafter.poor_record() == (pattern == "none") and batches <= 3
    before = len(seen)
    assert generate(llm, setup.prompts, greedy(MAX_TOKENS)) == setup.plain
    got = sorted((p, n, len(d)) for p, n, d in seen[before:])
    want = sorted(simulate(setup.prompts, oracle, setup.k, True,
                           poor_record=pattern == "none"))
    assert got == want
    if pattern == "none":
        assert sum(d for _, _, d in want) < sum(d for _, _, d in cold)
    for prompt, n, drafts in seen:
        assert drafts == oracle.drafts(setup.seqs[prompt], n, len(drafts)), (prompt[:3], n)
    assert not oracle.errors, oracle.errors[:5]
    assert_no_leaks(llm)
