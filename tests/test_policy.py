"""The speculation policy: measured rates decide, unmeasured ways are tried, switches need a clear gain."""

from mirror_rt.runtime.batch.policy import AR, SPEC, SPREAD, SpeculationPolicy


def drive(policy: SpeculationPolicy, batch: int, rates: dict, steps: int, ways=(SPEC, AR)) -> list[str]:
    """Run `steps` decisions at `batch` among `ways`, feeding back tokens/s from `rates` (way -> tokens per
    second)."""
    chosen = []
    for _ in range(steps):
        way = policy.choose(batch, ways)
        policy.record(way, batch, int(rates[way]), 1.0)
        chosen.append(way)
    return chosen


def test_one_stream_spreads_where_its_cores_pay_more_together():
    """One stream's third way, its step spread over every core, is measured beside Mirror's divided cores and
    target-only, and kept only where it is the fastest; the ways not taken are tried again in turn."""
    three = (SPEC, SPREAD, AR)
    policy = SpeculationPolicy(explore=2, refresh=10)
    ways = drive(policy, 1, {SPEC: 60, SPREAD: 90, AR: 50}, 60, three)
    assert ways[:7] == [SPEC, SPEC, SPREAD, SPREAD, SPREAD, AR, AR]  # (a switch is no sample)
    assert ways[-1] == SPREAD and ways.count(SPREAD) > 40 and {SPEC, AR} <= set(ways[10:])  # both tried again
    divided = SpeculationPolicy(explore=2, refresh=1000)
    assert set(drive(divided, 1, {SPEC: 90, SPREAD: 60, AR: 50}, 30, three)[10:]) == {SPEC}
    assert set(drive(SpeculationPolicy(explore=2), 1, {SPEC: 40, SPREAD: 45, AR: 80}, 30, three)[10:]) == {AR}
    assert SpeculationPolicy(adaptive=False).choose(1, three) == SPEC  # as asked: Mirror's own step


def test_spreading_one_stream_that_won_lets_two_streams_try_speculation():
    policy = SpeculationPolicy(explore=2, refresh=1000)
    drive(policy, 1, {SPEC: 40, SPREAD: 90, AR: 60}, 20, (SPEC, SPREAD, AR))  # divided lost, spread won
    assert drive(policy, 2, {SPEC: 150, AR: 100}, 20)[-1] == SPEC


def test_the_faster_way_wins_after_both_were_measured():
    policy = SpeculationPolicy(explore=2, refresh=1000)
    ways = drive(policy, 1, {SPEC: 80, AR: 45}, 20)
    assert ways[:5] == [SPEC, SPEC, AR, AR, AR] and set(ways[5:]) == {SPEC}  # the switch to AR is no sample
    ways = drive(policy, 4, {SPEC: 70, AR: 150}, 20)
    assert set(ways[6:]) == {AR}


def test_speculation_that_lost_at_a_smaller_batch_is_not_tried_again_larger():
    policy = SpeculationPolicy(explore=2, refresh=1000)
    drive(policy, 2, {SPEC: 60, AR: 90}, 10)
    assert set(drive(policy, 5, {SPEC: 10, AR: 200}, 10)) == {AR}


def test_speculation_is_tried_at_a_larger_batch_only_where_it_won_below():
    policy = SpeculationPolicy(explore=2, refresh=1000)
    assert drive(policy, 4, {SPEC: 500, AR: 100}, 10)[-1] == SPEC  # nothing known below: measured here
    lost = SpeculationPolicy(explore=2, refresh=1000)
    drive(lost, 2, {SPEC: 40, AR: 100}, 10)
    assert set(drive(lost, 3, {SPEC: 500, AR: 100}, 10)) == {AR}  # it lost at 2: not tried at 3
    policy = SpeculationPolicy(explore=2, refresh=1000)
    drive(policy, 1, {SPEC: 80, AR: 45}, 10)
    ways = drive(policy, 2, {SPEC: 100, AR: 60}, 10)  # target-only measured first; one stream's 80 beats its 60
    assert ways[:2] == [AR, AR] and ways[-1] == SPEC
    assert drive(policy, 3, {SPEC: 100, AR: 60}, 20)[-1] == SPEC


def test_speculation_is_measured_at_the_batch_it_runs():
    """A speculative step verifies every row in one call, so a batch's speculation is tried where it won at a
    smaller batch, whatever one stream's rate: at 2 rows it loses here (target-only from then on), so 3 rows never
    try it; where it wins at 2 rows, 3 rows try it and keep it."""
    policy = SpeculationPolicy(explore=2, refresh=1000)
    drive(policy, 1, {SPEC: 80, AR: 60}, 10)
    ways = drive(policy, 2, {SPEC: 100, AR: 110}, 30)
    assert SPEC in ways[:10] and set(ways[10:]) == {AR}
    assert set(drive(policy, 3, {SPEC: 500, AR: 120}, 20)) == {AR}
    policy = SpeculationPolicy(explore=2, refresh=1000)
    drive(policy, 1, {SPEC: 80, AR: 60}, 10)
    drive(policy, 2, {SPEC: 150, AR: 110}, 20)  # above one stream's 80: measured, not guessed
    assert drive(policy, 3, {SPEC: 180, AR: 120}, 20)[-1] == SPEC


def test_exploring_ends_when_sequences_come_and_go_every_step():
    """Steps where a sequence reads its prompt never settle; exploring stops after 3 * explore tries anyway."""
    policy = SpeculationPolicy(explore=2, refresh=1000)
    ways = []
    for _ in range(20):
        way = policy.choose(1)
        policy.record(way, 1, 10, 1.0, settled=False)
        ways.append(way)
    assert ways[:6] == [SPEC] * 6 and ways[6:12] == [AR] * 6 and len(set(ways[12:])) == 1


def test_small_gains_do_not_flip_the_way():
    """Rates within the margin keep the current way (no oscillation at a switch point)."""
    policy = SpeculationPolicy(explore=1, refresh=1000, margin=0.1)
    drive(policy, 1, {SPEC: 100, AR: 95}, 5)
    assert set(drive(policy, 1, {SPEC: 100, AR: 105}, 30)) == {SPEC}


def test_the_way_not_taken_is_measured_again():
    policy = SpeculationPolicy(explore=1, refresh=10)
    ways = drive(policy, 1, {SPEC: 100, AR: 50}, 40)
    assert ways[2:].count(AR) >= 3  # refreshed now and then: a changed machine is noticed


def test_a_switch_and_a_first_window_are_not_measured():
    """The step that changes ways pays the draft's catch-up, a sequence's first window the draft's prompt read:
    neither is what the way costs when it runs."""
    policy = SpeculationPolicy(explore=2, refresh=1000)
    policy.record(SPEC, 1, 2, 1.0, settled=False)  # a first window
    assert policy.rates[(SPEC, 1)].samples == 0
    policy.record(SPEC, 1, 50, 1.0)
    policy.record(AR, 1, 1, 5.0)  # the switch
    assert policy.rates[(AR, 1)].samples == 0
    policy.record(AR, 1, 40, 1.0)
    assert policy.rates[(AR, 1)].tokens_per_s == 40


def test_rates_are_ratios_of_sums_not_means_of_ratios():
    """One lucky short step does not outweigh long ones: 10 tokens in 0.01 s and 10 in 1 s are ~20 tokens/s."""
    policy = SpeculationPolicy()
    policy.record(SPEC, 1, 10, 0.01)
    policy.record(SPEC, 1, 10, 1.0)
    assert 18 < policy.rates[(SPEC, 1)].tokens_per_s < 21


def test_a_trial_of_the_way_not_taken_lasts_until_measured():
    policy = SpeculationPolicy(explore=2, refresh=5)
    ways = drive(policy, 1, {SPEC: 100, AR: 50}, 30)
    trial = ways[5:].index(AR) + 5
    assert ways[trial:trial + 3] == [AR, AR, AR]  # the switch, then `explore` settled steps


def test_gamma_is_zero_when_nobody_speculates():
    from types import SimpleNamespace

    policy = SpeculationPolicy()
    running = [SimpleNamespace(config=SimpleNamespace(mode="ar", gamma=4))]
    assert policy.gamma(None, running) == 0


def test_a_step_with_prompts_to_prefill_decodes_target_only_when_adaptive():
    """Prompts prefill on every core only while nobody drafts: adaptive, such a step decodes target-only; with
    adaptive speculation off, every request speculates as it asks."""
    from types import SimpleNamespace

    running = [SimpleNamespace(config=SimpleNamespace(mode="mirror", gamma=4), remaining=100)]
    policy = SpeculationPolicy()
    assert policy.gamma(None, running, prompts=True) == 0 and policy.last == AR
    assert policy.gamma(None, running) == 4 and policy.last == SPEC
    assert SpeculationPolicy(adaptive=False).gamma(None, running, prompts=True) == 4


def test_a_spread_step_speculates_beside_prompts_and_in_the_tail():
    """A step spread over every core has no draft worker to leave or join: prompts or a short tail do not make it
    target-only (the measured rates still decide)."""
    from types import SimpleNamespace

    from mirror_rt.runtime.batch.policy import SWITCH_MIN

    def decoder(spread):
        return SimpleNamespace(mirror=SimpleNamespace(batch=SimpleNamespace(spreads=lambda running: spread,
                                                                            spreads_one=lambda running: False)))

    running = [SimpleNamespace(config=SimpleNamespace(mode="mirror", gamma=4), remaining=SWITCH_MIN - 1)] * 2
    policy = SpeculationPolicy(explore=1)
    policy.record(AR, 2, 2, 1.0)  # target-only measured at 2 streams: speculation's turn
    assert policy.gamma(decoder(False), running, prompts=True) == 0 and policy.reason == "prompts"
    assert policy.gamma(decoder(False), running) == 0 and policy.reason == "tail"
    assert policy.gamma(decoder(True), running, prompts=True) == 4 and policy.reason == "measuring"


def test_speculation_does_not_start_for_the_last_few_tokens():
    """After target-only steps, a batch whose sequences all have fewer than SWITCH_MIN tokens left stays
    target-only (the draft's catch-up and first window would not pay); one already speculating goes on."""
    from types import SimpleNamespace

    from mirror_rt.runtime.batch.policy import SWITCH_MIN

    def seqs(left):
        return [SimpleNamespace(config=SimpleNamespace(mode="mirror", gamma=4), remaining=n) for n in left]

    policy = SpeculationPolicy()  # one stream: speculation goes first
    policy.record(AR, 1, 1, 1.0)
    assert policy.gamma(None, seqs([SWITCH_MIN - 1])) == 0 and policy.last == AR
    assert policy.gamma(None, seqs([SWITCH_MIN])) == 4
    policy.record(SPEC, 1, 3, 1.0)
    assert policy.gamma(None, seqs([2])) == 4  # speculating already: no switch to pay for
    policy.record(AR, 2, 2, 1.0)
    assert policy.gamma(None, seqs([3, SWITCH_MIN + 5])) > 0 or policy.last == AR  # one has room: the policy decides
    assert not SpeculationPolicy(adaptive=False).too_late(seqs([1]))
