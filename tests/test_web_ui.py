"""The web page at / in a real browser: Debian's chromium, driven by selenium through the
system chromedriver (nothing is downloaded), against live servers on the demo model.
`pytest --web-ui-screenshots DIR` keeps a PNG of each view in DIR to look at.
The server side without a browser is tests/test_web_ui_server.py."""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from live_server import live_server
from tool_chat import TOOL_TEMPLATE, TOOLS, think_checkpoint

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver (`make web-browser` installs them)")

MODEL, KEY = "demo", "web-ui-key"
# max_model_len 4096: room for a reply long enough to stop in the middle
SERVER_ARGS = ("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "4096",
               "--num-kv-blocks", "600", "--log-stats-interval", "0",
               "--uvicorn-log-level", "warning")
SYSTEM = "You are a terse assistant."


@pytest.fixture(scope="module")
def server(demo_path, tmp_path_factory):
    with live_server(demo_path, tmp_path_factory.mktemp("server") / "server.log",
                     *SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def shots(request, tmp_path_factory) -> Path:
    given = request.config.getoption("--web-ui-screenshots")
    path = Path(given) if given else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser():
    options = Options()
    options.binary_location = CHROMIUM  # with both paths given, Selenium Manager stays idle
    for arg in ("--headless=new", "--no-sandbox",  # root in a container: no sandbox
                "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def open_page(driver, url: str, wait_for_models: bool = True):
    driver.set_window_size(1280, 900)
    driver.get(f"{url}/")
    if wait_for_models:
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"),
             "the model list")
    return driver


@pytest.fixture
def page(browser, server):
    open_page(browser, server.url)
    browser.get_log("browser")  # from here on: this test's messages only
    return browser


def wait(driver, condition, what: str, timeout: float = 60):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        condition, message=f"waiting for {what}")


def console_errors(driver, allowed: str | None = None) -> list[str]:
    """The browser console's SEVERE messages since the last call (but those containing
    `allowed`)."""
    return [e["message"] for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and not (allowed and allowed in e["message"])]


def by_id(driver, id_: str):
    return driver.find_element(By.ID, id_)


def fill(driver, id_: str, value) -> None:
    el = by_id(driver, id_)
    el.clear()
    el.send_keys(str(value))


def set_value(driver, id_: str, value: str) -> None:
    """For long text (a JSON schema): set at once rather than typed key by key."""
    driver.execute_script("arguments[0].value = arguments[1]", by_id(driver, id_), value)


def replies(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")


def send(driver, text: str):
    """Type `text` and press Enter; the new reply's element."""
    before = len(replies(driver))
    by_id(driver, "message").send_keys(text, Keys.ENTER)
    wait(driver, lambda d: len(replies(d)) > before, "the reply to appear")
    return replies(driver)[-1]


def finished(driver, reply, states=("done",), timeout: float = 120) -> str:
    wait(driver, lambda d: reply.get_attribute("data-state") != "streaming", "the reply to end",
         timeout)
    assert reply.get_attribute("data-state") in states, notices(driver)
    return reply.find_element(By.CSS_SELECTOR, ".content").get_property("textContent")


def notices(driver) -> list[str]:
    return [n.get_property("textContent") for n in
            driver.find_elements(By.CSS_SELECTOR, "#log .msg.notice .content")]


def stats(url: str, **kw) -> dict:
    return httpx.get(f"{url}/stats", timeout=10, **kw).json()


def wait_idle(url: str, timeout: float = 30, **kw) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(url, **kw)
        if s["requests"]["running"] == s["requests"]["waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"server still busy: {s['requests']}"
        time.sleep(0.05)


# ---- the playground ---------------------------------------------------------------------
def test_page_loads_without_console_errors_and_every_control_has_a_label(page, shots):
    assert page.title == "tokenmill"
    assert [o.text for o in page.find_elements(By.CSS_SELECTOR, "#model option")] == [MODEL]
    unlabeled = page.execute_script(
        "return [...document.querySelectorAll('input, select, textarea')]"
        ".filter((e) => !e.labels || !e.labels.length).map((e) => e.id)")
    assert unlabeled == []
    assert by_id(page, "view-dashboard").get_attribute("hidden") is not None
    # a narrow window: one column, nothing wider than the window
    page.set_window_size(400, 900)
    layout = page.execute_script("""
        const box = (id) => document.getElementById(id).getBoundingClientRect();
        return {stacked: box('model').bottom <= box('message').top,
                overflow: document.documentElement.scrollWidth - window.innerWidth};""")
    assert layout["stacked"] and layout["overflow"] <= 0, layout
    page.save_screenshot(str(shots / "playground-narrow.png"))
    assert console_errors(page) == []


def test_a_streamed_reply_equals_the_openai_clients_greedy_reply(page, client, shots):
    fill(page, "system", SYSTEM)
    fill(page, "temperature", 0)
    fill(page, "max-tokens", 24)
    box = by_id(page, "message")
    # Shift+Enter is a new line, not a send
    box.send_keys("Say")
    ActionChains(page).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    assert box.get_property("value") == "Say\n" and not replies(page)
    reply = send(page, "hello.")
    text = finished(page, reply)
    assert box.get_property("value") == ""

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say\nhello."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_tokens=24)
    assert text == r.choices[0].message.content and text
    meta = reply.find_element(By.CSS_SELECTOR, ".meta").text
    assert f"{r.usage.completion_tokens} tokens" in meta and "TTFT" in meta, meta
    assert "tokens/s" in meta and f"finish: {r.choices[0].finish_reason}" in meta, meta

    # the second turn carries the first
    second = finished(page, send(page, "Again."))
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_tokens=24)
    assert second == r.choices[0].message.content
    page.save_screenshot(str(shots / "playground.png"))
    assert console_errors(page) == []


def test_stop_aborts_the_request_mid_stream(page, server):
    before = wait_idle(server.url)
    fill(page, "system", SYSTEM)
    fill(page, "temperature", 0)
    fill(page, "max-tokens", 4000)  # the demo model's greedy reply runs to max_tokens
    reply = send(page, "Say hello.")
    content = reply.find_element(By.CSS_SELECTOR, ".content")
    wait(page, lambda d: content.get_property("textContent"), "the first tokens")
    assert by_id(page, "send").get_property("disabled")
    by_id(page, "stop").click()
    finished(page, reply, states=("stopped",))
    after = wait_idle(server.url)  # the server saw the disconnect and aborted the request
    assert after["requests"]["aborted_total"] == before["requests"]["aborted_total"] + 1
    assert after["requests"]["finished_total"] == before["requests"]["finished_total"]
    assert after["kv_cache"]["used_blocks"] == 0
    assert 0 < int(reply.get_attribute("data-tokens")) < 4000
    assert "stopped" in reply.find_element(By.CSS_SELECTOR, ".meta").text
    assert not by_id(page, "send").get_property("disabled")
    assert by_id(page, "stop").get_property("disabled")
    assert console_errors(page) == []


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
# The grammar allows free whitespace, which a random model may pick until max_tokens: the
# test takes the first of these conversations whose greedy reply closes the object.
SCHEMA_CHATS = [("You answer in JSON.", "Tell me about the mill."),
                ("You answer in JSON.", "a number please"), ("", "a number please"),
                ("Reply with a number.", "Which one?"), ("", "Pick one.")]


def test_a_json_schema_gives_a_reply_that_validates(page, client):
    set_value(page, "schema", "{not json")
    by_id(page, "message").send_keys("x", Keys.ENTER)
    wait(page, lambda d: notices(d), "the schema error")
    assert notices(page)[0].startswith("JSON schema: not valid JSON"), notices(page)
    assert not replies(page) and by_id(page, "message").get_property("value") == "x"
    by_id(page, "message").clear()

    fmt = {"type": "json_schema", "json_schema": {"name": "playground", "schema": SCHEMA,
                                                  "strict": True}}
    for system, user in SCHEMA_CHATS:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}]
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=200, response_format=fmt)
        if r.choices[0].finish_reason == "stop":
            break
    else:
        pytest.fail("no greedy reply of SCHEMA_CHATS completes the JSON: add a conversation")
    fill(page, "system", system) if system else None
    fill(page, "temperature", 0)
    fill(page, "max-tokens", 200)
    set_value(page, "schema", json.dumps(SCHEMA, indent=2))
    reply = send(page, user)
    text = finished(page, reply)
    assert text == r.choices[0].message.content
    jsonschema.validate(json.loads(text, strict=False), SCHEMA)
    assert "finish: stop" in reply.find_element(By.CSS_SELECTOR, ".meta").text
    assert console_errors(page) == []


# ---- reasoning and tool calls ---------------------------------------------------------
THINK_MODEL = "demo-think"


@pytest.fixture(scope="module")
def think_server(demo_path, tmp_path_factory):
    """--reasoning-parser and tools on the demo model with `<think>` / `</think>` as tokens
    (as tests/test_server_reasoning.py starts it)."""
    folder = tmp_path_factory.mktemp("think-server")
    checkpoint = think_checkpoint(demo_path, str(folder / "model"))
    template = folder / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    with live_server(checkpoint, folder / "server.log", "--served-model-name", THINK_MODEL,
                     "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256",
                     "--chat-template", str(template), "--reasoning-parser", "qwen3",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                     "--log-stats-interval", "0", "--uvicorn-log-level", "warning") as srv:
        srv.end_tag = think_end_id(checkpoint)
        yield srv


def think_end_id(checkpoint: str) -> str:
    from transformers import AutoTokenizer
    return str(AutoTokenizer.from_pretrained(checkpoint).convert_tokens_to_ids("</think>"))


def extend_chat_requests(driver, extra: dict) -> None:
    """The page has no fields for tools, template kwargs or logit_bias: its chat requests
    get `extra` merged in by a wrapped fetch (gone with the next page load), which also
    keeps each body sent in window.sentBodies. `extra` goes as JSON text: selenium's own
    conversion sorts the keys, and the template renders the tools' JSON in their order."""
    driver.execute_script("""
        const extra = JSON.parse(arguments[0]);
        const plain = window.fetch;
        window.sentBodies = [];
        window.fetch = (path, init) => {
          if (String(path).endsWith("chat/completions")) {
            const body = Object.assign(JSON.parse(init.body), extra);
            window.sentBodies.push(body);
            init = {...init, body: JSON.stringify(body)};
          }
          return plain(path, init);
        };""", json.dumps(extra))


def test_reasoning_collapsed_and_tool_calls_in_a_reply(browser, think_server, shots):
    page = open_page(browser, think_server.url)
    browser.get_log("browser")
    client = openai.OpenAI(base_url=f"{think_server.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    user = [{"role": "user", "content": "Weather in Oslo?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    # thinking opened by the template, a named tool forced after it; the random model's
    # greedy thinking ends where a bias on `</think>` makes it: the first bias that gives
    # some reasoning and then the call
    for bias in (2, 3, 4, 5, 6, 7, 8, 10, 12):
        extra = {"tools": TOOLS, "tool_choice": forced, "logit_bias": {think_server.end_tag: bias},
                 "chat_template_kwargs": {"thinking": True}}
        r = client.chat.completions.create(model=THINK_MODEL, messages=user, temperature=0,
                                           max_tokens=200, extra_body=extra)
        choice = r.choices[0]
        reasoning = (choice.message.model_extra or {}).get("reasoning_content")
        if reasoning and choice.finish_reason == "tool_calls":
            break
    else:
        pytest.fail("no bias gives reasoning and then a call: add one")
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls and all(name == "get_weather" for name, _ in calls)

    extend_chat_requests(page, extra)
    fill(page, "temperature", 0)
    fill(page, "max-tokens", 200)
    reply = send(page, user[0]["content"])
    assert finished(page, reply) == ""  # no text beside the call (content null)
    details = reply.find_elements(By.CSS_SELECTOR, "details.reasoning")
    assert len(details) == 1 and details[0].get_property("open") is False  # collapsed
    assert details[0].find_element(By.CSS_SELECTOR, "summary").text == "Reasoning"
    assert details[0].find_element(By.CSS_SELECTOR, ".text").get_property(
        "textContent") == reasoning
    order = page.execute_script(
        "return [...arguments[0].children].map((e) => e.className)", reply)
    assert order == ["who", "reasoning", "content"] + ["tool-call"] * len(calls) + ["meta"]
    shown = [(b.find_element(By.CSS_SELECTOR, ".name").get_property("textContent"),
              b.find_element(By.CSS_SELECTOR, ".arguments").get_property("textContent"))
             for b in reply.find_elements(By.CSS_SELECTOR, ".tool-call")]
    assert shown == calls
    meta = reply.find_element(By.CSS_SELECTOR, ".meta").text
    assert f"{r.usage.completion_tokens} tokens" in meta and "finish: tool_calls" in meta, meta
    details[0].find_element(By.CSS_SELECTOR, "summary").click()  # opens on a click
    assert details[0].get_property("open") is True
    page.save_screenshot(str(shots / "playground-tools.png"))

    # the next request carries the turn as OpenAI's message: calls, content null, no reasoning
    second = send(page, "Thanks.")
    finished(page, second)
    sent = page.execute_script("return window.sentBodies")
    assert len(sent) == 2
    turn = sent[1]["messages"][1]
    ids = [c["id"] for c in turn["tool_calls"]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    assert turn == {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in zip(ids, calls)]}
    # and the server answers it as it answers the client's same conversation (the template
    # renders no ids)
    r2 = client.chat.completions.create(
        model=THINK_MODEL, temperature=0, max_tokens=200, extra_body=extra,
        messages=user + [choice.message.model_dump(include={"role", "content", "tool_calls"}),
                         {"role": "user", "content": "Thanks."}])
    assert [(b.find_element(By.CSS_SELECTOR, ".name").get_property("textContent"),
             b.find_element(By.CSS_SELECTOR, ".arguments").get_property("textContent"))
            for b in second.find_elements(By.CSS_SELECTOR, ".tool-call")] == [
        (c.function.name, c.function.arguments) for c in r2.choices[0].message.tool_calls]
    assert console_errors(page) == []


# ---- the dashboard ----------------------------------------------------------------------
def test_the_dashboard_moves_while_a_load_runs(page, server, client, shots):
    wait_idle(server.url)
    by_id(page, "tab-dashboard").click()
    assert by_id(page, "view-playground").get_attribute("hidden") is not None
    wait(page, lambda d: "Block size" in by_id(d, "config").text, "the engine configuration")
    config = stats(server.url)["config"]
    shown = dict(zip([e.text for e in page.find_elements(By.CSS_SELECTOR, "#config dt")],
                     [e.text for e in page.find_elements(By.CSS_SELECTOR, "#config dd")]))
    assert shown["Model"] == MODEL and shown["dtype"] == "float32" and shown["Device"] == "cpu"
    assert shown["Kernels"] == config["kernels"]
    assert (shown["Block size"], shown["KV blocks"], shown["max_num_seqs"]) == ("16", "600", "256")
    assert shown["Prefix caching"] == "on" and shown["Speculation"] == "off"

    def points(name):
        return int(by_id(page, f"chart-{name}").get_attribute("data-points") or 0)

    start = {name: points(name) for name in ("requests", "kv", "throughput", "latency")}
    stop = threading.Event()
    errors = []

    def load(i):
        try:
            while not stop.is_set():
                client.completions.create(model=MODEL, prompt=f"load {i}: the mill", max_tokens=64,
                                          extra_body={"ignore_eos": True})
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    seen_running = set()
    try:
        def busy(d):
            seen_running.add(by_id(d, "v-running").text)
            gen = by_id(d, "v-gen-tps").text
            return (seen_running - {"0", "-"} and gen not in ("-", "0.0")
                    and by_id(d, "v-ttft").text != "-" and by_id(d, "v-itl").text != "-")
        wait(page, busy, "the numbers to move")
        wait(page, lambda d: all(points(n) >= start[n] + 3 for n in start), "chart points")
        time.sleep(2)  # a few more points for the screenshot
        page.set_window_size(1280, 1500)  # tall enough for the configuration too
        page.save_screenshot(str(shots / "dashboard.png"))
        page.set_window_size(1280, 900)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert float(by_id(page, "v-gen-tps").text) > 0
    assert "ms" in by_id(page, "v-ttft").text and "ms" in by_id(page, "v-itl").text
    wait(page, lambda d: by_id(d, "v-running").text == "0", "running to fall back to 0")

    # arrow keys move between the tabs
    by_id(page, "tab-dashboard").send_keys(Keys.ARROW_LEFT)
    assert by_id(page, "tab-playground").get_attribute("aria-selected") == "true"
    assert by_id(page, "view-dashboard").get_attribute("hidden") is not None
    assert console_errors(page) == []


# ---- --api-key --------------------------------------------------------------------------
@pytest.fixture
def keyed_server(demo_path, tmp_path):
    with live_server(demo_path, tmp_path / "server.log", *SERVER_ARGS, "--api-key", KEY) as srv:
        yield srv


def test_the_api_key_field_against_api_key(browser, keyed_server, shots):
    url = keyed_server.url
    message = httpx.get(f"{url}/v1/models").json()["error"]["message"]
    error = f"401: {message}"
    page = open_page(browser, url, wait_for_models=False)  # no key: no model list
    wait(page, lambda d: notices(d), "the model list's error")
    assert notices(page) == [f"Could not list the models: {error}"]

    fill(page, "api-key", "wrong-key")
    fill(page, "max-tokens", 8)
    by_id(page, "message").send_keys("Hello", Keys.ENTER)
    wait(page, lambda d: len(notices(d)) >= 2, "the request's error")
    assert error in notices(page)[-1]
    assert page.find_elements(By.CSS_SELECTOR, "#log .msg.user.failed")
    assert by_id(page, "message").get_property("value") == "Hello"  # back, to send again
    page.save_screenshot(str(shots / "api-key-error.png"))
    by_id(page, "tab-dashboard").click()
    wait(page, lambda d: by_id(d, "stats-error").is_displayed(), "the stats error")
    assert error in by_id(page, "stats-error").text

    fill(page, "api-key", KEY)
    by_id(page, "api-key").send_keys(Keys.TAB)  # leaving the field loads the model list
    wait(page, lambda d: not by_id(d, "stats-error").is_displayed(), "stats with the key")
    wait(page, lambda d: by_id(d, "v-running").text == "0", "the dashboard's numbers")
    by_id(page, "tab-playground").click()
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"), "the model list")
    reply = send(page, Keys.END)  # the restored "Hello"
    assert finished(page, reply)
    assert int(reply.get_attribute("data-tokens")) > 0
    assert stats(url, headers={"Authorization": f"Bearer {KEY}"})["requests"][
        "finished_total"] == 1
    # the only console errors: the refused requests, as the browser logs them
    assert console_errors(page, allowed="401") == []

