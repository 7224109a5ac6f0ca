"""The Mirror draft's token-rules hooks, over one draft line (`draft_worker.Line`: tokens, q, rows, rules).

A line's rules stand at its context plus its tokens. `extend_forced` drafts the next token the grammar
forces without a forward (a free draft, q = a point mass under sampling); `confirm_greedy` turns a
forward's rows into the draft's greedy tokens while they confirm guesses (prompt lookup, SS streams),
each row processed at the state its guesses reached; `rules_at` gives a side branch's rules. They
know nothing about threads, caches or the target. Invariant: a line's tokens are a function of its
context (forced tokens are taken one at a time), so a seeded request never depends on timing.
"""

from __future__ import annotations

from mirror_rt.runtime.sampling import greedy_ids, point_mass


def extend_forced(line, greedy: bool, vocab_size: int) -> bool:
    """Append the next token the grammar forces (one: the forced tokens after a state depend on that state
    alone, never on where a drafting run started); False when none is forced."""
    forced = line.rules.forced()[:1]
    for token in forced:
        line.rules.accept(token)
        q = None if greedy else point_mass(token, vocab_size)
        line.append(token, q, q)
    return bool(forced)


def confirm_greedy(line, rows, guesses: list[int]) -> int:
    """Append the draft's greedy token of each row [len(guesses) + 1, vocab] (row i follows guess i-1) while
    it confirms the guess before it; returns the guesses confirmed."""
    if line.rules is None:
        choices = greedy_ids(rows)  # one read for every row
        n = 0
        while n < len(guesses) and choices[n] == guesses[n]:
            n += 1
        for token, row in zip(choices[:n + 1], rows):
            line.append(token, None, row)
        return n
    for i, raw in enumerate(rows):  # under rules a row's mask depends on the guesses before it
        row = line.rules.apply(raw)
        token = greedy_ids(row)[0]
        line.rules.accept(token)
        line.append(token, None, row)
        if i == len(guesses) or token != guesses[i]:
            return i
    return len(guesses)


def rules_at(line, depth: int, root: int):
    """The rules after the line's context + its first `depth` tokens + `root` (a side branch's start):
    None without rules, False when the grammar forbids the root (the target can never correct to it)."""
    if line.rules is None:
        return None
    rules = line.rules.fork()
    rules.rollback(len(line.tokens) - depth)
    return rules if rules.accept(root) else False
