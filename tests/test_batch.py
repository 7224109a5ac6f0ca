"""The batched decoder: every sequence's text equals its single-stream reference, whoever joins or leaves."""

import dataclasses

import pytest

from mirror_rt.runtime.batch.decoder import BatchConfig, BatchDecoder, KVTooLarge
from mirror_rt.runtime.batch.kv_rows import BLOCK_SIZE
from mirror_rt.runtime.batch.sequence import Sequence
from mirror_rt.runtime.batch.splits import TRIAL
from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.reference import generate
from mirror_rt.runtime.sampling import SamplingConfig


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths (2..17 tokens) over the tiny vocabulary."""
    return [[(seed * 31 + i * 7 + j * 13) % 90 + 3 for j in range(2 + (i * 5) % 16)] for i in range(count)]


def reference(target, prompt, config: GenerationConfig) -> list[int]:
    return [t for step in generate(target, prompt, config.max_new_tokens, config.sampling, config.seed)
            for t in step]


def run(decoder: BatchDecoder, arrivals: list[tuple[int, Sequence]], max_steps: int = 5000) -> None:
    """Add each sequence at its step; step until every sequence is done."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while arrivals or not decoder.idle:
        while arrivals and arrivals[0][0] <= step:
            decoder.add(arrivals.pop(0)[1])
        decoder.step()
        step += 1
        assert step < max_steps
    decoder.close()


def sequence(i: int, prompt, config: GenerationConfig) -> Sequence:
    return Sequence(f"s{i}", list(prompt), config, budget=config.max_new_tokens)


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
@pytest.mark.parametrize("max_num_seqs", [4, 8])
def test_staggered_arrivals_equal_reference(pair, mode, max_num_seqs):
    """12 prompts joining at different steps into batches of up to 4 and 8: each text equals its own ar."""
    target, draft = pair
    settings = BatchConfig(max_num_seqs=max_num_seqs, adaptive_speculation=False)  # each mode as asked, in batches
    decoder = BatchDecoder(target, draft, settings)
    seqs = []
    for i, prompt in enumerate(prompts(12)):
        config = GenerationConfig(max_new_tokens=10 + 3 * i, mode=mode, gamma=1 + i % 4)
        seqs.append((i * 2, sequence(i, prompt, config)))
    run(decoder, seqs)
    for _, seq in seqs:
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id
        assert seq.finish_reason == "length" and seq.state == "done"
    assert decoder.idle and len(decoder.rows) == 0 and decoder.budget.reserved == 0


def test_modes_mix_in_one_batch(pair):
    """ar, sd and mirror sequences decode side by side; each equals its reference; mirror ones speculated."""
    target, draft = pair
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=6, adaptive_speculation=False))  # as asked
    seqs = [(i, sequence(i, p, GenerationConfig(max_new_tokens=25, mode=("ar", "sd", "mirror")[i % 3], gamma=3)))
            for i, p in enumerate(prompts(6, 3))]
    steps = {s.id: [] for _, s in seqs}
    for _, seq in seqs:
        seq.sink = lambda s, tokens, drafted, accepted: steps[s.id].append((len(tokens), drafted, accepted))
    run(decoder, seqs)
    for _, seq in seqs:
        assert seq.tokens == reference(target, seq.prompt, seq.config)
        drafted = sum(d for _, d, _ in steps[seq.id])
        assert (drafted == 0) == (seq.config.mode == "ar")
        assert sum(n for n, _, _ in steps[seq.id]) == len(seq.tokens)
    assert not [t for t in __import__("threading").enumerate() if t.name == "mirror-draft" and t.is_alive()]


@pytest.fixture(scope="module", params=["fp32", "int8", "int4", "q4_1", "w8a8", "w8a8-standard"])
def precision_pair(request, tmp_path_factory):
    """(target, draft) of a tiny ONNX bundle with its target at each precision (`mirror-rt export --weights`): with
    quantized activations a last-bit difference between call shapes would change tokens, so every target must
    compute a position alike whether it comes in a one-token step, a row of a batch or a verify window. The
    targets attend through mirror-rt's op where it builds; `-standard`: through standard ops (exporters.exact_kv,
    what machines without a compiler export)."""
    from mirror_rt import load_bundle
    from mirror_rt.exporters.export import export_bundle

    weights, _, attention = request.param.partition("-")
    folder = export_bundle("tiny", tmp_path_factory.mktemp(f"bundle-{request.param}"), progress=False,
                           weights=weights, attention=attention or None)
    engine = load_bundle(str(folder), mode="mirror")
    assert engine.names["target_precision"] == weights
    return engine.target, engine.draft


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_every_precision_equals_its_reference(precision_pair, mode):
    """Every precision is exact against ar over its own graphs: 8 prompts in batches of up to 4, each equal to the
    single-stream reference (one-token steps) of the very same target."""
    target, draft = precision_pair
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=4, adaptive_speculation=False))
    seqs = [(i, sequence(i, p, GenerationConfig(max_new_tokens=24, mode=mode, gamma=2 + i % 3)))
            for i, p in enumerate(prompts(8, 5))]
    run(decoder, seqs)
    for _, seq in seqs:
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id


def test_targets_compute_a_position_alike_in_every_call_shape(precision_pair):
    """Bitwise: a position's logits as a one-token step, as a row of a batch and inside a verify window."""
    import numpy as np

    target, _ = precision_pair
    pool = target.new_pool(4, 64)
    prompt = np.array([prompts(1, 9)[0][:6]])
    for row in range(4):
        target.forward_rows(prompt, pool, row, last_rows=1)
        pool.commit(row, 6)
    window = np.array([[11, 12, 13, 14]])
    in_window = target.forward_rows(window, pool, 0, last_rows=4)[0]  # positions 6..9 of row 0
    steps = []
    for t in range(4):  # the same positions one token at a time
        steps.append(target.forward_rows(window[:, t:t + 1], pool, 0, last_rows=1)[0, 0])
        pool.commit(0, 7 + t)
    batch = target.forward_rows(np.array([[11]] * 4), pool, 0, last_rows=1)[:, 0]  # position 6 of rows 1..3
    for t in range(4):
        assert np.array_equal(in_window[t], steps[t]), t
    for row in range(1, 4):
        assert np.array_equal(batch[row], steps[0]), row


def test_seeded_sampling_repeats_whatever_the_companions(pair):
    """A seeded sampled request gives the same tokens alone, in a batch, and in sd: its draws are keyed by
    position, never by what else runs."""
    target, draft = pair
    config = GenerationConfig(max_new_tokens=24, mode="sd", seed=7, sampling=SamplingConfig(temperature=0.9),
                              sampling_verify="exact-seed")
    alone = BatchDecoder(target, draft, BatchConfig(max_num_seqs=1))
    solo = sequence(0, [5, 6, 7], config)
    run(alone, [(0, solo)])
    crowded = BatchDecoder(target, draft, BatchConfig(max_num_seqs=4))
    again = sequence(1, [5, 6, 7], dataclasses.replace(config, mode="ar"))
    mirrored = sequence(2, [5, 6, 7], dataclasses.replace(config, mode="mirror"))
    others = [(i, sequence(10 + i, p, dataclasses.replace(config, seed=i))) for i, p in enumerate(prompts(5, 1))]
    run(crowded, others + [(3, again), (5, mirrored)])
    assert solo.tokens == again.tokens == mirrored.tokens == reference(target, [5, 6, 7], config)


def test_cancel_mid_batch_leaves_the_others(pair):
    """A sequence cancelled after a few steps frees its row; the others' text is unchanged."""
    target, draft = pair
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=4))
    config = GenerationConfig(max_new_tokens=20, mode="sd", gamma=3)
    seqs = [sequence(i, p, config) for i, p in enumerate(prompts(4, 2))]
    for seq in seqs:
        decoder.add(seq)
    for _ in range(4):
        decoder.step()
    seqs[1].cancel()
    while not decoder.idle:
        decoder.step()
    assert seqs[1].finish_reason == "cancelled" and len(seqs[1].tokens) < 20
    for seq in seqs[:1] + seqs[2:]:
        assert seq.tokens == reference(target, seq.prompt, config)


def test_a_request_too_large_is_refused_in_one_line(pair):
    target, draft = pair
    per_block = _block_bytes(target, draft)
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=2, kv_cache_gb=10 * per_block / 2**30))
    assert decoder.budget.total == 10
    with pytest.raises(KVTooLarge, match="KV positions but the KV cache holds"):
        decoder.add(sequence(0, [3] * 60, GenerationConfig(max_new_tokens=150, mode="ar")))


def test_a_kv_budget_that_fits_no_request_is_refused_at_once(pair):
    """A server started with such a budget refused every request with a 400; it now fails to start, saying the
    least that serves one."""
    target, draft = pair
    gb = 2 * _block_bytes(target, draft) / 2**30
    with pytest.raises(ValueError, match=r"holds 32 KV positions, fewer than the smallest request needs \(96\)"):
        BatchDecoder(target, draft, BatchConfig(max_num_seqs=2, kv_cache_gb=gb))


def _block_bytes(target, draft) -> int:
    """KV bytes of one block of both models' rows (what --kv-cache-gb counts)."""
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=2))
    pools = [p for p in (decoder.target_pool, decoder.draft_pool) if p is not None]
    return sum(p.bytes_per_position for p in pools) * BLOCK_SIZE


def test_a_request_that_cannot_fit_now_waits(pair):
    """With room for one sequence's blocks, the second waits for the first to finish, then runs."""
    target, draft = pair
    config = GenerationConfig(max_new_tokens=20, mode="ar")
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=4))
    decoder.budget.total = decoder.blocks_needed(sequence(0, [3] * 10, config)) + 1
    first, second = sequence(0, [3] * 10, config), sequence(1, [4] * 10, config)
    decoder.add(first)
    decoder.add(second)
    decoder.step()
    assert first.state == "running" and second.state == "waiting"
    while not decoder.idle:
        decoder.step()
    assert second.tokens == reference(target, second.prompt, config)


def test_second_turn_hits_the_prefix_cache(pair):
    """The next turn of a chat reuses the blocks of the first; its text equals the text without the cache."""
    target, draft = pair
    config = GenerationConfig(max_new_tokens=30, mode="sd")
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=2))
    first = sequence(0, prompts(8)[7] + prompts(8)[6], config)
    run(decoder, [(0, first)])
    turn = first.prompt + first.tokens + [11, 12, 13]
    second = sequence(1, turn, config)
    hits = decoder.cache.hits
    run(decoder, [(0, second)])
    assert second.reused >= 32 and decoder.cache.hits - hits == second.reused
    assert second.tokens == reference(target, turn, config)
    cold = BatchDecoder(target, draft, BatchConfig(max_num_seqs=2, prefix_cache=False))
    again = sequence(2, turn, config)
    run(cold, [(0, again)])
    assert again.tokens == second.tokens and again.reused == 0


def test_a_repeated_prompt_of_most_of_the_pool_reuses_its_own_cached_prefix(pair):
    """A pool of 15 blocks: a 130-token prompt (8 full blocks kept after it) asked again needs 14 blocks, so the
    cache must give up blocks to admit it. It gives up others first, and its own prefix goes into its row before
    it leaves the cache: all 8 blocks hit (1 did: a finished request kept its blocks only in the room its own
    reservation left, then admission evicted them before the lookup). Same text."""
    target, draft = pair
    config = GenerationConfig(max_new_tokens=8, mode="ar")
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=2))
    decoder.budget.total = decoder.cache.max_blocks = 15
    prompt = [(11 * j) % 90 + 3 for j in range(130)]
    first = sequence(0, prompt, config)
    run(decoder, [(0, first)])
    other = sequence(1, [5, 6, 7, 8, 9] * 2, config)  # a block kept after it, more recent: evicted first
    run(decoder, [(0, other)])
    assert len(decoder.cache) == 9
    again = sequence(2, prompt, config)
    run(decoder, [(0, again)])
    assert again.reused == 8 * BLOCK_SIZE
    assert again.tokens == first.tokens == reference(target, prompt, config)
    assert decoder.budget.reserved == 0 and len(decoder.cache) <= decoder.budget.total


def test_memory_stays_bounded_over_many_requests(pair):
    """200 short requests through 4 rows: rows, reservations and cached blocks never pass their limits."""
    target, draft = pair
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=4))
    config = GenerationConfig(max_new_tokens=3, mode="ar")
    seqs = [(i // 4, sequence(i, prompts(200, i)[i % 200][:12] + [i % 90 + 3] * 20, config)) for i in range(200)]
    peak = 0
    arrivals = sorted(seqs, key=lambda a: a[0])
    step = 0
    while arrivals or not decoder.idle:
        while arrivals and arrivals[0][0] <= step:
            decoder.add(arrivals.pop(0)[1])
        decoder.step()
        peak = max(peak, decoder.budget.reserved + len(decoder.cache))
        step += 1
    assert all(s.done for _, s in seqs)
    assert peak <= decoder.budget.total and len(decoder.rows) == 0


def test_a_step_that_prefills_prompts_decodes_target_only(pair):
    """Adaptive speculation: while a new prompt prefills, the running stream decodes target-only (the draft worker
    leaves the other core to the prompt), then speculates again; both texts equal their references."""
    from mirror_rt.runtime.batch.policy import AR, SPEC, Rate, SpeculationPolicy

    target, draft = pair
    policy = SpeculationPolicy(refresh=10**6)  # one stream: speculation measured faster already, no trials
    policy.rates = {(SPEC, 1): Rate(1000.0, 1.0, 10, 10), (AR, 1): Rate(10.0, 1.0, 10, 10)}
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=2), policy=policy)
    first = sequence(0, prompts(1, 3)[0], GenerationConfig(max_new_tokens=80, mode="mirror"))
    second = sequence(1, prompts(2, 4)[1] * 3, GenerationConfig(max_new_tokens=10, mode="mirror"))
    decoder.add(first)
    gammas = []
    for step in range(200):
        if step == 6:
            assert first.state == "running" and not first.done
            decoder.add(second)
        decoder.step()
        gammas.append(decoder.gamma)
        if decoder.idle:
            break
    decoder.close()
    assert all(g > 0 for g in gammas[1:6])  # alone, it speculated
    assert gammas[6] == 0  # the step that prefilled the new prompt decoded target-only
    for seq in (first, second):
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_a_draft_of_its_own_fills_its_row_at_its_first_speculative_step(pair, mode, monkeypatch):
    """A pooled draft that is not the target's copy computes nothing while its sequence prefills (under load the
    batch decodes target-only); its first speculative step catches up on the whole text, and the texts stay equal."""
    from mirror_rt.runtime.batch.policy import AR, SPEC, Rate, SpeculationPolicy

    target, draft = pair
    # the tiny bundle's draft is the target's copy: here it is told it is not
    monkeypatch.setattr(draft, "capabilities", dataclasses.replace(draft.capabilities, reads_target_rows=False))
    policy = SpeculationPolicy(refresh=10**6)  # speculation measured faster at both batch sizes, no trials
    policy.rates = {(way, n): Rate(1000.0 if way == SPEC else 10.0, 1.0, 10, 10) for way in (AR, SPEC) for n in (1, 2)}
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=2), policy=policy)
    if not decoder.pooled:
        pytest.skip("torch drafts keep caches of their own")
    seqs = [sequence(i, p, GenerationConfig(max_new_tokens=30, mode=mode)) for i, p in enumerate(prompts(2, 5))]
    drafted = []
    for seq in seqs:
        seq.sink = lambda s, tokens, d, a: drafted.append(d)
        decoder.add(seq)
    while any(s.state != "running" for s in seqs):
        decoder.step()
    assert [int(decoder.draft_pool.lengths[s.row]) for s in seqs] == [0, 0]  # nothing drafted yet
    assert all(decoder.target_pool.lengths[s.row] >= len(s.prompt) for s in seqs)
    run(decoder, [])
    assert sum(drafted) > 0
    for seq in seqs:
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_a_self_draft_adopts_the_text_it_missed(pair, mode):
    """A draft that is the target's copy, speculating after target-only steps, takes the target's KV of the text it
    missed (the prompt included: nothing is copied for a sequence that never speculates) instead of reading it (the
    q4_1 draft reads 62 positions in 200 ms here): its first call then reads one window; the texts stay equal."""
    from mirror_rt.runtime.batch.policy import AR, SPEC, Rate, SpeculationPolicy

    target, draft = pair
    policy = SpeculationPolicy(refresh=10**6)  # target-only measured faster: no speculation, no trials
    policy.rates = {(AR, 1): Rate(1000.0, 1.0, 10, 10), (SPEC, 1): Rate(10.0, 1.0, 10, 10)}
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=1), policy=policy)
    if not (decoder.pooled and draft.capabilities.reads_target_rows):
        pytest.skip("the torch pair's draft is no copy of its target")
    seq = sequence(0, prompts(1, 6)[0], GenerationConfig(max_new_tokens=60, mode=mode, gamma=3))
    decoder.add(seq)
    while len(seq.tokens) < 25:
        decoder.step()
    assert decoder.gamma == 0 and int(decoder.draft_pool.lengths[seq.row]) == 0  # nothing yet, not even the prompt
    reads, run_rows = [], decoder.draft_pool.run
    decoder.draft_pool.run = lambda graph_index, graph, x, first, last_rows=None: (
        reads.append(x.shape[1]), run_rows(graph_index, graph, x, first, last_rows))[1]
    policy.rates[(SPEC, 1)] = Rate(10**6, 1.0, 10, 10)
    run(decoder, [])
    assert reads and max(reads) < 20, reads  # windows (and a verdict's tokens), no call over the 24 missed
    assert seq.tokens == reference(target, seq.prompt, seq.config)


# --- rows of different lengths: attention groups inside a call (exporters.exact_kv), or calls per group of rows
# and rows sorted by length (runtime.batch.splits; graphs without groups, and torch) ---


@pytest.fixture
def rotating_groups(monkeypatch):
    """Every grouped call's attention cut into as many groups as the graph takes, at rows that move from call
    to call (devices.onnxruntime.pool): each row in turn alone or beside rows of other lengths."""
    from mirror_rt.devices.onnxruntime import pool as onnxruntime_pool

    calls = {"calls": 0, "grouped": 0}

    def groups(lengths, max_groups, per_group):
        n, calls["calls"] = len(lengths), calls["calls"] + 1
        bounds = [0, *sorted({(calls["calls"] + k) % n for k in range(max_groups - 1)} - {0}), n]
        calls["grouped"] += len(bounds) > 2
        return 0.0, [(a, b - a) for a, b in zip(bounds, bounds[1:])]

    monkeypatch.setattr(onnxruntime_pool, "cheapest_groups", groups)
    return calls


def forced(decoder: BatchDecoder) -> BatchDecoder:
    """Cuts proposed at a cheap call (8 positions), and taken: they always win their trial here."""
    decoder.row_split.per_call = 8.0
    decoder.row_split.record = lambda seconds: None
    decoder.row_split.seconds = {"whole": [1.0] * TRIAL, "cut": [0.0] * TRIAL}
    decoder.row_split.rows_key = None
    original = decoder.row_split.groups

    def groups(lengths, rows_key):
        decoder.row_split.rows_key = rows_key  # keep the won trial whoever holds the rows
        return original(lengths, rows_key)

    decoder.row_split.groups = groups
    return decoder


def staggered(target, draft, mode: str, count: int = 10):
    decoder = forced(BatchDecoder(target, draft, BatchConfig(max_num_seqs=6, adaptive_speculation=False)))
    seqs = []
    for i, prompt in enumerate(prompts(count, 7)):
        long_prompt = prompt * (1 + 3 * (i % 3 == 1))  # some rows much longer than their companions
        seqs.append((i * 3, sequence(i, long_prompt, GenerationConfig(max_new_tokens=12 + 2 * i, mode=mode))))
    run(decoder, seqs)
    return decoder, seqs


def assert_rows_were_grouped(decoder: BatchDecoder, rotating: dict) -> None:
    """Bundles group rows inside their calls (never cut, never sorted; rows of pool graphs attend apart, with no
    groups to make); torch cuts its steps."""
    from mirror_rt.devices.onnxruntime.backend import ROWS_APART

    split = decoder.row_split
    if split.in_call:
        assert (rotating["grouped"] > 0 or split.in_call == ROWS_APART) and split.splits == split.sorts == 0
    else:
        assert split.splits > 0 and (split.sorts > 0 or not decoder.pooled)


@pytest.mark.parametrize("mode", ["ar", "mirror"])
def test_grouped_or_cut_rows_equal_the_reference(pair, rotating_groups, mode):
    target, draft = pair
    decoder, seqs = staggered(target, draft, mode)
    for _, seq in seqs:
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id
    if mode == "ar":  # (mirror speculates: its calls take one sequence each)
        assert_rows_were_grouped(decoder, rotating_groups)


def test_every_precision_grouped_equals_its_reference(precision_pair, rotating_groups):
    target, draft = precision_pair
    decoder, seqs = staggered(target, draft, "ar", count=8)
    for _, seq in seqs:
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id
    assert_rows_were_grouped(decoder, rotating_groups)


def test_a_row_computes_alike_in_any_group(precision_pair, monkeypatch):
    """Bitwise: a one-token step of rows 6, 20, 6 and 9 positions long, in one group (every row reads 21 keys),
    in a group per row, and in two groups; each row as its own one-row call."""
    import numpy as np

    from mirror_rt.devices.onnxruntime import pool as onnxruntime_pool

    target, _ = precision_pair
    if not target.capabilities.attention_groups:
        pytest.skip("graphs without attention groups")
    lengths = [6, 20, 6, 9]
    outputs = {}
    for name, cut in {"one": [(0, 4)], "each": [(0, 1), (1, 1), (2, 1), (3, 1)], "two": [(0, 2), (2, 2)]}.items():
        monkeypatch.setattr(onnxruntime_pool, "cheapest_groups",
                            lambda rows, *_, cut=cut: (0.0, cut if len(rows) == 4 else [(0, len(rows))]))
        pool = target.new_pool(4, 64)
        for row, n in enumerate(lengths):
            target.forward_rows(np.array([prompts(4, 9)[row][:1] * n]), pool, row, last_rows=1)
            pool.commit(row, n)
        outputs[name] = target.forward_rows(np.array([[11]] * 4), pool, 0, last_rows=1)[:, 0]
        outputs[name + " alone"] = [target.forward_rows(np.array([[11]]), pool, row, last_rows=1)[0, 0]
                                    for row in range(4)]
    for name in ("one", "each", "two"):
        for row in range(4):
            assert np.array_equal(outputs[name][row], outputs["one alone"][row]), (name, row)


def test_a_short_prompt_waits_for_no_long_prompts_whole_prefill(pair):
    """A long prompt prefilling chunk by chunk, a short one arriving a step later: the short one takes its turn
    before the long one's chunks (which still get half of every step's chunk), so its first token comes while the
    long one is still prefilling; both texts equal their references."""
    target, draft = pair
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=4, prefill_chunk=16))
    config = GenerationConfig(max_new_tokens=6, mode="ar")
    long = sequence(0, [(7 * j) % 90 + 3 for j in range(160)], config)
    short = sequence(1, [11, 12, 13, 14, 15, 16], config)
    decoder.add(long)
    decoder.step()
    decoder.add(short)
    decoder.step()
    assert short.tokens and long.state == "prefill"  # the short one's first token: 9 steps before the long one's
    run(decoder, [])
    for seq in (long, short):
        assert seq.tokens == reference(target, seq.prompt, seq.config), seq.id
