// Calls to the server's API with the key from the page's field, and its errors as text.
// Paths are relative, so the page also works behind a proxy that adds a path prefix.

const keyField = () => document.getElementById("api-key");

export class ApiError extends Error {}

function headers(json) {
  const h = {};
  const key = keyField().value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

// The server's own message for a failed response ({"error": {"message": ...}}).
async function errorOf(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: keep the status text */ }
  return new ApiError(`${response.status}: ${message}`);
}

export async function getJSON(path) {
  const response = await fetch(path, {headers: headers(false), cache: "no-store"});
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// POST `body` and yield each server-sent event's parsed data until [DONE]. Aborting
// `signal` closes the connection, which the server takes as the end of the request.
export async function* streamJSON(path, body, signal) {
  const response = await fetch(path, {method: "POST", headers: headers(true),
                                      body: JSON.stringify(body), signal});
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += value;
      // events end with a blank line; the last piece may be incomplete
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          const parsed = JSON.parse(data);
          // a stream that fails after its status line ends with an error event
          if (parsed.error) throw new ApiError(`${parsed.error.code}: ${parsed.error.message}`);
          yield parsed;
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});  // a consumer that stops early closes the stream
  }
}
