// Live figures of one answer: counted from the streamed token entries while it runs, then the server's own
// (the last chunk's `timings` and `mirror_rt`) once it ends. TTFT is the page's: request sent to first token.

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

function fixed(value, digits, unit = "") {
  return value == null || Number.isNaN(value) ? "–" : `${Number(value).toFixed(digits)}${unit}`;
}

function percent(value) {
  return value == null ? "–" : `${Math.round(100 * value)}%`;
}

export class Figures {
  constructor() {
    this.reset();
  }

  reset() {
    this.sent = performance.now();
    this.first = this.last = null;
    this.tokens = 0;
    this.windows = new Map(); // window index -> {drafted, accepted, tokens}
    this.final = null;
    this.running = false;
  }

  start() {
    this.reset();
    this.running = true;
    this.render();
  }

  add(entries, at = performance.now()) {
    for (const entry of entries) {
      if (entry.token == null) continue;
      this.tokens += 1;
      this.first ??= at;
      this.last = at;
      if (!entry.window) continue; // the prompt's first token belongs to no verification
      const window = this.windows.get(entry.window) || { drafted: entry.drafted || 0, accepted: 0, tokens: 0 };
      window.tokens += 1;
      window.accepted += entry.origin === "draft";
      this.windows.set(entry.window, window);
    }
  }

  finish(chunk) {
    this.final = chunk;
    this.running = false;
  }

  stop() {
    this.running = false;
  }

  live() {
    let committed = 0;
    const proposed = [];
    const accepted = [];
    for (const window of this.windows.values()) {
      committed += window.tokens;
      for (let j = 0; j < window.drafted; j += 1) {
        proposed[j] = (proposed[j] || 0) + 1;
        accepted[j] = (accepted[j] || 0) + (j < window.accepted);
      }
    }
    const seconds = this.last > this.first ? (this.last - this.first) / 1000 : 0;
    return {
      rate: this.tokens > 1 && seconds ? (this.tokens - 1) / seconds : null,
      meanAccepted: this.windows.size ? committed / this.windows.size : null,
      perPosition: proposed.map((count, j) => (count ? accepted[j] / count : 0)),
    };
  }

  values() {
    const live = this.live();
    const ttft = this.first != null ? this.first - this.sent : null;
    const server = this.final?.mirror_rt;
    if (!server) return { ...live, ttft, tokens: this.tokens, hidden: null, reuse: null };
    return { // the server's count, the end-of-sequence token included (its entry streams no text; the legend counts it)
      rate: this.final.timings?.predicted_per_second ?? live.rate, ttft,
      tokens: this.final.timings?.predicted_n ?? this.tokens,
      meanAccepted: server.mean_accepted_length || null, perPosition: server.acceptance_per_position || [],
      hidden: server.hidden_draft_share, reuse: server.reuse_hit_rate,
    };
  }

  render() {
    const v = this.values();
    $("fig-rate").textContent = fixed(v.rate, 1);
    $("fig-ttft").textContent = fixed(v.ttft, 0, " ms");
    $("fig-tokens").textContent = v.tokens ? String(v.tokens) : "–";
    $("fig-mal").textContent = fixed(v.meanAccepted, 2);
    $("fig-hidden").textContent = percent(v.hidden);
    $("fig-reuse").textContent = percent(v.reuse);
    $("figures-state").textContent = this.running ? "(live)" : this.final ? "(from the server)" : "";
    chart($("fig-chart"), v.perPosition);
    if (this.final?.mirror_rt) devices(this.final.mirror_rt);
  }
}

// A bar per draft position: the share of windows with a token there whose token was accepted.
export function chart(element, rates) {
  if (!rates.length) { // a blank box said nothing: say why it is empty
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = "No draft windows yet: after a speculative answer, one bar per position shows the share "
      + "of its draft tokens the target accepted (ar answers and target-only steps draft none).";
    element.replaceChildren(empty);
    return;
  }
  const svg = document.createElementNS(SVG, "svg");
  const width = Math.max(1, rates.length) * 34;
  svg.setAttribute("viewBox", `0 0 ${width} 96`);
  svg.setAttribute("role", "img");
  const said = rates.map((rate, j) => `position ${j + 1}: ${Math.round(100 * rate)}%`).join(", ");
  svg.setAttribute("aria-label", `acceptance per window position: ${said}`);
  rates.forEach((rate, j) => {
    const x = j * 34 + 5;
    const height = Math.round(64 * rate);
    svg.append(shape("rect", { x, y: 16, width: 24, height: 64, class: "bar-back" }));
    svg.append(shape("rect", { x, y: 80 - height, width: 24, height, class: "bar-fill" }));
    svg.append(shape("text", { x: x + 12, y: 12, "text-anchor": "middle" }, `${Math.round(100 * rate)}%`));
    svg.append(shape("text", { x: x + 12, y: 93, "text-anchor": "middle" }, String(j + 1)));
  });
  element.replaceChildren(svg);
}

function shape(name, attributes, text) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

// Devices and precision of each role: from /server at start, from each answer's `mirror_rt` after.
export function devices(info) {
  const rows = [];
  for (const role of ["target", "draft"]) {
    const device = info.devices?.[role] ?? info.roles?.[role]?.device;
    const precision = info.precision?.[role] ?? info.roles?.[role]?.precision;
    rows.push([role, device ? `${device}${precision ? ` · ${precision}` : ""}` : "– (not used)"]);
  }
  if (info.path) rows.push(["path", info.path]);
  termList($("fig-devices"), rows);
}

/** Fill a <dl> with [term, detail, explanation?] rows (the explanation: the term's tooltip). */
export function termList(list, rows) {
  list.replaceChildren();
  for (const [name, value, explanation] of rows) {
    const term = document.createElement("dt");
    const detail = document.createElement("dd");
    term.textContent = name;
    if (explanation) term.title = explanation;
    detail.textContent = value;
    list.append(term, detail);
  }
}
