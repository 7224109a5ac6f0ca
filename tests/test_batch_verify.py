"""Batched verification (runtime.batch.verify): every speculating row's window in one target call, each text
still its single-stream reference's, whatever the batch holds."""

import os

import pytest

from mirror_rt.runtime.affinity import available_cores
from mirror_rt.runtime.batch.decoder import BatchConfig, BatchDecoder
from mirror_rt.runtime.batch.sequence import Sequence
from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.reference import generate

ROW_CALLS = ("forward_rows", "forward_rows_prefix")  # a split target's suffix completes its prefix's call


class Counted:
    """A model whose row calls are counted (everything else passes through; a draft row's single-sequence forwards
    are not row calls)."""

    def __init__(self, model):
        self.model, self.calls, self.wide = model, 0, 0
        self.wide_cores = set()  # the cores each wide call's thread could run on (its native ops split over them)

    def __getattr__(self, name):
        member = getattr(self.model, name)
        if name not in ROW_CALLS:
            return member

        def counted(*args, **kwargs):
            self.calls += 1
            self.wide += bool(kwargs.get("wide"))
            if kwargs.get("wide"):
                self.wide_cores.add(frozenset(os.sched_getaffinity(0)))
            return member(*args, **kwargs)
        return counted


def prompt(i: int) -> list[int]:
    return [(i * 17 + j * 11) % 90 + 3 for j in range(3 + (i * 7) % 13)]


def reference(target, seq: Sequence) -> list[int]:
    return [t for step in generate(target, seq.prompt, seq.config.max_new_tokens) for t in step]


def decode(target, draft, seqs: list[Sequence], max_num_seqs: int, on_step=None, cpus=None) -> BatchDecoder:
    """Every sequence at once through a decoder with each mode as asked; `on_step(decoder, running)` around each
    speculative step's call; `cpus`: the decoder's (target, draft) cores."""
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=max_num_seqs, adaptive_speculation=False),
                           cpus=cpus)
    if on_step is not None:
        run = decoder.mirror.run

        def counted(running, gamma, **options):
            before, settled = (target.calls, draft.calls), all(s.metrics.steps for s in running)
            run(running, gamma, **options)
            on_step(running, target.calls - before[0], (draft.calls - before[1]) if settled else None, gamma)
        decoder.mirror.run = counted
    for seq in seqs:
        decoder.add(seq)
    steps = 0
    try:
        while not decoder.idle:
            decoder.step()
            steps += 1
            assert steps < 5000
    finally:
        decoder.close()
    return decoder


@pytest.mark.parametrize("mode", ["sd", "mirror"])
@pytest.mark.parametrize("batch", [2, 5])
def test_a_speculative_step_is_one_target_call(pair, mode, batch):
    """B speculating sequences: one target call per step (counted, not timed), and sd's draft calls per step grow
    with the window, not with B (once the drafts read the prompts: a prompt is fed in a call of its own)."""
    target, draft = Counted(pair[0]), Counted(pair[1])
    seqs = [Sequence(f"s{i}", prompt(i), GenerationConfig(max_new_tokens=30, mode=mode, gamma=3), budget=30)
            for i in range(batch)]
    steps = []
    decode(target, draft, seqs, batch, lambda running, calls, drafts, gamma: steps.append((len(running), calls,
                                                                                           drafts, gamma)))
    assert {calls for _, calls, _, _ in steps} == {1}
    assert max(b for b, _, _, _ in steps) == batch  # every sequence speculated in one step at least
    if mode == "sd":
        settled = [(drafts, gamma) for _, _, drafts, gamma in steps if drafts is not None]
        assert settled and all(drafts <= gamma + 1 for drafts, gamma in settled)  # (+1: catching up the bonus)
        assert any(drafts for drafts, _ in settled)  # the draft's rows run in its pool
    for seq in seqs:
        assert seq.tokens == reference(pair[0], seq), seq.id


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5])
def test_mixed_batches_equal_the_reference(pair, batch):
    """Modes, windows and lengths mixed in one batch (sequences finish mid-batch, later ones take their rows): each
    text equals its own single-stream reference."""
    target, draft = pair
    modes = ("mirror", "sd", "ar", "mirror", "sd", "mirror", "sd")
    seqs = [Sequence(f"s{i}", prompt(i + batch), GenerationConfig(max_new_tokens=6 + 5 * i, mode=modes[i],
                                                                    gamma=1 + (i + batch) % 4), budget=6 + 5 * i)
            for i in range(len(modes))]
    decode(Counted(target), Counted(draft), seqs, batch)
    for seq in seqs:
        assert seq.tokens == reference(target, seq), seq.id
        assert seq.finish_reason == "length"


@pytest.mark.parametrize("batch", [2, 3, 5])
def test_spread_steps_equal_the_reference(pair, batch):
    """With a core per worker and a target over every core, a batch's Mirror rows draft as sd's, on both cores, and
    are verified on every core (runtime.batch.verify `spreads`); alone, a sequence is Mirror's again: each text equals
    its single-stream reference, sequences finishing mid-batch and taking each other's rows."""
    target, draft = Counted(pair[0]), Counted(pair[1])
    if not target.capabilities.wide:
        pytest.skip("this target has no sessions over every core")
    cores = sorted(available_cores())
    cpus = ((cores[0],), (cores[-1],))
    seqs = [Sequence(f"s{i}", prompt(i + batch), GenerationConfig(max_new_tokens=8 + 6 * i, mode="mirror",
                                                                    gamma=1 + (i + batch) % 4), budget=8 + 6 * i)
            for i in range(batch + 2)]
    decoder = decode(target, draft, seqs, batch, cpus=cpus)
    assert target.wide  # spread steps ran (and Mirror's, once one sequence was left)
    assert all(c >= {cores[0], cores[-1]} for c in target.wide_cores)  # every core, not Mirror's target's alone
    assert decoder.mirror.batch.target_calls
    if target.capabilities.two_calls:  # the verify tried two calls at once, one per core, beside the wide one
        assert decoder.mirror.batch.split.splits
    if draft.capabilities.wide:  # the drafting too: two calls at once, one per core, beside one on every core
        assert {way for _, way in decoder.mirror.batch.draft_split.times} == {"wide", "split"}
    for seq in seqs:
        assert seq.tokens == reference(pair[0], seq), seq.id


def test_one_stream_switches_between_spread_divided_and_target_only_steps_exactly(pair):
    """One Mirror stream whose load policy measures its three ways in turn (spread over every core, Mirror's divided
    cores, target-only) and tries them again every few steps: the draft row leaves and rejoins the draft worker at
    each switch, and the text still equals its single-stream reference."""
    from mirror_rt.runtime.batch.policy import SpeculationPolicy

    target, draft = Counted(pair[0]), Counted(pair[1])
    if not target.capabilities.wide:
        pytest.skip("this target has no sessions over every core")
    cores = sorted(available_cores())
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=1), cpus=((cores[0],), (cores[-1],)),
                           policy=SpeculationPolicy(explore=2, refresh=3))
    seqs = [Sequence(f"s{i}", prompt(i), GenerationConfig(max_new_tokens=40, mode="mirror", gamma=1 + i % 4),
                     budget=40) for i in range(3)]
    ways = []
    for seq in seqs:
        decoder.add(seq)
    try:
        while not decoder.idle:
            decoder.step()
            ways.append(decoder.policy.previous)
    finally:
        decoder.close()
    assert {"speculative", "speculative, spread", "target-only"} <= set(ways)
    assert sum(s.metrics.spread_steps for s in seqs) and target.wide
    assert draft.wide or not draft.capabilities.wide  # its one row drafted through its session over every core
    assert all(c >= {cores[0], cores[-1]} for c in target.wide_cores)
    assert all(s.metrics.speculative_steps > s.metrics.spread_steps for s in seqs)  # Mirror's own steps too
    from mirror_rt.runtime.metrics import format_stats

    stats = seqs[0].metrics.summary()
    assert stats["spread_steps"] == seqs[0].metrics.spread_steps
    text = format_stats(stats | {"mode": "mirror", "stop_reason": "length"})
    assert (f"{stats['spread_steps']} of {stats['speculative_steps']} speculative steps spread over every core"
            in text) == bool(stats["spread_steps"])
    for seq in seqs:
        assert seq.tokens == reference(pair[0], seq), seq.id


def test_a_cancelled_sequence_leaves_the_others_exact(pair):
    """A sequence cancelled mid-batch stops at a step boundary; its companions' texts are unchanged."""
    target, draft = pair
    seqs = [Sequence(f"s{i}", prompt(i), GenerationConfig(max_new_tokens=30, mode=("sd", "mirror")[i % 2], gamma=3),
                     budget=30) for i in range(4)]
    cancelled = seqs[1]

    def on_step(running, calls, drafts, gamma):
        if len(cancelled.tokens) >= 8:
            cancelled.cancel()
    decode(Counted(target), Counted(draft), seqs, 4, on_step)
    assert cancelled.finish_reason == "cancelled" and 8 <= len(cancelled.tokens) < 30
    for seq in seqs:
        expected = reference(target, seq)
        assert seq.tokens == expected[:len(seq.tokens)], seq.id
        assert seq is cancelled or seq.tokens == expected


def test_a_mixed_load_of_40_with_12_in_flight_equals_the_reference(pair):
    """The served load the issue names, at tiny size: 40 greedy requests of mixed lengths and modes, 12 rows, the
    adaptive policy deciding and a core per worker (spread steps where it picks speculation): no text differs from
    its single-stream reference, and the load speculated."""
    target, draft = pair
    cores = sorted(available_cores())
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=12), cpus=((cores[0],), (cores[-1],)))
    seqs = [Sequence(f"s{i}", prompt(i), GenerationConfig(max_new_tokens=4 + (i * 7) % 29,
                                                          mode=("mirror", "mirror", "sd", "ar")[i % 4], gamma=4),
                     budget=4 + (i * 7) % 29) for i in range(40)]
    for seq in seqs:
        decoder.add(seq)
    try:
        for _ in range(5000):
            if decoder.idle:
                break
            decoder.step()
    finally:
        decoder.close()
    assert decoder.idle
    assert sum(seq.metrics.speculative_steps for seq in seqs) > 0
    for seq in seqs:
        assert seq.tokens == reference(target, seq), seq.id
