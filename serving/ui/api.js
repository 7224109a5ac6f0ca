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

// fetch, with a network failure (TypeError: "Failed to fetch", "network error") said as what it is.
async function reach(path, options, what) {
  try {
    return await fetch(path, options);
  } catch (error) {
    if (error instanceof TypeError) throw new Error(what);
    throw error;
  }
}

// The JSON of a GET and the replica that answered it (behind `serve --replicas`; null from a single server).
export async function getAnswer(path) {
  const response = await reach(path, { headers: headers(), cache: "no-store" }, "the server cannot be reached");
  if (!response.ok) throw await failure(response);
  return { data: await response.json(), replica: response.headers.get("x-mirror-rt-replica") };
}

export async function getJSON(path) {
  return (await getAnswer(path)).data;
}

const LOST = "the connection to the server was lost";

// Yield the chunks of a streamed chat completion (SSE), until [DONE]; an error event throws, and so does a stream
// that breaks or ends before [DONE] (the server died or the network went).
export async function* streamChat(body, signal) {
  const response = await reach("/v1/chat/completions", {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal,
  }, LOST);
  if (!response.ok) throw await failure(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let part;
    try {
      part = await reader.read();
    } catch (error) {
      if (error instanceof TypeError) throw new Error(`${LOST} before the answer ended`);
      throw error;
    }
    const { value, done } = part;
    if (done) throw new Error(`${LOST} before the answer ended`);
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
