"""Fault injection, for the tests of per-request fault isolation.

A fault is armed for a site and a selector; the code at that site asks
`fires(site, request_id, prompt_token_ids)` and raises when it is told to. Sites:

* "input"       - the runner taking a new request into its batch (unattributed:
                  the engine must blame the requests that entered in that step)
* "sampler"     - the runner's sampling of one request's row
* "detokenizer" - the output processor decoding one request's tokens
* "grammar"     - one request's grammar matcher accepting a token
* "step_loop"   - the server's engine loop itself (the engine dies)

A selector is `rid:<request id>` (exact) or `token:<id>` (any request whose prompt
holds that token id, for live servers whose request ids are random). Arm in
process with `arm(...)`, or for a server with the environment variable
TOKENMILL_FAULTS="site=selector;site=selector". Nothing is armed in normal
runs, and then each site costs one dict lookup.
"""
from __future__ import annotations

import os

SITES = ("input", "sampler", "detokenizer", "grammar", "step_loop")

ARMED: dict[str, set[str]] = {}


class InjectedFault(RuntimeError):
    """The exception an armed site raises."""


def arm(site: str, selector: str) -> None:
    if site not in SITES:
        raise ValueError(f"fault site must be one of {', '.join(SITES)}, got {site!r}")
    if not selector.startswith(("rid:", "token:")):
        raise ValueError(f"fault selector must be rid:<id> or token:<id>, got {selector!r}")
    ARMED.setdefault(site, set()).add(selector)


def disarm_all() -> None:
    ARMED.clear()


def fires(site: str, request_id: str, prompt_token_ids=()) -> bool:
    selectors = ARMED.get(site)
    if not selectors:
        return False
    if f"rid:{request_id}" in selectors:
        return True
    return any(s.startswith("token:") and int(s[6:]) in prompt_token_ids for s in selectors)


def _arm_from_env() -> None:
    spec = os.environ.get("TOKENMILL_FAULTS", "")
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        site, _, selector = item.partition("=")
        arm(site.strip(), selector.strip())


_arm_from_env()
