// An answer as spans, one per token that released text (and a mark for the end-of-sequence token, which usage
// counts), coloured by origin (page.css: colour plus a line or
// weight each). Hover or keyboard focus shows the token's window and position in a tooltip; inside an answer
// the arrow keys (and Home / End) move from token to token. Unknown origins render as plain text.

export const ORIGINS = {
  draft: { label: "draft, accepted", note: "proposed by the draft, accepted by the target" },
  correction: { label: "correction", note: "the target's token where it rejected the draft" },
  bonus: { label: "bonus", note: "the target's extra token after a fully accepted window" },
  target: { label: "target", note: "the target's own token (ar, or the first token)" },
  forced: { label: "forced", note: "forced by the output's grammar" },
};

const views = new WeakMap(); // answer element -> TokenView

export class TokenView {
  constructor(element, label = "answer") {
    this.element = element;
    this.entries = [];
    element.classList.add("tokens");
    element.tabIndex = 0;
    element.setAttribute("aria-label", `${label}: arrow keys move from token to token`);
    views.set(element, this);
  }

  add(entries) {
    const fragment = document.createDocumentFragment();
    for (const entry of entries) {
      const index = this.entries.push(entry) - 1;
      if (!entry.text && !entry.end) continue; // text held back: a later token's span carries it
      if (!ORIGINS[entry.origin]) {
        fragment.append(entry.text);
        continue;
      }
      const span = document.createElement("span");
      span.className = `t o-${entry.origin}${entry.end ? " end" : ""}`; // the end-of-sequence token: a mark
      span.textContent = entry.text;
      span.dataset.i = index;
      span.tabIndex = -1;
      fragment.append(span);
    }
    this.element.append(fragment);
  }

  text() {
    return this.entries.map((entry) => entry.text).join("");
  }

  counts() {
    const counts = {};
    for (const entry of this.entries) {
      if (entry.token != null && entry.origin) counts[entry.origin] = (counts[entry.origin] || 0) + 1;
    }
    return counts;
  }
}

export function describe(entry) {
  const origin = ORIGINS[entry.origin];
  const parts = entry.end ? ["end of sequence (counted, no text)"] : [];
  parts.push(origin ? origin.label : entry.origin);
  parts.push(entry.window === 0 ? "the first token (prefill)" : `window ${entry.window}`);
  parts.push(`position ${entry.position + 1}`);
  if (entry.drafted) parts.push(`${entry.drafted} drafted`);
  if (entry.prob != null) parts.push(`p = ${Number(entry.prob).toFixed(3)}`);
  parts.push(`token id ${entry.token}`);
  return parts.join(" · ");
}

// One tooltip element for every answer on the page, driven by event delegation.
export function installTips(tip) {
  const entryOf = (span) => views.get(span.closest(".tokens"))?.entries[Number(span.dataset.i)];
  const show = (span) => {
    const entry = entryOf(span);
    if (!entry) return;
    tip.textContent = describe(entry);
    tip.hidden = false;
    const rect = span.getBoundingClientRect();
    const width = tip.offsetWidth;
    const height = tip.offsetHeight;
    tip.style.left = `${Math.max(4, Math.min(rect.left, window.innerWidth - width - 4))}px`;
    const below = rect.bottom + 6;
    tip.style.top = `${below + height > window.innerHeight ? rect.top - height - 6 : below}px`;
  };
  const hide = () => { tip.hidden = true; };
  document.addEventListener("mouseover", (event) => {
    const span = event.target.closest?.(".t");
    if (span) show(span);
  });
  document.addEventListener("mouseout", (event) => {
    if (event.target.closest?.(".t") && document.activeElement !== event.target) hide();
  });
  document.addEventListener("focusin", (event) => {
    if (event.target.classList?.contains("t")) show(event.target);
    else hide();
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") hide();
    const answer = event.target.closest?.(".tokens");
    if (answer) move(answer, event);
  });
}

function move(answer, event) {
  const spans = [...answer.querySelectorAll(".t")];
  if (!spans.length) return;
  const at = spans.indexOf(document.activeElement);
  const next = { ArrowRight: at + 1, ArrowDown: at + 1, ArrowLeft: at - 1, ArrowUp: at - 1, Home: 0,
    End: spans.length - 1 }[event.key];
  if (next === undefined) return;
  event.preventDefault();
  spans[Math.max(0, Math.min(spans.length - 1, at < 0 && next < 0 ? 0 : next))].focus();
}
