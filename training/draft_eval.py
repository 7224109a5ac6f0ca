"""How good and how costly a draft is: `mirror-rt eval-draft`.

On the target's own held-out greedy text, from every `stride`-th answer position the draft rolls out gamma greedy
tokens as the draft worker drafts (guesses fed and confirmed), ending at the window as vanilla SD does. Per window:
accepted (the rollout's longest prefix equal to the text), forwards and their time; drafts run side by side, pinned
to one core like the draft worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mirror_rt.runtime.acceptance import matched
from mirror_rt.runtime.affinity import available_cores
from mirror_rt.runtime.config import DEFAULTS, MAX_GAMMA
from mirror_rt.runtime.mirror.draft_row import confident_guesses
from mirror_rt.runtime.mirror.lookup import lookup_guesses, verify_guesses


@dataclass
class DraftRow:
    """Totals of one (draft, gamma) pair."""

    name: str
    gamma: int
    windows: int = 0
    reached: list[int] = field(init=False)  # [gamma] windows whose position i was drafted after i matches
    matched: list[int] = field(init=False)  # [gamma] of them, position i matched too
    accepted: int = 0  # sum of accepted tokens
    forwards: int = 0
    total_ms: float = 0.0  # wall time of all forwards

    def __post_init__(self):
        self.reached, self.matched = [0] * self.gamma, [0] * self.gamma

    def add(self, accepted: int, times: list[float]) -> None:
        self.windows += 1
        self.accepted += accepted
        for i in range(min(accepted + 1, self.gamma)):
            self.reached[i] += 1
            self.matched[i] += int(i < accepted)
        self.forwards += len(times)
        self.total_ms += 1000 * sum(times)

    def summary(self) -> dict:
        n = self.windows  # none: nothing measured (answers shorter than a window), so no figure but the count
        return {"draft": self.name, "gamma": self.gamma, "windows": self.windows,
                "acceptance_per_position": [round(m / r, 3) if r else None for m, r in zip(self.matched, self.reached)],
                "mean_accepted_length": round(1 + self.accepted / n, 3) if n else None,  # + the target's own token
                "forwards_per_window": round(self.forwards / n, 3) if n else None,
                "ms_per_forward": round(self.total_ms / self.forwards, 2) if self.forwards else None,
                "ms_per_window": round(self.total_ms / n, 2) if n else None}


def greedy_rollout(draft, cache, context: list[int], gamma: int, draft_lookup: int = 0, min_probability: float = 0.2,
                   oracle: list[int] | None = None):
    """`gamma` greedy draft tokens after `context` (the cache holds all but its last token) -> (tokens, forward
    seconds); the caller rolls the cache back. A forward feeds the newest token plus guesses useful inside the window
    (an SS draft's confident stream guesses, else up to `draft_lookup` prompt-lookup guesses) and keeps the confirmed
    ones. `oracle`: the text after `context`, which an SS draft then guesses instead of its streams."""
    streams = draft.capabilities.streams
    tokens, times = [], []
    guesses = lookup_guesses(context, min(draft_lookup, gamma - 1)) if draft_lookup else []
    while len(tokens) < gamma:
        feed = [context[-1] if not tokens else tokens[-1]] + guesses
        start = time.perf_counter()
        main, stream_rows = draft.forward_streams(feed, cache) if streams else (draft.forward(feed, cache), None)
        times.append(time.perf_counter() - start)
        n = verify_guesses(main, guesses)
        if n < len(guesses):
            cache.rollback(cache.length - (len(guesses) - n))
        tokens += guesses[:n] + [int(np.argmax(main[n]))]
        room = gamma - len(tokens) - 1  # the window's last token is never fed, so never guessed after
        guesses = []
        if room > 0 and streams:
            guesses = (oracle[len(tokens):len(tokens) + min(room, draft.n_streams)] if oracle is not None
                       else confident_guesses(stream_rows[n], min_probability)[:room])
        if room > 0 and draft_lookup and not guesses:
            guesses = lookup_guesses(context + tokens, min(draft_lookup, room))
    return tokens[:gamma], times


def evaluate_question(draft, ids: list[int], first_answer: int, rows: list[DraftRow], stride: int,
                      oracle: bool = False, draft_lookup: int = 0) -> None:
    """Windows starting at answer positions first_answer, first_answer + stride, ... (each gamma of `rows`)."""
    longest = max(r.gamma for r in rows)
    cache = draft.new_cache(len(ids) + longest + 2)
    for start in range(first_answer, len(ids) - longest + 1, stride):
        if start - 1 > cache.length:
            draft.forward(ids[cache.length:start - 1], cache)  # the text before the window's last committed token
        for row in rows:
            text = ids[start:start + row.gamma]
            tokens, times = greedy_rollout(draft, cache, ids[:start], row.gamma, draft_lookup,
                                           oracle=text if oracle else None)
            cache.rollback(start - 1)
            row.add(matched(tokens[:len(text)], text), times)  # greedy acceptance


def evaluate_drafts(drafts: dict, sequences: list[tuple[list[int], int]], gammas=(4, 7), stride: int = 8,
                    progress: bool = True, oracle: frozenset = frozenset(), draft_lookup: int = 0) -> list[dict]:
    """Rows (see DraftRow.summary) for every draft (by name) and gamma; `rollout_vs_first` compares each
    row's time per window with the first draft's at the same gamma. Drafts named in `oracle` guess the text."""
    from tqdm import tqdm

    rows = {name: [DraftRow(name, g) for g in gammas] for name in drafts}
    for ids, first in tqdm(sequences, desc="eval-draft", unit="question", disable=not progress):
        for name, draft in drafts.items():
            evaluate_question(draft, ids, first, rows[name], stride, name in oracle, draft_lookup)
    out = [row.summary() for name in drafts for row in rows[name]]
    first_name = next(iter(drafts))
    reference = {r["gamma"]: r["ms_per_window"] for r in out if r["draft"] == first_name}
    for r in out:
        base = reference[r["gamma"]]
        r["rollout_vs_first"] = round(r["ms_per_window"] / base, 3) if base and r["ms_per_window"] else None
    return out


def format_rows(rows: list[dict]) -> str:
    """A markdown table of `evaluate_drafts` rows."""
    head = ("| draft | gamma | windows | acceptance per position | mean accepted length | forwards per window "
            "| ms per forward | ms per window | rollout vs first |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        acceptance = " ".join(_shown(a, ".2f") for a in r["acceptance_per_position"])
        lines.append(f"| {r['draft']} | {r['gamma']} | {r['windows']} | {acceptance} "
                     f"| {_shown(r['mean_accepted_length'], '.2f')} | {_shown(r['forwards_per_window'], '.2f')} "
                     f"| {_shown(r['ms_per_forward'], '')} | {_shown(r['ms_per_window'], '.1f')} "
                     f"| {_shown(r['rollout_vs_first'], '.2f')}x |")
    return "\n".join(lines)


def _shown(value, spec: str) -> str:
    """A figure, or "-" where there was nothing to measure (no window of that length)."""
    return "-" if value is None else format(value, spec)


def eval_draft_main(bundles: list[str], target: str | None = None, data=None, gammas=(4, 7), questions: int = 24,
                    stride: int = 8, cache: str | None = None, progress: bool = True,
                    oracle_streams: bool = False, draft_lookup: int = DEFAULTS.draft_lookup) -> list[dict]:
    """CLI entry (`mirror-rt eval-draft`): each bundle's draft on the held-out target answers, side by side;
    `oracle_streams`: also each SS draft with the text as its stream guesses; `draft_lookup`: as `--draft-lookup`."""
    from pathlib import Path

    from mirror_rt.devices.bundles import WorkerBudget, load_model
    from mirror_rt.evaluation.specbench import question_files
    from mirror_rt.exporters.manifest import read_manifest
    from mirror_rt.models.default_model import cache_dir
    from mirror_rt.models.loading import load_checkpoint
    from mirror_rt.training.exit_data import answer_sequences

    bad = [g for g in gammas if not 1 <= g <= MAX_GAMMA]
    if bad:
        raise ValueError(f"--gamma must be in 1..{MAX_GAMMA}, got {bad[0]}")
    files = question_files(data, "eval-draft")  # inputs are checked before any model loads
    checkpoint = load_checkpoint(target, cache=cache, log=lambda *a: None)
    vocab = checkpoint.model.config.vocab_size
    manifests = {folder: read_manifest(Path(folder)) for folder in bundles}  # bad paths and corrupt files fail first
    for folder, manifest in manifests.items():
        if manifest.draft_config["vocab_size"] != vocab:
            raise ValueError(f"{folder}: the draft has {manifest.draft_config['vocab_size']} tokens, "
                             f"the target {vocab}")
    held_out = answer_sequences(checkpoint.model, checkpoint.tokenizer, files, cache_dir(cache) / "exit-data",
                                progress=progress, held_out=questions)  # on every core, before the pinning below
    cores = sorted(available_cores())
    budget = WorkerBudget(threads=1, cpus=(cores[-1],) if cores else None)  # the draft worker's share
    drafts, oracle = {}, set()
    for folder, manifest in manifests.items():
        draft = load_model(Path(folder), manifest, "draft", "cpu", budget=budget)
        streams = draft.capabilities.streams
        drafts[folder + (" (streams)" if streams else "")] = draft
        if streams and oracle_streams:
            oracle.add(folder + " (oracle streams)")
            drafts[folder + " (oracle streams)"] = draft
    return evaluate_drafts(drafts, held_out, gammas, stride, progress, frozenset(oracle), draft_lookup)
