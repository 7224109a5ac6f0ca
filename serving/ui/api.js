// The page's only way to the server: the same endpoints as any client, the API key (if any) from local
// storage on every call. A 401 raises KeyNeeded so the page can ask for the key.

const KEY = "mirror-rt.api-key";

export class KeyNeeded extends Error {}

export function storedKey() {
  return localStorage.getItem(KEY) || "";
}

export function saveKey(key) {
  if (key) localStorage.setItem(KEY, key);
  else localStorage.removeItem(KEY);
}

function headers(extra = {}) {
  const key = storedKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function failure(response) {
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    message = body?.error?.message || message;
  } catch {
    // not JSON: keep the status line
  }
  return response.status === 401 ? new KeyNeeded(message) : new Error(message);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// Yield the chunks of a streamed chat completion (SSE), until [DONE]; an error event throws.
export async function* streamChat(body, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        yield chunk;
      }
    }
  }
}
