// The server page: requests running and waiting, totals, and the recent requests, polled from GET /server
// (the server's own metrics: its gauges, counters and the last finished requests) while the tab is shown;
// behind replicas, the replica that answered (x-mirror-rt-replica) labels them.

import { KeyNeeded, getAnswer } from "./api.js";
import { termList } from "./figures.js";

const $ = (id) => document.getElementById(id);
const EVERY_MS = 1000;

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text ?? "–";
  if (className) td.className = className;
  return td;
}

function ago(seconds) {
  if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${Math.round(seconds / 3600)} h ago`;
}

export class ServerView {
  constructor(askKey) {
    this.askKey = askKey;
    this.timer = null;
  }

  show(on) {
    clearTimeout(this.timer);
    this.timer = null;
    if (on) this.poll();
  }

  async poll() {
    try {
      const { data, replica } = await getAnswer("/server");
      this.render(data);
      this.replica(replica);
      $("srv-status").textContent = `updated ${new Date().toLocaleTimeString()}`;
      $("srv-status").classList.remove("error");
    } catch (error) {
      $("srv-status").textContent = error.message;
      $("srv-status").classList.add("error");
      if (error instanceof KeyNeeded) {
        this.askKey(error.message);
        return; // polling starts again once a key is saved
      }
    }
    if (!$("server").hidden && !document.hidden) this.timer = setTimeout(() => this.poll(), EVERY_MS);
  }

  render(data) {
    $("srv-running").textContent = data.running ?? "–";
    $("srv-waiting").textContent = data.waiting ?? "–";
    $("srv-queue").textContent = data.max_queued != null ? `(of ${data.max_queued})` : "";
    const roles = data.roles || {};
    const role = (name) => (roles[name]?.device ? `${name} on ${roles[name].device} (${roles[name].precision})` : "");
    $("srv-engine").textContent = [data.model, data.status, data.path, role("target"), role("draft"),
      data.mode ? `default mode ${data.mode}, γ ${data.gamma}` : ""].filter(Boolean).join(" · ");
    this.totals(data);
    const body = $("srv-recent").querySelector("tbody");
    body.replaceChildren();
    const now = Date.now() / 1000;
    for (const r of data.recent || []) {
      const row = document.createElement("tr");
      row.append(cell(ago(now - r.ended_at)), cell(r.id.slice(0, 18), "id"), cell(r.mode), cell(r.finish_reason),
        cell(`${r.prompt_tokens} → ${r.completion_tokens}`), cell(duration(r.ttft_ms)),
        cell(r.tokens_per_s != null ? r.tokens_per_s.toFixed(1) : null),
        cell(r.mean_accepted_length ? r.mean_accepted_length.toFixed(2) : null), // 0: no verification ran
        cell(r.acceptance != null ? `${Math.round(100 * r.acceptance)}%` : null),
        cell(r.steps ? `${r.speculative_steps} of ${r.steps}` : null));
      row.cells[1].title = r.id;
      if (r.why_target_only) row.cells[9].title = r.why_target_only;
      body.append(row);
    }
  }

  // Behind `serve --replicas` each poll may reach another replica: the figures say whose they are.
  replica(name) {
    $("srv-replica").hidden = !name;
    $("srv-replica").textContent = name ? `figures of replica ${name} (each update may come from another)` : "";
  }

  totals(data) {
    const requests = data.requests || {};
    const kv = data.kv_cache || {};
    const rows = [["finished", (requests.stop || 0) + (requests.length || 0)], ["aborted", requests.abort || 0],
      ["errors", requests.error || 0], ["tokens generated", data.generation_tokens ?? 0],
      ["draft acceptance", data.draft_tokens ? `${Math.round(100 * data.accepted_tokens / data.draft_tokens)}%`
        : "–", "Draft tokens the target accepted, of those it verified, over every request"],
      ["KV in use", kv.budget_bytes ? `${Math.round(100 * kv.usage)}% of ${size(kv.budget_bytes)}` : "–",
        "Of the KV budget (--kv-cache-gb): blocks the running requests reserve plus the prefix cache's"],
      ["prefix cache", kv.budget_bytes ? size(kv.prefix_cache_bytes) : "–",
        "Finished prompts' KV kept for later requests that share them (at most --prefix-cache-share of the budget)"]];
    termList($("srv-totals"), rows);
  }
}

// Bytes as people read them: "4.00 GB", "21.0 MB".
function size(bytes) {
  return bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(2)} GB` : `${(bytes / 2 ** 20).toFixed(1)} MB`;
}

// A time in ms as people read it: "412 ms", "27.5 s" (it showed "27547.5 ms").
function duration(ms) {
  if (ms == null) return null;
  return ms < 10000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(1)} s`;
}
