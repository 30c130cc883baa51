"""`tokenmill serve --speculative-config`: streaming, n = 2, logprobs and a JSON schema
in one run; greedy outputs equal those of a server without speculation (n = 2 needs
temperature > 0: seeded, its completions repeat from call to call)."""
from __future__ import annotations

import json

import pytest

from tokenmill.demo_model import DEMO_MODEL_NAME, ensure_demo_model

MODEL = "demo"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
PROMPTS = ["the mill the mill the mill the mill", "a b a b a b a b", "Once upon a time",
           "1 2 3 1 2 3 1 2 3"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("openai")
    import openai

    from live_server import live_server
    path = ensure_demo_model(str(tmp_path_factory.mktemp("demo") / DEMO_MODEL_NAME))
    common = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
              "--num-kv-blocks", "128", "--log-stats-interval", "0",
              "--uvicorn-log-level", "warning"]
    logs = tmp_path_factory.mktemp("logs")
    with live_server(path, logs / "plain.log", *common) as plain, \
            live_server(path, logs / "spec.log", *common, "--speculative-config", SPEC) as spec:
        yield [openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0,
                             timeout=120) for s in (plain, spec)], spec.url


def run_all(client) -> list:
    out = []
    for p in PROMPTS:  # streamed, greedy, with logprobs
        text, lps = "", []
        for chunk in client.completions.create(model=MODEL, prompt=p, max_tokens=40,
                                               temperature=0, logprobs=2, stream=True,
                                               extra_body={"ignore_eos": True}):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    lps += c.logprobs.token_logprobs
        out.append((text, lps))
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a number please"}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "n", "schema": SCHEMA}})
    out.append(r.choices[0].message.content)
    return out


def test_outputs_equal_the_server_without_speculation(servers):
    (plain, spec), spec_url = servers
    want, got = run_all(plain), run_all(spec)
    for (wt, wl), (gt, gl) in zip(want[:-1], got[:-1]):
        assert gt == wt
        assert len(gl) == len(wl) == 40
        for a, b in zip(wl, gl):
            assert a == pytest.approx(b, abs=1e-4)
    assert got[-1] == want[-1]
    assert json.loads(got[-1])["n"] in range(10)
    # n = 2, sampled and seeded, streamed: two full completions, the same on a second call.
    def two(seed):
        text = ["", ""]
        for chunk in spec.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30,
                                             temperature=0.8, seed=seed, n=2, stream=True,
                                             extra_body={"ignore_eos": True}):
            for c in chunk.choices:
                text[c.index] += c.text
        return text
    first = two(5)
    assert first == two(5) and all(first)
    import httpx
    metrics = httpx.get(f"{spec_url}/metrics").text
    # Drafts were verified (the demo model's random weights rarely repeat themselves, so
    # few are accepted: acceptance itself is tested offline, tests/test_spec_decode.py).
    drafts = [line for line in metrics.splitlines()
              if line.startswith("tokenmill:spec_decode_num_draft_tokens_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0
    assert "tokenmill:spec_decode_num_accepted_tokens_per_pos_total" in metrics
