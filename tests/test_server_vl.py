"""Images through the server's chat route: a base64 image gives the offline API's
greedy text; what cannot or must not be read (a broken image, an oversized one, a
remote URL, a file outside the allowed folder) is a 400 naming `messages`, and the
server keeps serving."""
from __future__ import annotations

import base64
import io

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("PIL")

from live_server import live_server  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from vl_checkpoint import build_vl_checkpoint, make_image  # noqa: E402

MODEL = "vl"
MAX_PIXELS = 100 * 100


def png(arr) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "describe the picture"}]}]


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    build_vl_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(png(make_image(30, 45, 0)))
    return d


@pytest.fixture(scope="module")
def server(vl_path, media_dir, tmp_path_factory):
    with live_server(vl_path, tmp_path_factory.mktemp("server") / "server.log",
                     "--served-model-name", MODEL, "--dtype", "float32",
                     "--max-model-len", "256", "--num-kv-blocks", "64",
                     "--allowed-local-media-path", str(media_dir),
                     "--max-image-pixels", str(MAX_PIXELS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def chat(client, messages):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                       temperature=0)
    return r.choices[0].message.content


def test_base64_image_matches_offline(client, vl_path, media_dir):
    url = data_url(png(make_image(30, 45, 0)))
    got = chat(client, message(url))
    llm = LLM(vl_path, dtype="float32", max_model_len=256, num_kv_blocks=64)
    want = llm.chat(message(url), SamplingParams(max_tokens=10, temperature=0),
                    use_tqdm=False)[0].outputs[0].text
    assert got == want and got
    # the same image from a file inside the allowed folder: the same answer
    assert chat(client, message(f"file://{media_dir}/cat.png")) == want


@pytest.mark.parametrize("url", [
    data_url(b"\x89PNG\r\n\x1a\nnot really a png"),  # does not decode
    "data:image/png;base64,@@@not base64@@@",
    data_url(png(make_image(120, 120, 3))),  # 14400 pixels > MAX_PIXELS
    "http://127.0.0.1:9/cat.png",  # remote: never fetched
    "https://example.com/cat.png",
    "file:///etc/passwd",  # outside the allowed folder
    "file://{media}/../outside.png",
    "ftp://example.com/cat.png",
], ids=["broken", "not_base64", "oversized", "http", "https", "file_outside", "file_dotdot",
        "ftp"])
def test_refused_images_are_400(client, url, media_dir):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, message(url.replace("{media}", str(media_dir))))
    body = ei.value.response.json()["error"]
    assert body["code"] == 400 and body["param"] == "messages"
    assert "image" in body["message"] or "URL" in body["message"] or "file" in body["message"]
    # still serving
    r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "the sky"}])
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- a Qwen3.5 (hybrid) vision-language checkpoint --------------------------------------

@pytest.fixture(scope="module")
def vl35_path(tmp_path_factory):
    from vl_checkpoint import build_qwen3_5_vl_checkpoint
    path = str(tmp_path_factory.mktemp("qwen3_5_vl"))
    build_qwen3_5_vl_checkpoint(path)
    return path


def test_qwen3_5_base64_image_matches_offline(vl35_path, tmp_path_factory):
    """The hybrid model behind the chat route: a base64 image gives the offline API's
    greedy text, and a text-only chat still gets the offline text."""
    url = data_url(png(make_image(30, 45, 0)))
    text_only = [{"role": "user", "content": "what color is the sky ?"}]
    params = SamplingParams(max_tokens=10, temperature=0)
    llm = LLM(vl35_path, dtype="float32", max_model_len=256)
    want = [llm.chat(m, params, use_tqdm=False)[0].outputs[0].text
            for m in (message(url), text_only)]
    llm.llm_engine.shutdown()
    assert want[0]  # (the text-only reply may be empty: a random model may stop at once)
    with live_server(vl35_path, tmp_path_factory.mktemp("server35") / "server.log",
                     "--served-model-name", MODEL, "--dtype", "float32",
                     "--max-model-len", "256") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0,
                               timeout=60)
        assert [chat(client, m) for m in (message(url), text_only)] == want
