"""POST /v1/embeddings on a live server (a Qwen3-Embedding-shaped checkpoint: bare
Qwen3Model, the demo tokenizer, sentence-transformers files saying last-token pooling,
normalised), driven by the official openai client: floats and base64 equal HF's pooling,
token-id inputs, usage counts, 400s naming the field, generation refused on a pooling
server and embeddings refused on a generation server."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from embedding_checkpoint import build_qwen3_embedding, hf_pooled, write_st_files  # noqa: E402
from inprocess_app import async_llm, call  # noqa: E402,F401 (a fixture)
from live_server import live_server  # noqa: E402

MODEL = "emb"
TEXTS = ["The town sat where two rivers met.", "bread", "Every morning before sunrise "
         "the baker on Mill Street lit her ovens, and by nine the shelves were empty."]
TOL = 1e-5
SAME = 1e-6  # the same input in another request (another batch: float32 rounding)


@pytest.fixture(scope="module")
def checkpoint(demo_path, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("embedding_server"))
    hf = build_qwen3_embedding(path, tokenizer_from=demo_path, vocab_size=4096)
    write_st_files(path, "LAST", normalize=True)
    from transformers import AutoTokenizer
    return path, hf, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    # No --runner: a bare *Model checkpoint with sentence-transformers files is an embedder.
    with live_server(checkpoint[0], tmp_path_factory.mktemp("server") / "server.log",
                     "--served-model-name", MODEL, "--dtype", "float32",
                     "--max-model-len", "64", "--num-kv-blocks", "64",
                     "--max-embedding-inputs", "8") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def post(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)


def used_blocks(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("tokenmill:kv_cache_used_blocks"))
    return float(line.split()[-1])


def same(a, b) -> bool:
    return len(a) == len(b) and float(np.abs(np.subtract(a, b)).max()) <= SAME


def assert_close_to_hf(checkpoint, ids_list, got):
    _, hf, _ = checkpoint
    assert len(got) == len(ids_list)
    for ids, vec in zip(ids_list, got):
        ref = hf_pooled(hf, ids, "LAST", True)
        assert float((torch.tensor(vec) - ref).abs().max()) < TOL


def test_floats_and_base64_equal_hf(checkpoint, client, server):
    tok = checkpoint[2]
    ids = [tok.encode(t) for t in TEXTS]
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == MODEL
    assert [d.index for d in r.data] == [0, 1, 2] and all(d.object == "embedding"
                                                         for d in r.data)
    floats = [d.embedding for d in r.data]
    assert_close_to_hf(checkpoint, ids, floats)
    n = sum(map(len, ids))
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (n, n)
    # the client asks for base64 by default and decodes it
    r64 = client.embeddings.create(model=MODEL, input=TEXTS)
    assert all(same(d.embedding, f) for d, f in zip(r64.data, floats))
    assert r64.usage.prompt_tokens == n
    # and by hand: little-endian float32 bytes
    body = post(server, input=TEXTS[1], encoding_format="base64").json()
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert same(raw, floats[1]) and body["usage"]["prompt_tokens"] == len(ids[1])
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and same(one.data[0].embedding, floats[0])


def test_token_id_inputs(checkpoint, client):
    one = [5, 17, 300, 4095]
    many = [[7, 8], [9, 10, 11, 12, 13], list(range(100, 164))]  # the last: max_model_len
    r = client.embeddings.create(model=MODEL, input=one, encoding_format="float")
    assert_close_to_hf(checkpoint, [one], [d.embedding for d in r.data])
    assert r.usage.prompt_tokens == 4
    r = client.embeddings.create(model=MODEL, input=many, encoding_format="float")
    assert_close_to_hf(checkpoint, many, [d.embedding for d in r.data])
    assert r.usage.prompt_tokens == 2 + 5 + 64


@pytest.mark.parametrize("body, param", [
    (dict(input=""), "input"), (dict(input=[]), "input"), (dict(input=["a", ""]), "input"),
    (dict(input=[[]]), "input"), (dict(input=[[1], []]), "input"), (dict(input=5), "input"),
    (dict(input=[1, 4096]), "input"), (dict(input=[[3], [1, -1]]), "input"),
    (dict(input=[1] * 65), "input"), (dict(input=["a"] * 9), "input"),
    (dict(input="a", dimensions=8), "dimensions"),
    (dict(input="a", encoding_format="bytes"), "encoding_format"),
    (dict(input="a", messages=[{"role": "user", "content": "hi"}]), "messages"),
    (dict(input="a", truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    r = post(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError", err


def test_refusals_through_the_client_leave_the_server_clean(client, server):
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model=MODEL, input=[1] * 65)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "input"
    assert "max_model_len=64" in ei.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="a")
    # generation on a pooling server: refused, naming the model
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert ei.value.body["param"] == "model" and "pooling runner" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert ei.value.body["param"] == "model"
    r = client.embeddings.create(model=MODEL, input=TEXTS * 2, encoding_format="float")
    assert len(r.data) == 6 and used_blocks(server) == 0


def test_a_generation_server_takes_a_mixed_load(async_llm):  # noqa: F811 (the fixture)
    """Unlike vLLM, a generation server pools too: embeddings and completions sent
    together all succeed, each embedding equals the same input's alone (within float32
    rounding across batches), each greedy completion equals its text alone."""
    import asyncio

    from tokenmill.entrypoints.openai.server import build_app
    app = build_app(async_llm, "demo")
    emb = ("POST", "/v1/embeddings", {"json": {"input": TEXTS[2]}})
    gen = ("POST", "/v1/completions", {"json": {"prompt": "hello there", "max_tokens": 8,
                                                "temperature": 0}})
    alone_emb, alone_gen = call(app, emb, gen)
    assert alone_emb.status_code == 200 and alone_gen.status_code == 200, alone_emb.text
    want = np.array(alone_emb.json()["data"][0]["embedding"])
    assert abs(np.linalg.norm(want) - 1) < 1e-5  # normalised by default

    async def mixed():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as c:
            return await asyncio.gather(*[c.request(m, path, **kw)
                                          for m, path, kw in [emb, gen] * 6])
    out = asyncio.run(mixed())
    assert all(r.status_code == 200 for r in out), [r.text for r in out]
    for r in out[0::2]:
        got = np.array(r.json()["data"][0]["embedding"])
        assert np.abs(got - want).max() <= SAME
    for r in out[1::2]:
        assert r.json()["choices"][0]["text"] == alone_gen.json()["choices"][0]["text"]


def test_generated_requests_get_no_server_error(server):
    """schemathesis against the route's own schema (as tests/test_server_schemathesis.py
    does for the generation routes): bodies that fit it and bodies that do not; no 5xx,
    nothing leaked, no block left, the log clean."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    operation = schemathesis.openapi.from_url(f"{server.url}/openapi.json")[
        "/v1/embeddings"]["POST"]
    statuses = []

    def pin_model(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL
        return case

    for mode, count in ((GenerationMode.POSITIVE, 40), (GenerationMode.NEGATIVE, 10)):
        @settings(max_examples=count, derandomize=True, database=None, deadline=None,
                  phases=(Phase.explicit, Phase.generate),
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(case=operation.as_strategy(generation_mode=mode).map(pin_model))
        def run(case):
            response = case.call(base_url=server.url, timeout=60)
            statuses.append(response.status_code)
            case.validate_response(response, checks=[not_a_server_error])
            assert response.status_code < 500, (response.status_code, response.text[:500])
            assert "Traceback" not in response.text and 'File "/' not in response.text
        run()
    assert len(statuses) >= 45 and set(statuses) <= {200, 400, 404, 413, 422}, statuses
    assert used_blocks(server) == 0 and server.proc.poll() is None
    server.log.flush()
    with open(server.log.name) as f:
        log = f.read()
    assert "Traceback" not in log and "unhandled" not in log, log[-3000:]
