"""StructuredOutputManager: grammars for the requests of one engine.

The engine core owns one. It

* validates a request's StructuredOutputsParams when the request is added
  (`validate`: parse now, ValueError naming the field) and starts compiling its
  grammar in a worker thread; compiled grammars are cached by key
  (kind, canonical text, whitespace flag), so equal requests compile once;
* gives each core request a `StructuredOutputRequest` (`new_request`), the
  only thing the scheduler sees: `ready()` (grammar compiled, so the request
  may be scheduled) and `advance(token)` (accept one new token; True when the
  request must stop: the grammar is complete);
* with a reasoning parser (`--reasoning-parser`), holds each grammar until the
  request's reasoning ends (reasoning_gate.py): thinking tokens are free;
* builds the step's compact bitmask (`grammar_bitmask`): one row per
  scheduled structured request, in scheduling order, and the request id -> row
  map; the runner maps the rows onto its batch (the engine core calls it
  between the forward and the sampling, see EngineCore._execute).

Bit t of row r (word t // 32, bit t % 32) is 1 when token t is allowed.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict

import numpy as np

from tokenmill.errors import ParamError
from tokenmill.structured_output.params import StructuredOutputsParams
from tokenmill.structured_output.reasoning_gate import ReasoningGates, fill_gated_rows

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256
# Async scheduling: how long a step's sampling waits for its bitmask before failing.
BITMASK_WAIT_S = 120.0


class StructuredOutputRequest:
    """One request's grammar matcher, created when its grammar is compiled."""

    __slots__ = ("request_id", "_future", "_backend", "matcher", "failed", "gate")

    def __init__(self, request_id: str, future: concurrent.futures.Future, backend,
                 gate=None):
        self.request_id = request_id
        # A ReasoningEndTracker: the grammar applies once it has ended (None: at once).
        self.gate = gate
        self._future = future
        self._backend = backend
        self.matcher = None
        # Why the grammar cannot be used (compile error or time limit); the scheduler
        # then fails the request: it never runs unconstrained.
        self.failed: str | None = None

    def ready(self) -> bool:
        """True once the grammar is compiled or has failed (then the request is failed)."""
        if self.matcher is not None or self.failed:
            return True
        if not self._future.done():
            return False
        try:
            self.matcher = self._backend.new_matcher(self._future.result())
        except Exception:  # noqa: BLE001 - a bug or a resource error, not bad input
            logger.exception("request %s: compiling its grammar failed", self.request_id)
            self.failed = "its grammar failed to compile"
        self._future = None
        return True

    def advance(self, token_id: int) -> bool:
        """Accept a newly generated token. True: the request must stop (the grammar
        has ended, or the token broke it, which the bitmask should make impossible)."""
        m = self.matcher
        if m is None:
            return True  # failed to compile
        gate = self.gate
        if gate is not None and not gate.ended and not gate.feed([token_id]):
            return False  # a thinking token: the grammar waits for the answer
        if not m.accept_token(token_id):
            logger.error("request %s: token %d does not fit its grammar; stopping it",
                         self.request_id, token_id)
            return True
        return m.is_terminated()

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def thinking(self, drafts=()) -> bool:
        """Whether every token this step samples is free: the request is inside its
        reasoning and no draft ends it."""
        gate = self.gate
        return (gate is not None and not gate.ended and not gate.undecided
                and gate.end_id not in drafts)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, compile_workers: int = 1,
                 reasoning_parser=None):
        """`reasoning_parser`: a tokenmill.parsers ReasoningParser whose reasoning every
        grammar waits for (None: grammars apply from the first token)."""
        self.tokenizer = tokenizer
        self.reasoning = (ReasoningGates(reasoning_parser, tokenizer)
                          if reasoning_parser is not None else None)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compile_workers = compile_workers
        self._backend = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._grammars: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and stats
        self._bitmask_events: dict[int, threading.Event] = {}  # id(SchedulerOutput) -> filled
        self._draft_events: dict[int, tuple] = {}  # id(SchedulerOutput) -> its runner's drafts

    @property
    def backend(self):
        if self._backend is None:  # requests are prepared on several threads
            with self._lock:
                if self._backend is None:
                    from tokenmill.structured_output.backend import XgrammarBackend
                    self._backend = XgrammarBackend(self.tokenizer, self.vocab_size,
                                                    self.stop_token_ids)
        return self._backend

    @property
    def bitmask_words(self) -> int:
        return -(-self.vocab_size // 32)

    # ---- requests in ----------------------------------------------------------------
    def validate(self, sop: StructuredOutputsParams) -> None:
        """Parse the grammar (ValueError naming the field) and start compiling it."""
        if self.tokenizer is None:
            raise ParamError(sop.field_name(), f"{sop.field_name()}: this model has no "
                                               f"tokenizer, which structured output needs")
        if self.reasoning is not None and self.reasoning.error:
            name = sop.field_name()
            raise ParamError(name, f"{name}: cannot apply after the reasoning of "
                                   f"--reasoning-parser {self.reasoning.parser.name}: "
                                   f"{self.reasoning.error}")
        try:
            self.grammar_future(sop)
        except ParamError:
            raise
        except ValueError as e:
            raise ParamError(sop.field_name(), str(e)) from None

    def grammar_future(self, sop: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compilation of `sop`'s grammar (started now, or shared from the cache)."""
        key = sop.cache_key()
        with self._lock:
            fut = self._grammars.get(key)
            if fut is not None:
                self._grammars.move_to_end(key)
                return fut
        grammar = self.backend.parse(sop)  # raises ValueError: nothing cached
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.compile_workers, thread_name_prefix="tokenmill-grammar")
            fut = self._grammars.get(key)
            if fut is None:
                fut = self._pool.submit(self.backend.compile, grammar)
                self.num_compiled += 1
                self._grammars[key] = fut
                while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                    self._grammars.popitem(last=False)
            return fut

    def new_request(self, request_id: str, sop: StructuredOutputsParams,
                    prompt_token_ids=()) -> StructuredOutputRequest:
        gate = None
        if self.reasoning is not None and not self.reasoning.error:
            gate = self.reasoning.tracker(prompt_token_ids)
        return StructuredOutputRequest(request_id, self.grammar_future(sop), self.backend,
                                       gate)

    def wait_for_grammars(self, timeout: float) -> None:
        """Block up to `timeout` s for a compilation in flight (nothing else to run)."""
        with self._lock:
            pending = [f for f in self._grammars.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)

    # ---- one step -------------------------------------------------------------------
    def grammar_bitmask(self, requests: dict, num_scheduled_tokens: dict[str, int],
                        spec_tokens: dict[str, list[int]] | None = None
                        ) -> tuple[dict[str, int], np.ndarray | None]:
        """The compact bitmask of this step: rows for each scheduled structured request,
        in scheduling order, from its matcher's state now (every token it generated so
        far accepted). A prompt chunk's row is filled too: its sample is discarded.
        Requests finished since scheduling (gone from `requests`) get no row.

        A request verifying drafts (`spec_tokens`) gets 1 + drafts consecutive rows:
        row j is the grammar's state after its first j drafts. Once a draft breaks the
        grammar the rows after it allow everything (the draft itself is masked out at
        its row, so it is rejected and they are never read); the matcher is rolled
        back to where it was. The returned map gives each request's first row."""
        spec_tokens = spec_tokens or {}
        rows: dict[str, int] = {}
        work = []  # (matcher, its drafts)
        num_rows = 0
        for rid in num_scheduled_tokens:
            req = requests.get(rid)
            if req is None:
                continue
            so_req = req.structured_output
            if so_req is None or so_req.matcher is None:
                continue
            drafts = spec_tokens.get(rid, ())
            if so_req.thinking(drafts):
                continue
            rows[rid] = num_rows
            work.append((so_req, drafts))
            num_rows += 1 + len(drafts)
        if not work:
            return {}, None
        bitmask = np.full((num_rows, self.bitmask_words), -1, dtype=np.int32)
        row = 0
        for so_req, drafts in work:
            fill_gated_rows(so_req.matcher, so_req.gate, bitmask, row, drafts)
            row += 1 + len(drafts)
        return rows, bitmask

    # ---- async scheduling: the bitmask is filled on the caller's thread ---------------
    # A launched step's sampling (on the step thread) waits until the caller has
    # accepted the tokens of the step before it and filled this step's bitmask. A step
    # whose grammar requests have draft slots: the runner fills them with its own
    # drafts as it executes the step, so the caller waits for those first.
    def expect_bitmask(self, so, with_drafts: bool = False) -> None:
        """`so` will sample once another thread hands it its grammar (bitmask_ready);
        `with_drafts`: its bitmask covers the drafts the runner puts in (drafts_ready)."""
        self._bitmask_events[id(so)] = (threading.Event(), [None])
        if with_drafts:
            self._draft_events[id(so)] = (threading.Event(), [None])

    def drafts_ready(self, so, drafts: dict[str, list[int]] | None) -> None:
        """(the step thread, once the runner executed `so`) the drafts it ran, per
        request (None: the step failed). A no-op unless expect_bitmask(with_drafts)."""
        pending = self._draft_events.get(id(so))
        if pending is not None:
            pending[1][0] = drafts
            pending[0].set()

    def wait_drafts(self, so, timeout: float = BITMASK_WAIT_S) -> dict[str, list[int]] | None:
        """-> the drafts handed to `so` by drafts_ready, or its scheduled ones when none
        were expected (a synchronous step's, or one without draft slots)."""
        pending = self._draft_events.get(id(so))  # (the step thread looks it up too)
        if pending is None:
            return so.scheduled_spec_decode_tokens
        try:
            if not pending[0].wait(timeout):
                raise RuntimeError(f"the drafts of a step were not known within {timeout} s")
            return pending[1][0]
        finally:
            del self._draft_events[id(so)]

    def is_expected(self, so) -> bool:
        return id(so) in self._bitmask_events

    def bitmask_ready(self, so, grammar=None) -> None:
        """Hand `so` its GrammarOutput (None: nothing to mask, or the step is void)."""
        self._draft_events.pop(id(so), None)  # (a void step's drafts are never waited for)
        event, slot = self._bitmask_events[id(so)]
        slot[0] = grammar
        event.set()

    def wait_bitmask(self, so, timeout: float = BITMASK_WAIT_S):
        """-> the GrammarOutput handed to `so` (None if none was expected or given)."""
        pending = self._bitmask_events.get(id(so))
        if pending is None:
            return None
        event, slot = pending
        try:
            if not event.wait(timeout):
                raise RuntimeError(f"the grammar bitmask of a step was not filled within "
                                   f"{timeout} s")
            return slot[0]
        finally:
            del self._bitmask_events[id(so)]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
