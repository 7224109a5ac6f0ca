"""Mirror-SD through the batched decoder: lossless (greedy equality, sampled distribution), reuse, faults, stats."""

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import MarkovModel, decode, decode_many, flat, perturbed_copy, random_transition, tiny_target
from test_acceptance import chi2_threshold

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.devices.torch.split import TorchSplitTarget
from mirror_rt.runtime.batch.decoder import BatchConfig, BatchDecoder
from mirror_rt.runtime.batch.sequence import Sequence
from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.metrics import format_stats
from mirror_rt.runtime.mirror.draft_row import DraftConfig
from mirror_rt.runtime.reference import generate
from mirror_rt.runtime.sampling import SamplingConfig


def draft_threads() -> list:
    """Live Mirror draft workers (other libraries' background threads do not count)."""
    return [t for t in threading.enumerate() if t.name == "mirror-draft" and t.is_alive()]


def run_mirror(target, draft, prompt, max_new, stream_confidence=0.2, **options):
    """Mirror over `options` (GenerationConfig fields) through the batched decoder, alone in its batch;
    `stream_confidence` is the draft rows' own knob. Returns (tokens, stats)."""
    got = decode(target, draft, prompt, mode="mirror", max_new_tokens=max_new,
                 draft_config=DraftConfig(stream_confidence=stream_confidence), **options)
    return got.tokens, got.stats


@pytest.mark.parametrize("gamma,kappa,budget", [(1, 1, 0), (3, 4, None), (4, 8, 0), (5, 1, 2), (7, 8, None)])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_reference(seed, gamma, kappa, budget):
    """Output identical to target-only greedy; stats add up (generated = 1 + sum of accepted + 1)."""
    target = tiny_target(seed=seed)
    draft = perturbed_copy(target, noise=0.4, seed=seed + 100)
    prompt = [(seed * 7 + i * 13) % 95 + 2 for i in range(5 + seed)]
    expected = flat(generate(TorchModel(target), prompt, 48))
    got, stats = run_mirror(TorchSplitTarget(target, kappa=kappa), TorchModel(draft), prompt, 48,
                            gamma=gamma, branch_budget=budget)
    assert got == expected
    assert 1 + sum(stats["accept_lengths"]) == len(got)
    assert not draft_threads()  # the draft thread is gone


@pytest.mark.parametrize("max_num_seqs", [2, 4])
def test_a_batch_of_mirror_sequences_equals_reference(max_num_seqs):
    """Six prompts joining at different steps, their windows drafted by one worker: each text equals its own ar."""
    target = tiny_target(seed=4)
    draft = perturbed_copy(target, noise=0.4, seed=104)
    prompts = [[(i * 13 + j * 5) % 95 + 2 for j in range(2 + 3 * i)] for i in range(6)]
    got = decode_many(TorchSplitTarget(target), TorchModel(draft), prompts, max_num_seqs, arrivals=[0, 0, 1, 3, 3, 9],
                      mode="mirror", max_new_tokens=36, gamma=3)
    assert [g.tokens for g in got] == [flat(generate(TorchModel(target), p, 36)) for p in prompts]
    assert all(g.stats["reuse_checks"] > 0 for g in got)  # every one speculated with the worker


class SlowSuffix(TorchSplitTarget):
    """A target whose suffix takes long enough for every rollout to finish (a big target)."""

    def forward_suffix(self, cache):
        time.sleep(0.03)
        return super().forward_suffix(cache)


def test_oracle_draft_full_reuse():
    """Draft == target: every window fully accepted and every next window precomputed."""
    target = tiny_target(seed=1)
    got, stats = run_mirror(SlowSuffix(target), TorchModel(target), [3, 4, 5], 40, gamma=3, branch_budget=0)
    assert got == flat(generate(TorchModel(target), [3, 4, 5], 40))
    assert stats["reuse_hit_rate"] == 1.0 and stats["misses"] == 0
    assert set(stats["acceptance_per_position"]) == {1.0}  # every window fully accepted
    # no window was corrected, so there is no coverage to show
    text = format_stats(stats | {"mode": "mirror", "stop_reason": "max_new_tokens"})
    assert "early-exit coverage - (no corrections)" in text and "None" not in text  # it printed "coverage None"


def test_side_branches_are_hit():
    """With a noisy draft and time to spare, precomputed corrections are reused sometimes."""
    target = tiny_target(seed=2)
    draft = perturbed_copy(target, noise=0.5, seed=7)
    got, stats = run_mirror(SlowSuffix(target, kappa=8), TorchModel(draft), [5, 6], 60, gamma=3)
    assert got == flat(generate(TorchModel(target), [5, 6], 60))
    assert stats["side_branch_hits"] > 0 and stats["side_branches_rolled"] > 0


@pytest.mark.parametrize("rule", ["rejection", "exact-seed"])
def test_sampling_reproduces_target_markov_chain(rule):
    """Sampled Mirror output is a Markov chain with the target's transitions, not the draft's, under either rule.

    One 6000-token generation over a 4-token vocabulary; per row a chi-square test at the
    1 - 1e-6 quantile (3 degrees of freedom), so a correct implementation fails with
    probability < 4e-6 (4 rows); the seed is fixed, so the test is deterministic. The draft's
    chain differs enough that the same test rejects it (checked below).
    """
    p, q = random_transition(4, seed=1), random_transition(4, seed=2)
    tokens, stats = run_mirror(MarkovModel(p), MarkovModel(q), [0], 6000, gamma=3,
                               sampling=SamplingConfig(temperature=1.0), seed=5, sampling_verify=rule)
    assert len(tokens) == 6000 and stats["reuse_hit_rate"] > 0
    seq = [0] + tokens
    counts = np.zeros((4, 4))
    for a, b in zip(seq, seq[1:]):
        counts[a, b] += 1
    for row in range(4):
        expected = p[row] * counts[row].sum()
        assert ((counts[row] - expected) ** 2 / expected).sum() < chi2_threshold(3)
    draft_fit = sum(((counts[r] - q[r] * counts[r].sum()) ** 2 / (q[r] * counts[r].sum())).sum() for r in range(4))
    assert draft_fit > 10 * chi2_threshold(3)


# --- faults --------------------------------------------------------------------------------

class FaultyDraft(TorchModel):
    """A draft that misbehaves after `after` forwards: raise, hang, or emit bad tokens."""

    def __init__(self, model, kind: str, after: int = 6):
        super().__init__(model)
        self.kind, self.after, self.calls = kind, after, 0

    def forward(self, tokens, cache):
        return self._misbehave(super().forward(tokens, cache))

    def forward_rows(self, tokens, pool, first, last_rows=None):
        """Rows of a pool (the batched decoder's draft calls: runtime.mirror.draft_batch), misbehaving alike."""
        return self._misbehave(super().forward_rows(tokens, pool, first, last_rows))

    def _misbehave(self, logits):
        self.calls += 1
        if self.calls > self.after:
            if self.kind == "raise":
                raise RuntimeError("injected draft failure")
            if self.kind == "hang":
                time.sleep(1.5)
            if self.kind == "out_of_vocab":
                logits = np.concatenate([logits, np.full((*logits.shape[:-1], 5), 1e9)], axis=-1)
        return logits


@pytest.mark.parametrize("kind", ["raise", "hang", "out_of_vocab"])
def test_draft_fault_falls_back_without_losing_tokens(kind):
    target = tiny_target(seed=3)
    draft = FaultyDraft(perturbed_copy(target, noise=0.3, seed=4), kind)
    expected = flat(generate(TorchModel(target), [7, 8, 9], 40))
    got, stats = run_mirror(TorchSplitTarget(target), draft, [7, 8, 9], 40, gamma=3, draft_timeout_s=0.5)
    assert got == expected
    assert any("fallback to target-only" in e for e in stats["events"])
    assert stats["fallback_steps"] > 0
    deadline = time.time() + 5
    while draft_threads() and time.time() < deadline:
        time.sleep(0.05)
    assert not draft_threads()  # no leaked thread, even after a hang


def test_wrong_length_window_refused(monkeypatch):
    """A window longer than gamma is refused as malformed; output still exact."""
    from mirror_rt.runtime.mirror import draft_row

    original = draft_row.DraftRow.send_window

    def too_long(self, reused):
        self.config = replace(self.config, gamma=self.config.gamma + 3, min_window=self.config.gamma + 3)
        original(self, reused)

    monkeypatch.setattr(draft_row.DraftRow, "send_window", too_long)
    target = tiny_target(seed=6)
    got, stats = run_mirror(TorchSplitTarget(target), TorchModel(target), [2, 3], 30, gamma=2)
    assert got == flat(generate(TorchModel(target), [2, 3], 30))
    assert any("expected 1..2" in e for e in stats["events"])


def test_cancel_early_stops_the_draft():
    """A sequence cancelled mid-way (Ctrl-C, a stop string) leaves the batch, and the draft thread with nobody to
    draft for ends at that step."""
    target = tiny_target(seed=0)
    decoder = BatchDecoder(TorchSplitTarget(target), TorchModel(target), BatchConfig(max_num_seqs=1))
    seq = Sequence("s", [2, 3], GenerationConfig(max_new_tokens=200, gamma=3, mode="mirror"), budget=200)
    decoder.add(seq)
    while len(seq.tokens) < 8:
        decoder.step()
    assert draft_threads()
    seq.cancel()
    assert not decoder.step()
    assert seq.finish_reason == "cancelled" and not draft_threads()


@pytest.mark.parametrize("gamma,confidence", [(2, 0.0), (5, 0.0), (5, 0.2)])
def test_stream_draft_equals_reference(gamma, confidence):
    """An SS draft (random streams: many rejected guesses; all fed, or only confident ones) changes nothing."""
    import torch

    from mirror_rt.devices.torch.backend import TorchStreamDraft
    from mirror_rt.models.ss_draft import StreamDraft

    target = tiny_target(seed=8)
    draft = StreamDraft(perturbed_copy(target, noise=0.2, seed=9), n_streams=2, n_stream_layers=2, rank=4)
    with torch.no_grad():
        for p in draft.stream_layers.parameters():
            p.normal_(0, 0.3)
    got, stats = run_mirror(TorchSplitTarget(target), TorchStreamDraft(draft), [4, 5, 6], 60, gamma=gamma,
                            stream_confidence=confidence)
    assert got == flat(generate(TorchModel(target), [4, 5, 6], 60))
    assert stats["draft_forwards_per_token"] > 0


@pytest.mark.parametrize("early_exit", ["on", "off", "auto"])
def test_early_exit_modes_equal_reference(early_exit):
    """The early exit only steers precomputation: on, off or auto, the output is the same."""
    target = tiny_target(seed=11)
    draft = perturbed_copy(target, noise=0.4, seed=12)
    got, stats = run_mirror(SlowSuffix(target), TorchModel(draft), [9, 8, 7], 40, gamma=3, early_exit=early_exit)
    assert got == flat(generate(TorchModel(target), [9, 8, 7], 40))
    exit_steps = stats["early_exit_steps"]
    assert (exit_steps == 0) if early_exit == "off" else (exit_steps > 0)


def test_bad_early_exit_setting_refused():
    with pytest.raises(ValueError, match="--early-exit must be on, off or auto"):
        GenerationConfig(early_exit="sometimes")


def test_lookup_guesses_change_cost_not_output():
    """Prompt-lookup guesses are checked against the draft's own choice: kept or not, the output is the same."""
    target = tiny_target(seed=13)
    draft = perturbed_copy(target, noise=0.1, seed=14)
    prompt = [4, 9, 4, 9, 4, 9, 11, 12, 4, 9]  # repetitive: the tiny models copy it often
    expected = flat(generate(TorchModel(target), prompt, 60))
    runs = {lookup: run_mirror(SlowSuffix(target), TorchModel(draft), prompt, 60, gamma=4, draft_lookup=lookup)
            for lookup in (0, 3)}
    assert all(got == expected for got, _ in runs.values())
    kept, fed = map(int, runs[3][1]["lookup_guesses_kept"].split("/"))
    assert 0 < kept <= fed  # the guesses were used, so this test exercises them
    assert runs[0][1]["lookup_guesses_kept"] == "0/0"


class SlowDraft(TorchModel):
    """A draft whose forwards take a while: precomputation then lands at other moments."""

    def forward(self, tokens, cache, *args, **kwargs):
        time.sleep(0.004)
        return super().forward(tokens, cache, *args, **kwargs)


@pytest.mark.parametrize("seed,rule", [(0, "exact-seed"), (1, "exact-seed"), (0, "rejection"), (1, "rejection")])
def test_seeded_sampling_repeats_whatever_the_timing(seed, rule):
    """With a seed, sampled Mirror output is the same whether the draft is fast or slow and whatever it
    precomputed (keyed draws, full windows): the same request repeats exactly; exact-seed's is ar's text."""
    target = tiny_target(seed=seed, scale=3.0)
    draft = perturbed_copy(target, noise=0.3, seed=seed + 50)
    settings = dict(gamma=4, sampling=SamplingConfig(temperature=1.0), seed=11, sampling_verify=rule)
    fast, _ = run_mirror(TorchSplitTarget(target), TorchModel(draft), [3, 4, 5], 40, **settings)
    slow_draft, drafted = run_mirror(TorchSplitTarget(target), SlowDraft(draft), [3, 4, 5], 40, **settings)
    slow_target, stats = run_mirror(SlowSuffix(target), TorchModel(draft), [3, 4, 5], 40, **settings)
    branches, _ = run_mirror(SlowSuffix(target), TorchModel(draft), [3, 4, 5], 40, branch_budget=2, **settings)
    assert len(stats["proposed_per_position"]) > 1  # windows of several tokens were verified
    assert fast == slow_draft == slow_target == branches
    ar = flat(generate(TorchModel(target), [3, 4, 5], 40, SamplingConfig(temperature=1.0), 11))
    assert fast == ar if rule == "exact-seed" else fast != ar  # rejection: the target's law, not its very draws
    assert not stats["events"] and not drafted["events"]  # no draft fell back (that would draw the text otherwise)
    other, _ = run_mirror(TorchSplitTarget(target), TorchModel(draft), [3, 4, 5], 40, **{**settings, "seed": 12})
    assert other != fast


class EdgeCheckedDraft(TorchModel):
    """A draft that records the furthest position any of its forwards reached."""

    furthest = 0

    def forward(self, tokens, cache, last_rows=None):
        self.furthest = max(self.furthest, cache.length + len(tokens))
        return super().forward(tokens, cache, last_rows)


@pytest.mark.parametrize("gamma", [2, 6])
def test_draft_stays_inside_the_context_at_its_edge(gamma):
    """A sequence that runs into the context limit: the draft never feeds a position past it (an exported
    graph's rotary tables end there), and the text still equals the target alone up to the limit."""
    target = tiny_target(seed=2, max_seq_len=64)
    draft = EdgeCheckedDraft(perturbed_copy(target, noise=0.2, seed=3))
    prompt = [(i * 11) % 90 + 3 for i in range(40)]
    tokens, stats = run_mirror(TorchSplitTarget(target), draft, prompt, 60, gamma=gamma)
    assert tokens == flat(generate(TorchModel(target), prompt, 60))
    assert not stats["events"]  # no fallback: the draft never failed
    assert len(tokens) == 64 - len(prompt)
    assert 0 < draft.furthest <= 64
