// The playground: a chat streamed from /v1/chat/completions, with the request's settings,
// a stop button, and per reply its tokens, time to first token and tokens/s. A reply shows
// its reasoning (--reasoning-parser) collapsed above the text, and its tool calls below.
import {ApiError, getJSON, streamJSON} from "./api.js";

const $ = (id) => document.getElementById(id);

// the conversation sent with each request: {role, content} (an assistant turn with
// tool_calls too, as OpenAI's messages have them)
let history = [];
let controller = null;  // the AbortController of the reply streaming now

// An element of the log: a message bubble, or a notice.
function entry(kind, text = "") {
  const div = document.createElement("div");
  div.className = `msg ${kind}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = {user: "You", assistant: "Assistant", notice: "Error"}[kind];
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  div.append(who, content);
  $("log").append(div);
  scrollDown();
  return div;
}

// Keep the newest text in view, once per frame (a fast stream adds hundreds of pieces a
// second), unless the reader scrolled up.
let following = true;
let scrollQueued = false;

function scrollDown() {
  if (scrollQueued || !following) return;
  scrollQueued = true;
  requestAnimationFrame(() => {
    scrollQueued = false;
    const log = $("log");
    log.scrollTop = log.scrollHeight;
  });
}

function notice(text) {
  const div = entry("notice", text);
  div.setAttribute("role", "alert");
  return div;
}

// What a reply streams besides its content: reasoning into a collapsed block above the
// text (made on its first piece), each tool call into a block of its own below it, the
// call's name and its arguments as they grow. Text goes in with append (never as HTML).
class ReplyParts {
  constructor(content) {
    this.content = content;
    this.reasoning = null;  // the <details> block's text element, once there is reasoning
    this.calls = [];  // by the delta's index: {id, name, arguments, nameEl, argsEl}
  }

  addReasoning(text) {
    if (!this.reasoning) {
      const details = document.createElement("details");
      details.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      this.reasoning = document.createElement("div");
      this.reasoning.className = "text";
      details.append(summary, this.reasoning);
      this.content.before(details);
    }
    this.reasoning.append(text);
  }

  addToolCall({index, id, function: fn}) {
    let call = this.calls[index];
    if (!call) {
      const div = document.createElement("div");
      div.className = "tool-call";
      const nameEl = document.createElement("span");
      nameEl.className = "name";
      const argsEl = document.createElement("pre");
      argsEl.className = "arguments";
      div.append(nameEl, argsEl);
      // after the content and the calls before it, above the metrics line
      (this.lastCall() || this.content).after(div);
      call = this.calls[index] = {id: null, name: "", arguments: "", div, nameEl, argsEl};
    }
    if (id) call.id = id;
    if (fn && fn.name) {
      call.name = fn.name;
      call.nameEl.textContent = fn.name;
    }
    if (fn && fn.arguments) {
      call.arguments += fn.arguments;
      call.argsEl.append(fn.arguments);
    }
  }

  lastCall() {
    const made = this.calls.filter(Boolean);
    return made.length ? made[made.length - 1].div : null;
  }

  // The assistant turn for the history: no reasoning (it is not sent back), the calls in
  // OpenAI's shape with content null when there is no text beside them.
  message() {
    const text = this.content.textContent;
    const calls = this.calls.filter(Boolean);
    if (!calls.length) return {role: "assistant", content: text};
    return {role: "assistant", content: text || null,
            tool_calls: calls.map((c) => ({id: c.id, type: "function",
                                           function: {name: c.name, arguments: c.arguments}}))};
  }

  empty() {
    return !this.content.textContent && !this.reasoning && !this.calls.length;
  }
}

// A number field's value, or undefined when empty (the server's default then).
function number(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

function buildRequest() {
  const messages = [];
  const system = $("system").value;
  if (system.trim()) messages.push({role: "system", content: system});
  messages.push(...history);
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: {include_usage: true},  // the token count arrives in a last chunk
    temperature: number("temperature"),
    top_p: number("top-p"),
    top_k: number("top-k"),
    max_tokens: number("max-tokens"),
    seed: number("seed"),
  };
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try {
      parsed = JSON.parse(schema);
    } catch (e) {
      throw new ApiError(`JSON schema: not valid JSON (${e.message})`);
    }
    body.response_format = {type: "json_schema",
                            json_schema: {name: "playground", schema: parsed, strict: true}};
  }
  return body;
}

function setStreaming(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

function describe({tokens, exact, ttft, tps, finish, stopped}) {
  const parts = [`${exact ? "" : "~"}${tokens} tokens`];
  if (ttft != null) parts.push(`TTFT ${ttft.toFixed(0)} ms`);
  if (tps != null) parts.push(`${tps.toFixed(1)} tokens/s`);
  if (stopped) parts.push("stopped");
  else if (finish) parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

async function send() {
  const input = $("message");
  const text = input.value;
  if (!text.trim() || controller) return;
  history.push({role: "user", content: text});
  let body;
  try {
    body = buildRequest();
  } catch (e) {
    history.pop();
    notice(e.message);
    return;
  }
  input.value = "";
  following = true;
  const userEntry = entry("user", text);
  const reply = entry("assistant");
  const content = reply.querySelector(".content");
  const parts = new ReplyParts(content);
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.title = "measured in this browser: TTFT from sending to the first text, " +
               "tokens/s after the first token";
  reply.append(meta);
  reply.dataset.state = "streaming";
  reply.setAttribute("aria-busy", "true");

  controller = new AbortController();
  setStreaming(true);
  // Times are the browser's: the TTFT a user of this page sees, network included.
  const start = performance.now();
  let first = null, last = null, chunks = 0, usage = null, finish = null;
  let stopped = false, error = null;
  try {
    for await (const chunk of streamJSON("v1/chat/completions", body, controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const calls = delta.tool_calls || [];
        if (delta.reasoning_content) parts.addReasoning(delta.reasoning_content);
        if (delta.content) content.append(delta.content);
        for (const call of calls) parts.addToolCall(call);
        if (delta.reasoning_content || delta.content || calls.length) {
          const now = performance.now();
          if (first === null) first = now;
          last = now;
          chunks += 1;
          scrollDown();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else error = e;
  }
  controller = null;
  setStreaming(false);
  reply.removeAttribute("aria-busy");

  if (error && parts.empty()) {  // nothing came: the turn did not happen, the text goes back
    history.pop();
    userEntry.classList.add("failed");
    userEntry.title = "not sent";
    reply.remove();
    if (!input.value) input.value = text;
    notice(error.message);
    return;
  }
  history.push(parts.message());
  // Without the usage chunk (stopped), a chunk with text is about one token.
  const tokens = usage ? usage.completion_tokens : chunks;
  const tps = tokens > 1 && last > first ? (tokens - 1) / ((last - first) / 1000) : null;
  meta.textContent = describe({tokens, exact: !!usage, ttft: first === null ? null : first - start,
                               tps, finish, stopped});
  reply.dataset.tokens = String(tokens);
  reply.dataset.state = error ? "error" : stopped ? "stopped" : "done";
  if (error) notice(error.message);
}

export function stop() {
  if (controller) controller.abort();
}

function clear() {
  stop();
  history = [];
  $("log").replaceChildren();
}

let modelsNotice = null;  // the model list's last error, replaced by the next answer

export async function loadModels() {
  const select = $("model");
  let error = null;
  try {
    const {data} = await getJSON("v1/models");
    const current = select.value;
    select.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
    if (data.some((m) => m.id === current)) select.value = current;
  } catch (e) {
    error = e;
  }
  if (modelsNotice) modelsNotice.remove();
  modelsNotice = error ? notice(`Could not list the models: ${error.message}`) : null;
}

export function initPlayground() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("message").addEventListener("keydown", (event) => {
    // Enter sends, Shift+Enter is a new line (and Enter that ends an IME composition
    // is neither)
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    } else if (event.key === "Escape") {
      stop();
    }
  });
  $("log").addEventListener("scroll", () => {
    const log = $("log");
    following = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clear);
}
