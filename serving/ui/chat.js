// The chat: each answer streams from /v1/chat/completions with `stream_options.include_origins`, so every
// token arrives with its origin; Stop aborts the fetch (the server then cancels the generation); "Compare
// with ar" sends the last request again target-only and shows both answers side by side with the speedup.

import { KeyNeeded, streamChat } from "./api.js";
import { Figures } from "./figures.js";
import { ORIGINS, TokenView } from "./tokens.js";

const $ = (id) => document.getElementById(id);

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export class Chat {
  constructor(askKey) {
    this.askKey = askKey; // (message) => void: the page's key dialog
    this.history = []; // the conversation as sent: {role, content}
    this.controller = null; // AbortController of the answer streaming now
    this.last = null; // {body, view, final} of the latest finished answer
    this.figures = new Figures();
    this.legend({});
    this.figures.render();
    $("prompt-form").addEventListener("submit", (event) => { event.preventDefault(); this.send(); });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && this.controller) this.stop();
    });
    $("stop").addEventListener("click", () => this.stop());
    $("compare-button").addEventListener("click", () => this.compare());
    $("new-chat").addEventListener("click", () => this.clear());
  }

  settings() {
    const number = (id, fallback) => (Number.isFinite(parseFloat($(id).value)) ? parseFloat($(id).value) : fallback);
    return { mode: $("mode").value, gamma: Math.round(number("gamma", 4)), temperature: number("temperature", 0),
      maxTokens: Math.round(number("max-tokens", 128)), system: $("system").value.trim() };
  }

  request(messages, mode) {
    const s = this.settings();
    const body = { messages: s.system ? [{ role: "system", content: s.system }, ...messages] : messages,
      stream: true, stream_options: { include_usage: true, include_origins: true }, max_tokens: s.maxTokens,
      temperature: s.temperature, mode };
    if (mode !== "ar") body.num_assistant_tokens = s.gamma;
    return body;
  }

  async send() {
    const text = $("prompt").value.trim();
    if (!text || this.controller) return;
    $("empty-hint")?.remove();
    $("conversation").append(element("div", "message user", text));
    this.history.push({ role: "user", content: text });
    $("prompt").value = "";
    const message = element("div", "message assistant");
    const view = new TokenView(element("div"), "answer");
    const meta = element("div", "meta");
    message.append(view.element, meta);
    $("conversation").append(message);
    const body = this.request([...this.history], this.settings().mode);
    this.figures.start();
    const result = await this.run(body, view, (entries) => {
      this.figures.add(entries);
      this.figures.render();
      this.legend(view.counts());
    });
    this.figures.finish(result.final);
    if (!result.final) this.figures.stop();
    this.figures.render();
    meta.textContent = summary(body.mode, result, this.figures.values());
    $("mode-ran").textContent = ran(body.mode, result.final);
    if (result.error || !view.text()) {
      // a failed exchange, or one without text (stopped before its first token, or ended at once), is left out of
      // the conversation sent next: an empty assistant turn made every later answer empty
      this.history.pop();
      if (result.error) message.classList.add("failed");
      $("prompt").value = text; // sent again as it is, or edited
      if (result.error) return;
    } else {
      this.history.push({ role: "assistant", content: view.text() });
    }
    this.last = result.final ? { body, view, final: result.final } : null;
    $("compare-button").disabled = !this.last || body.mode === "ar";
  }

  // Stream one request into `view`; {final, stopped, error}. Never throws.
  async run(body, view, onTokens) {
    this.busy(true);
    this.controller = new AbortController();
    const result = { final: null, stopped: false, error: null };
    // a queue or a long prompt can hold the first token for seconds: the request is said to be alive meanwhile
    this.status("waiting for the first token (in the queue, or reading the prompt)…");
    let waiting = true;
    try {
      for await (const chunk of streamChat(body, this.controller.signal)) {
        const choice = chunk.choices?.[0];
        const content = choice?.delta?.content;
        if (content && waiting) {
          waiting = false;
          this.status("answering…");
        }
        const entries = chunk.mirror_rt?.tokens ?? (content ? [{ token: null, text: content, origin: null }] : null);
        if (entries) { // the end-of-sequence token comes with no text: counted all the same
          view.add(entries);
          onTokens(entries);
        }
        if (choice?.finish_reason) result.final = chunk;
      }
      this.status(result.final ? `done (${result.final.choices[0].finish_reason})` : "ended");
    } catch (error) {
      if (error.name === "AbortError") {
        result.stopped = true;
        this.status("stopped (the generation was cancelled on the server)");
      } else {
        result.error = error;
        this.status(error.message, true);
        if (error instanceof KeyNeeded) this.askKey(error.message);
      }
    } finally {
      this.controller = null;
      this.busy(false);
    }
    return result;
  }

  stop() {
    this.controller?.abort();
  }

  async compare() {
    if (!this.last || this.controller) return;
    const { body, view, final } = this.last;
    const left = new TokenView($("compare-left"), `${body.mode} answer`);
    left.element.replaceChildren();
    left.add(view.entries);
    $("compare-left-title").textContent = `${body.mode} (γ ${body.num_assistant_tokens})`;
    const right = new TokenView($("compare-right"), "ar answer");
    right.element.replaceChildren();
    $("compare").hidden = false;
    $("compare-summary").textContent = "running ar…";
    const arBody = { ...body, mode: "ar" };
    delete arBody.num_assistant_tokens;
    const result = await this.run(arBody, right, () => {});
    $("compare-summary").textContent = result.final ? comparison(body, final, result.final, left, right)
      : "ar did not finish";
    $("compare").scrollIntoView({ block: "nearest" });
  }

  clear() {
    if (this.controller) return;
    this.history = [];
    this.last = null;
    $("conversation").replaceChildren();
    $("compare").hidden = true;
    $("compare-button").disabled = true;
    this.figures.reset();
    this.figures.render();
    this.legend({});
    this.status("");
  }

  busy(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
    $("compare-button").disabled = on || !this.last || this.last.body.mode === "ar";
    $("new-chat").disabled = on;
  }

  status(text, error = false) {
    $("status").textContent = text;
    $("status").classList.toggle("error", error);
  }

  legend(counts) {
    const list = $("legend");
    list.replaceChildren();
    const shown = Object.keys(ORIGINS).filter((origin) => origin !== "forced" || counts.forced);
    for (const origin of shown) {
      const item = element("li");
      const sample = element("span", `t o-${origin} sample`, ORIGINS[origin].label);
      item.title = ORIGINS[origin].note;
      item.append(sample, element("span", "count", String(counts[origin] || 0)));
      list.append(item);
    }
  }
}

function summary(mode, result, values) {
  const parts = [mode, `${values.tokens} tokens`];
  if (values.rate != null) parts.push(`${values.rate.toFixed(1)} tokens/s`);
  const skipped = skippedSpeculation(mode, result.final);
  if (skipped) parts.push(skipped);
  if (result.stopped) parts.push("stopped");
  if (result.error) parts.push(`failed: ${result.error.message}`);
  return parts.join(" · ");
}

// What ran, in the server's words: whether the answer speculated and, for the steps that did not, why (the load
// policy decodes a step target-only when speculating would not pay, or while a prompt is read); null when every
// step speculated or ar was asked.
function skippedSpeculation(mode, final) {
  const figures = final?.mirror_rt;
  if (mode === "ar" || !figures?.steps) return null;
  return figures.why_target_only ?? null;
}

// The line under the Mode menu: what the latest answer ran, beside what it asked.
function ran(mode, final) {
  const figures = final?.mirror_rt;
  if (!figures?.steps) return "Ran: – (the answer did not finish)";
  if (mode === "ar") return "Ran: ar, target only, as asked";
  if (!figures.speculated) return `Ran: target-only, not ${mode}: ${figures.why_target_only}`;
  const all = figures.speculative_steps === figures.steps;
  return `Ran: ${mode} in ${figures.speculative_steps} of ${figures.steps} steps${all ? "" : ` (${
    figures.why_target_only.replace(/^speculated in \d+ of \d+ steps; /, "")})`}`;
}

function comparison(body, speculative, ar, left, right) {
  const fast = speculative.timings?.predicted_per_second;
  const slow = ar.timings?.predicted_per_second;
  const same = left.text() === right.text();
  const rate = (value) => (value != null ? value.toFixed(1) : "–"); // it showed 19.69 beside 19.3
  const parts = [`${body.mode} ${rate(fast)} tokens/s`, `ar ${rate(slow)} tokens/s`,
    fast && slow ? `speedup ${(fast / slow).toFixed(2)}×` : "speedup –",
    same ? "identical text ✓" : body.temperature > 0 ? "texts differ (sampled: each run draws its own)"
      : "texts differ"];
  const skipped = skippedSpeculation(body.mode, speculative);
  if (skipped && !speculative.mirror_rt.speculated) parts.unshift(`${skipped} (ar against ar)`);
  return parts.join(" · ");
}
