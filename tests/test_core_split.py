"""Target-only steps on two cores (runtime.batch.splits): the way chosen by measurement, the same text either
way."""

import pytest
from test_batch import prompts, reference, run, sequence

from mirror_rt.runtime.affinity import available_cores
from mirror_rt.runtime.batch import steps as batch_steps
from mirror_rt.runtime.batch.decoder import BatchConfig, BatchDecoder
from mirror_rt.runtime.batch.splits import CORE_TRIAL as TRIAL
from mirror_rt.runtime.batch.splits import EXPLORE, KEEP, CoreSplit, balanced_cut
from mirror_rt.runtime.config import GenerationConfig

CORES = sorted(available_cores())
CPUS = (CORES[0], CORES[-1])  # two cores where the machine has them (pinning to one core twice also works)
# the engine's `cpus` as devices.placement gives them (Placement.worker_cores): core sets, equal on two cores, the
# target's wider on more (there the two halves run one after the other on the target's cores: same bits)
SHARES = {"cores": CPUS, "equal sets": ((CORES[0],), (CORES[-1],)), "unequal sets": (tuple(CORES), (CORES[-1],))}


@pytest.fixture(params=list(SHARES))
def cpus(request):
    return SHARES[request.param]


def test_both_ways_are_tried_then_the_faster_kept():
    split = CoreSplit()
    ways = []
    for _ in range(2 * TRIAL):
        ways.append(split.way(8))
        split.record(8, ways[-1], 0.020 if ways[-1] == "split" else 0.030)
    assert ways.count("wide") == ways.count("split") == TRIAL
    assert split.way(8) == "split"
    assert split.way(4) == "wide"  # another batch size has its own trial


def test_a_slow_first_step_does_not_decide():
    """The first call of a way pays its set-up (a helper thread, buffers): the median of the latest steps decides."""
    split = CoreSplit()
    for k in range(TRIAL):
        split.record(8, "wide", 0.030)
        split.record(8, "split", 0.500 if k == 0 else 0.020)
    assert split.way(8) == "split"


def test_the_way_not_taken_is_tried_again_and_can_win():
    """As the rows grow the faster way can change: the other is tried every EXPLORE steps and its new times
    count (the latest KEEP per way)."""
    split = CoreSplit()
    for _ in range(TRIAL):
        split.record(8, "wide", 0.030)
        split.record(8, "split", 0.020)
    seen = []
    for _ in range(EXPLORE * (KEEP + 1)):
        way = split.way(8)
        seen.append(way)
        split.record(8, way, 0.040 if way == "split" else 0.030)  # split has become the slower way
    assert "wide" in seen[:EXPLORE]
    assert seen[-EXPLORE:].count("wide") > seen[-EXPLORE:].count("split")


@pytest.mark.parametrize("lengths, cut", [([10, 10], 1), ([100, 100, 100, 100], 2), ([40, 50, 60, 2000], 3),
                                          ([2000, 40, 50, 60], 1), ([5, 5, 5, 5, 5, 5, 5, 1000], 6)])
def test_the_cut_balances_the_two_parts(lengths, cut):
    assert balanced_cut(lengths) == cut


@pytest.fixture(scope="module", params=["fp32", "w8a8"])
def bundle_pair(request, tmp_path_factory):
    """A tiny ONNX bundle (the default serving path) with its target at `request.param`."""
    from mirror_rt import load_bundle
    from mirror_rt.exporters.export import export_bundle

    folder = export_bundle("tiny", tmp_path_factory.mktemp(f"split-{request.param}"), progress=False,
                           weights=request.param)
    engine = load_bundle(str(folder), mode="mirror")
    return engine.target, engine.draft


def test_rows_split_over_two_cores_equal_the_reference(bundle_pair, monkeypatch, cpus):
    """Every target-only step split, at a cut that moves from step to step: staggered prompts of different
    lengths, each text equal to its single-stream reference (a row computes alike in any call)."""
    target, draft = bundle_pair
    calls = {"n": 0}

    def moving_cut(lengths):
        calls["n"] += 1
        return 1 + calls["n"] % (len(lengths) - 1)

    monkeypatch.setattr(batch_steps, "balanced_cut", moving_cut)
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=5, adaptive_speculation=False), cpus=cpus)
    decoder.core_split.way = lambda rows: "split"
    seqs = [(i * 2, sequence(i, p * (1 + 2 * (i % 3 == 1)), GenerationConfig(max_new_tokens=14 + i, mode="ar")))
            for i, p in enumerate(prompts(9, 11))]
    run(decoder, seqs)
    for _, seq in seqs:
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id
    assert decoder.core_split.splits > 10 and calls["n"] == decoder.core_split.splits


class Alternating:
    """A policy that turns between speculation (gamma 2) and target-only steps every step."""

    reason = "slower"  # what it says of its target-only steps (runtime.batch.policy.SpeculationPolicy.reason)

    def __init__(self):
        self.steps = 0

    def gamma(self, decoder, running, prompts=False):
        self.steps += 1
        self.last = "speculative" if self.steps % 2 else "target-only"  # the way taken (SpeculationPolicy.last)
        return 2 * (self.steps % 2)

    def prompts_first(self, prompts):
        return False

    def record(self, *args, **kwargs):
        pass


def test_steps_split_only_once_the_draft_worker_is_free(bundle_pair, cpus):
    """The helper of a split step runs on the draft worker's core: Mirror sequences leave the worker before
    every target-only step, so no split meets a drafting worker, and the texts stay the reference's."""
    target, draft = bundle_pair
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=4), policy=Alternating(), cpus=cpus)
    decoder.core_split.way = lambda rows: "split"
    decoder.mirror.batch.spreads = lambda running: False  # Mirror rows keep the draft worker (the subject here)
    drafting = []
    original = target.forward_rows_split

    def watched(*args, **kwargs):
        drafting.append(decoder.mirror.drafting())
        return original(*args, **kwargs)

    target.forward_rows_split = watched
    try:
        seqs = [(i, sequence(i, p, GenerationConfig(max_new_tokens=16, mode="mirror")))
                for i, p in enumerate(prompts(4, 12))]
        run(decoder, seqs)
    finally:
        del target.forward_rows_split
    for _, seq in seqs:
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id
    assert len(drafting) > 4 and not any(drafting)


@pytest.mark.parametrize("mode", ["ar", "mirror"])
def test_prompts_prefilled_two_at_once_equal_the_reference(bundle_pair, mode, cpus):
    """Prompts of like lengths arriving together take a chunk each at once, one per core (small chunks, so a
    prompt pairs several times, and partners change): every text equals its single-stream reference. Mirror
    sequences hold the draft worker's core while they run, so prompts pair only before the first of them does."""
    target, draft = bundle_pair
    settings = BatchConfig(max_num_seqs=6, prefill_chunk=5, adaptive_speculation=False)
    decoder = BatchDecoder(target, draft, settings, cpus=cpus)
    seqs = [(2 * (i // 3), sequence(i, (p * 8)[:10 + i % 5], GenerationConfig(max_new_tokens=10, mode=mode)))
            for i, p in enumerate(prompts(9, 13))]
    run(decoder, seqs)
    for _, seq in seqs:
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id
    assert decoder.prefill.pairs > (3 if mode == "ar" else 0)
