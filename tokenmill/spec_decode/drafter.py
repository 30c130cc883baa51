"""The runner's side of speculation: which requests get drafts, how many, and from what.

After each step the runner asks the Drafter for the next step's drafts. A request
gets none while it still consumes its prompt, when its logits processors need the
tokens before each position (penalties, min_tokens, bad words; logit_bias and
allowed tokens too: processors run on a request's last row only), or when the
batch has `disable_by_batch_size` requests or more (the forward is then
compute-bound and verifying k extra rows per request costs more than it saves).
A grammar is no reason: its bitmask has a row per verified position.

Row budget: on the CPU a decode step costs the same up to the packed kernels' row
limit (it streams the weights once; the platform's fast_decode_rows) and much more
past it (the GEMMs and the Python layers take over), so with `adaptive` the drafts
of a step fill only the rows the batch leaves free under that limit: k drafts at
batch 1, fewer as the batch grows, none once it fills the limit.

Adaptive k: a request starts at num_speculative_tokens; after a verification with
every draft accepted it asks for one more (up to k), otherwise for one more than it
had accepted - so a request whose drafts keep failing pays for one draft a step,
and one in a repetition loop goes back to k at once. A request whose last
verifications accepted nothing backs off: it skips drafting for 4, 16, then
MAX_BACKOFF steps (a verifying row and a draft model's proposal cost time even when
every draft is rejected; a trained drafter seldom misses twice in a row, an n-gram
lookup in text that does not repeat keeps missing), and tries again after. Its
decode rows meanwhile wait for the draft model (spec_decode/deferred.py).

A request coming back from a back-off probes with one draft. A request that started
under a poor record (below) probes in shadow until a probe hits: the draft is kept
here, not verified, and compared with the token the next step samples at its
position (tokens equal: a hit). For a one-hot draft (every drafter here drafts
greedily) that is the rejection sampler's own test - accepted with the target's
probability of the draft, the chance the sampled token equals it - so the record and
the back-off follow the same odds, without the verifying row (a 2-row step costs
~0.5 ms more than a decode step at batch 1). A hit costs the token a verified probe
would have gained, so where probes often hit (the record is good) they are verified:
shadows measured 2-7% slower than verified probes on loop prompts whose drafts come
and go, and save ~0.5% of a request whose drafter never fits.

A new request starts from what the server has seen: while the recent verifications
of all requests accepted almost none of their drafts (fewer than POOR_ACCEPTANCE of
the last ~RECORD_DRAFTS), it starts as one that has just missed PRIOR_MISSES times in
a row: backed off (16 steps, its prompt's step the first: no draft-model pass and
no verifying row there), then one draft, and a miss sends it to the longest back-off
(a drafter that does not fit the workload costs two probes a 128-token request, not
five); a hit resets it as usual. Not a seeded request: its random draws follow its
drafts, so its drafts must depend on it (and its batch) alone for a rerun to give
the same tokens.

A draft model's drafter costs a request something even while it backs off: the
target's taps every step, its decode rows waiting (spec_decode/deferred.py), the
prompt's rows and two probes through the draft model, the rows written at finish
(~5% of a 128-token request at batch 1). So under a poor record the scheduler
suspends most new requests' drafts outright (SCOUT_EVERY: all but one in that many,
the scouts, which draft as above and keep the record current; never a seeded one):
a suspended request is never proposed for, its rows never wait, and a step of only
such requests runs without taps or drafter. Its blocks then lack the draft model's
K/V, so their hashes carry a mark of their own (core/kv_cache_utils.py): they are
shared only among suspended requests, and a drafting request that hits the cache
finds what a cold run wrote. The scheduler decides when it takes the request in
(before its first block hash), from the record the runner reports each step.

Load suspends too: a request taken in when the batch already has as many requests as
the row budget (or disable_by_batch_size) allows none of them drafts, so its drafter
data would serve only a tail after the batch drains. It is suspended whatever the
record (~3% of the bench model's decode work, and the drafter's Python, at 16
requests). Should the batch drain while the record is good (GOOD_ACCEPTANCE) or too
short to judge, the scheduler resumes such a request whose token budget is still
long: it recomputes the request's tokens as a preemption does, this time with the
drafter's data, and drafts from there.
"""
from __future__ import annotations

import numpy as np

from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer

MAX_BACKOFF = 64  # steps a request whose drafts keep failing goes without drafting
# The server-wide record a new request starts from: drafts verified and accepted,
# halved whenever it passes RECORD_DRAFTS (recent requests weigh most).
RECORD_DRAFTS = 512
MIN_RECORD_DRAFTS = 32  # no judgement before this many drafts were verified
POOR_ACCEPTANCE = 1 / 16  # below this share accepted, new requests start backed off
# From this share accepted, drafting pays for recomputing a request suspended by load
# (at 1/4 a step gains ~0.3 token at k = 3; a recompute costs a prefill of its tokens).
GOOD_ACCEPTANCE = 1 / 4
PRIOR_MISSES = 3  # a new request's misses under a poor record (see backoff())
SCOUT_EVERY = 8  # under a poor record, 1 new request in this many still drafts
SMALL_BATCH = 8  # up to this many rows, a backing-off step's checks run on Python lists


def rows_in(req_ids: list[str], skip: set[str] | None) -> np.ndarray | None:
    """Per batch row: whether its request is in `skip` (None: no skip set)."""
    if skip is None:
        return None
    return np.fromiter((rid in skip for rid in req_ids), dtype=bool, count=len(req_ids))


def backoff(misses: int) -> int:
    """Steps without drafts after `misses` verifications in a row accepted nothing:
    none after one (a retry), then 4, 16, then MAX_BACKOFF."""
    return 0 if misses < 2 else min(4 ** (misses - 1), MAX_BACKOFF)


class Drafter:
    def __init__(self, config: SpeculativeConfig, model_proposer=None,
                 row_budget: int | None = None):
        """`model_proposer`: proposes from a draft model that reads the target's hidden
        states (EagleProposer, spec_decode/eagle.py, or DFlashProposer); None: n-gram
        lookup. `row_budget`: the rows a decode step may have at the cost of one row
        (None: no such limit)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.row_budget = row_budget if config.adaptive else None
        self.model_proposer = model_proposer
        self.ngram = (NgramProposer(self.k, config.prompt_lookup_min,
                                       config.prompt_lookup_max)
                         if model_proposer is None else None)
        self._next_k: dict[str, int] = {}  # adaptive k per request
        self._misses: dict[str, int] = {}  # verifications in a row that accepted nothing
        self._skip: dict[str, int] = {}  # steps left without drafts
        self._seeded: set[str] = set()  # requests the record does not apply to
        self._drafted = 0.0  # the record: drafts verified, decayed (RECORD_DRAFTS)
        self._accepted = 0.0  # ... and accepted
        self._doubted: set[str] = set()  # started under a poor record, no probe hit yet
        self._suspended: set[str] = set()  # never drafts (see above); the scheduler's call
        # Shadow probes waiting for their token: request -> (the index in its token ids
        # of the token the draft guesses, the draft).
        self._shadow: dict[str, tuple[int, int]] = {}

    def observe(self, req_ids: list[str], num_drafts: np.ndarray,
                num_accepted: np.ndarray) -> None:
        """After a verification step: adapt each verifying request's next k."""
        if not self.config.adaptive:
            return
        for i in np.nonzero(num_drafts > 0)[0].tolist():
            self._adapt(req_ids[i], int(num_drafts[i]), int(num_accepted[i]))
        verified = num_drafts > 0
        self._count(float(num_drafts[verified].sum()), float(num_accepted[verified].sum()))

    def _adapt(self, rid: str, d: int, a: int) -> None:
        """One verification (or shadow probe) of d drafts, a accepted: the next k and
        the back-off."""
        self._next_k[rid] = min(self.k, d + 1 if a == d else a + 1)
        if a:
            self._misses.pop(rid, None)
        else:
            misses = self._misses[rid] = self._misses.get(rid, 0) + 1
            if misses >= 2:
                self._skip[rid] = backoff(misses)

    def _count(self, drafted: float, accepted: float) -> None:
        """Into the server-wide record."""
        self._drafted += drafted
        self._accepted += accepted
        if self._drafted > RECORD_DRAFTS:
            self._drafted *= 0.5
            self._accepted *= 0.5

    def _shadow_probes(self, req_ids: list[str], drafts: list[list[int]],
                       num_tokens: np.ndarray) -> None:
        """Drafts of doubted requests become shadows: kept, not verified (a doubted
        request drafts only as a probe out of a back-off: one draft)."""
        doubted = self._doubted
        for r, dr in enumerate(drafts):
            if dr and req_ids[r] in doubted:
                self._shadow[req_ids[r]] = (int(num_tokens[r]), dr[0])
                drafts[r] = []

    def _settle_shadows(self, req_index: dict[str, int], token_ids: np.ndarray,
                        num_tokens: np.ndarray) -> None:
        """The shadow probes whose token a step has sampled since (req_index: request ->
        its row of token_ids / num_tokens): hit or miss, as a verification of one draft."""
        for rid, (index, draft) in list(self._shadow.items()):
            r = req_index.get(rid)
            if r is not None and num_tokens[r] > index:
                del self._shadow[rid]
                hit = int(token_ids[r, index] == draft)
                self._adapt(rid, 1, hit)
                self._count(1.0, float(hit))
                if hit:  # its drafts can pass: its later probes are verified
                    self._doubted.discard(rid)

    def add_seeded(self, req_id: str) -> None:
        """A seeded sampling request: it starts at k whatever the record says."""
        self._seeded.add(req_id)

    def suspend(self, req_id: str) -> None:
        """A request the scheduler runs without drafts: never proposed for."""
        self._suspended.add(req_id)

    def all_suspended(self, req_ids: list[str]) -> bool:
        """Whether every request of a step is suspended: it runs without taps or drafter."""
        s = self._suspended
        return bool(s) and all(rid in s for rid in req_ids)

    def resume(self, req_id: str) -> None:
        """A suspended request the scheduler recomputes to draft from now on."""
        self._suspended.discard(req_id)

    def not_suspended(self, req_ids) -> list[str]:
        s = self._suspended
        return [rid for rid in req_ids if rid not in s]

    def poor_record(self) -> bool:
        """Whether recent verifications accepted almost none of their drafts."""
        return (self._drafted >= MIN_RECORD_DRAFTS
                and self._accepted < POOR_ACCEPTANCE * self._drafted)

    def promising_record(self) -> bool:
        """Whether recent verifications accepted at least GOOD_ACCEPTANCE of their drafts,
        or are too few to judge (a request suspended by load is resumed only then)."""
        return (self._drafted < MIN_RECORD_DRAFTS
                or self._accepted >= GOOD_ACCEPTANCE * self._drafted)

    def _wanted(self, rid: str) -> int:
        """Drafts this request asks for now (0 while it backs off)."""
        left = self._skip.get(rid)
        if left:
            self._skip[rid] = left - 1
            return 0
        k = self._next_k.get(rid)
        if k is None:  # the request's first drafts
            k = self._next_k[rid] = self.k
            # (never with adaptive off: observe keeps no record)
            if rid not in self._seeded and self.poor_record():
                # As after PRIOR_MISSES misses: backed off from this step, then one draft.
                self._next_k[rid] = 1
                self._misses[rid] = PRIOR_MISSES
                self._skip[rid] = backoff(PRIOR_MISSES) - 1  # (this step is the first)
                self._doubted.add(rid)
                return 0
        return k

    def _max_drafts(self, req_ids: list[str], eligible: np.ndarray) -> np.ndarray:
        """Drafts each row asks for this step (0: none): off for a large batch, else
        each eligible request's adaptive k (0 while it backs off)."""
        n = len(req_ids)
        max_drafts = np.zeros(n, dtype=np.int64)
        d = self.config.disable_by_batch_size
        if d is None or n < d:
            for r in np.nonzero(eligible)[0].tolist():
                max_drafts[r] = self._wanted(req_ids[r])
        if self.row_budget is not None:
            asking = int(np.count_nonzero(max_drafts))
            if asking:  # share the rows the batch leaves free under the budget
                np.minimum(max_drafts, max(0, self.row_budget - n) // asking, out=max_drafts)
        return max_drafts

    def propose_with_model(self, runner, hidden, meta, req_ids: list[str],
                           eligible: np.ndarray) -> list[list[int]]:
        """A draft model's proposals. Its own K/V (or context) must cover every position
        before it drafts: a request that proposes nothing this step keeps its decode row
        waiting for the step it next proposes from (spec_decode/deferred.py)."""
        if self._shadow:
            batch = runner.input_batch
            self._settle_shadows(batch.req_id_to_index, batch.token_ids_cpu,
                                 batch.num_tokens_no_spec)
        # A step mixing suspended requests with drafting ones: theirs are dropped rows.
        skip = self._suspended if self._suspended and not self._suspended.isdisjoint(
            req_ids) else None
        if skip is not None:
            eligible = eligible & ~rows_in(req_ids, skip)
        if self._none_proposes(req_ids, eligible):
            # The common step of requests that back off: their rows wait, through a
            # path of a few dict and tensor operations (no numpy over the batch).
            waited = self.model_proposer.wait(runner, hidden, req_ids, skip)
            if waited is not None:
                return waited
            max_drafts = np.zeros(len(req_ids), dtype=np.int64)
        else:
            max_drafts = self._max_drafts(req_ids, eligible)
        drafts = self.model_proposer.propose(runner, hidden, meta, max_drafts, skip)
        if self._doubted:
            self._shadow_probes(req_ids, drafts, runner.input_batch.num_tokens_no_spec)
        return drafts

    def _none_proposes(self, req_ids: list[str], eligible: np.ndarray) -> bool:
        """Whether no request gets drafts this step; if so, as _max_drafts would, it
        counts a step off each eligible request's back-off. Otherwise nothing changed."""
        n = len(req_ids)
        d = self.config.disable_by_batch_size
        if d is not None and n >= d:
            return True
        skip = self._skip
        full = self.row_budget is not None and n >= self.row_budget  # no row left for drafts
        if not skip and not full:  # nobody backs off
            return False
        if n <= SMALL_BATCH:  # a numpy reduction costs ~15 us here (cold after the forward)
            flags = eligible.tolist()
            rows = range(n) if False not in flags else [r for r in range(n) if flags[r]]
        else:
            rows = range(n) if eligible.all() else np.nonzero(eligible)[0].tolist()
        if full:  # (each request's k and back-off move as where _max_drafts asks it)
            for r in rows:
                self._wanted(req_ids[r])
            return True
        if not all(skip.get(req_ids[r]) for r in rows):
            return False
        for r in rows:
            skip[req_ids[r]] -= 1
        return True

    def propose(self, req_ids: list[str], token_ids: np.ndarray, num_tokens: np.ndarray,
                eligible: np.ndarray, req_index: dict[str, int] | None = None
                ) -> list[list[int]]:
        """n-gram drafts per row (req_ids[i] is row i of token_ids, num_tokens[i] its real
        tokens; req_index: request -> row, if the caller keeps one). Only rows that ask
        for drafts reach the proposer: its index catches up on a request's skipped
        tokens when it is next asked."""
        if self._shadow:
            self._settle_shadows(req_index if req_index is not None else
                                 {rid: r for r, rid in enumerate(req_ids)},
                                 token_ids, num_tokens)
        out: list[list[int]] = [[] for _ in req_ids]
        max_drafts = self._max_drafts(req_ids, eligible)
        rows = np.nonzero(max_drafts)[0].tolist()
        if not rows:
            return out
        # Row views, not a fancy-indexed copy of [rows, max_model_len].
        drafts = self.ngram.propose([req_ids[r] for r in rows], [token_ids[r] for r in rows],
                                    num_tokens[rows], max_drafts[rows])
        for r, dr in zip(rows, drafts):
            out[r] = dr
        if self._doubted:
            self._shadow_probes(req_ids, out, num_tokens)
        return out

    def remove(self, req_id: str) -> None:
        (self.ngram if self.ngram is not None else self.model_proposer).remove(req_id)
        self._next_k.pop(req_id, None)
        self._misses.pop(req_id, None)
        self._skip.pop(req_id, None)
        self._shadow.pop(req_id, None)
        self._doubted.discard(req_id)
        self._seeded.discard(req_id)
        self._suspended.discard(req_id)
