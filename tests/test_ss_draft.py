"""Speculative Streaming draft: masks, an unchanged main stream, exact stream-verified rollouts."""

import pytest
import torch
from conftest import tiny_target

from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.models.ss_draft import (
    StreamDraft,
    load_streams,
    stream_mask,
)
from mirror_rt.runtime.reference import generate


def test_mask_no_future_no_later_stream():
    start, T, S = 3, 3, 2
    m = stream_mask(start, T, S)
    L = start + T
    for p in range(T):
        assert m[p, :start + p + 1].all() and not m[p, start + p + 1:].any()  # main: causal, no streams
        for j in range(S):
            row = T + p * S + j
            assert m[row, :start + p + 1].all() and not m[row, start + p + 1:L].any()  # no future token
            for p2 in range(T):
                for j2 in range(S):
                    assert bool(m[row, L + p2 * S + j2]) == (p2 == p and j2 <= j)  # no later stream


def test_main_stream_is_the_base_draft():
    base = tiny_target(seed=3)
    draft = StreamDraft(base, n_streams=2, n_stream_layers=2)
    with torch.no_grad():
        for p in draft.stream_layers.parameters():
            p.normal_(0, 0.5)  # trained-looking stream weights must not touch the main rows
    tokens = torch.tensor([5, 9, 14, 3, 7])
    main, streams = draft.forward_streams(tokens, new_cache(base, 8))
    expected = base(tokens, new_cache(base, 8))
    assert torch.allclose(main, expected, atol=1e-10) and streams.shape == (5, 2, base.config.vocab_size)


def test_stream_verified_rollout_equals_draft_greedy():
    """A draft row's line over SS streams is the draft's own greedy continuation at temperature 0, whatever the
    (random) stream guesses it feeds and checks, in at most one forward a token."""
    from mirror_rt.devices.torch.backend import TorchModel, TorchStreamDraft
    from mirror_rt.runtime.config import GenerationConfig
    from mirror_rt.runtime.mirror.draft_row import DraftConfig, DraftRow

    for seed in range(3):
        base = tiny_target(seed=seed)
        draft = StreamDraft(base, n_streams=2, n_stream_layers=2)
        with torch.no_grad():
            for p in draft.stream_layers.parameters():
                p.normal_(0, 0.3)
        context = [(seed * 5 + i * 7) % 90 + 2 for i in range(6)]
        expected = [t for step in generate(TorchModel(base), context, 31) for t in step]
        model = TorchStreamDraft(draft)
        row = DraftRow(model, model.new_cache(64), context, GenerationConfig(gamma=31, draft_lookup=0),
                       DraftConfig(stream_confidence=0.0))
        assert row.draft_window(31) == expected and row.stats.forwards <= 31


def test_confident_guesses_keep_the_leading_likely_streams():
    """A stream's guess is fed only when likely enough, and never after an unlikely one."""
    import numpy as np

    from mirror_rt.runtime.mirror.draft_row import confident_guesses

    rows = np.log(np.array([[0.9, 0.05, 0.05], [0.1, 0.45, 0.45], [0.0001, 0.0001, 0.9998]]))
    assert confident_guesses(rows, 0.2) == [0, 1, 2]  # 0.9, 0.45 (the first of the tied tokens), 0.9998
    assert confident_guesses(rows, 0.5) == [0]  # the second stream is unlikely: the third is dropped too
    assert confident_guesses(rows, 0.95) == []
    assert confident_guesses(rows[1:2], 0.5) == []


def _pattern_data(n=24, length=40, seed=0):
    """Sequences from a repeating pattern: stream lookahead is learnable on them."""
    import random

    rng = random.Random(seed)
    seqs = []
    for _ in range(n):
        period = [rng.randrange(2, 90) for _ in range(rng.randrange(3, 6))]
        ids = (period * length)[:length]
        seqs.append((ids, 6))
    return seqs


def test_training_lowers_loss_and_round_trips(tmp_path):
    from mirror_rt.models.ss_draft import load_streams
    from mirror_rt.training.ss_training import stream_loss, train_streams

    base = tiny_target(seed=4)
    draft = StreamDraft(base, n_streams=2, n_stream_layers=2, rank=8)
    data = _pattern_data()
    before = sum(stream_loss(draft, torch.tensor(ids), first).item() for ids, first in data[:6])
    train_streams(draft, data, steps=60, out_dir=tmp_path / "ss", lr=5e-3, seed=1, save_every=30, progress=False)
    with torch.no_grad():
        after = sum(stream_loss(draft, torch.tensor(ids), first).item() for ids, first in data[:6])
    assert after < 0.8 * before
    loaded = load_streams(tiny_target(seed=4), tmp_path / "ss")
    tokens = torch.tensor(data[0][0][:12])
    with torch.no_grad():
        a = draft.forward_streams(tokens, new_cache(base, 12))[1]
        b = loaded.forward_streams(tokens, new_cache(loaded.base, 12))[1]
    assert torch.allclose(a, b, atol=1e-9)


def test_training_is_deterministic_and_resumes(tmp_path):
    from mirror_rt.training.checkpoints import loss_summary
    from mirror_rt.training.ss_training import train_streams, trained_steps

    data = _pattern_data(n=8)
    full = train_streams(StreamDraft(tiny_target(seed=5), rank=4), data, 20, tmp_path / "a", seed=3,
                         save_every=10, progress=False)
    train_streams(StreamDraft(tiny_target(seed=5), rank=4), data, 10, tmp_path / "b", seed=3, save_every=10,
                  progress=False)
    resumed = train_streams(StreamDraft(tiny_target(seed=5), rank=4), data, 20, tmp_path / "b", seed=3,
                            save_every=10, progress=False)
    assert resumed == pytest.approx(full[10:], rel=1e-6)
    again = train_streams(StreamDraft(tiny_target(seed=5), rank=4), data, 15, tmp_path / "b", seed=3,
                          save_every=10, progress=False)  # fewer steps than the folder holds: nothing to train
    assert again == [] and trained_steps(tmp_path / "b") == 20 and loss_summary(again)["final_loss"] is None  # not 0.0
    with pytest.raises(ValueError, match="holds streams trained with another shape"):  # a size-mismatch traceback
        train_streams(StreamDraft(tiny_target(seed=5), n_streams=3, rank=4), data, 30, tmp_path / "b", seed=3,
                      save_every=10, progress=False)
    with pytest.raises(ValueError, match=r"another shape \(2 streams, 2 stream layers, rank 4\)"):  # torch's words
        train_streams(StreamDraft(tiny_target(seed=5), n_stream_layers=3, rank=4), data, 30, tmp_path / "b",
                      seed=3, save_every=10, progress=False)


def test_a_diverged_training_stops_and_writes_no_non_finite_streams(tmp_path, monkeypatch):
    """A NaN loss (`--lr inf` gave one; the CLI now refuses that) went on to an all-NaN artifact that every later
    command ran; the training now stops at that step, before the optimizer applies it."""
    from mirror_rt.training import ss_training

    data = _pattern_data(n=8)
    ss_training.train_streams(StreamDraft(tiny_target(seed=5), rank=4), data, 4, tmp_path / "s", seed=3,
                              save_every=2, progress=False)
    real = ss_training.stream_loss
    calls = []

    def diverging(*args):
        calls.append(1)
        return real(*args) * (float("nan") if len(calls) == 2 else 1.0)

    monkeypatch.setattr(ss_training, "stream_loss", diverging)
    with pytest.raises(ValueError, match="the training diverged at step 6: the loss is nan"):
        ss_training.train_streams(StreamDraft(tiny_target(seed=5), rank=4), data, 8, tmp_path / "s", seed=3,
                                  save_every=1, progress=False)
    assert load_streams(tiny_target(seed=5), tmp_path / "s").stream_embed.isfinite().all()


@pytest.mark.parametrize("options, says", [({"n_streams": 1000}, "--streams must be in 1..16"),
                                           ({"rank": 100000}, "--rank must be in 1..")])
def test_stream_shapes_beyond_reason_are_refused(options, says):
    """1000 streams were killed for memory; a rank of 100000 filled the disk."""
    with pytest.raises(ValueError, match=says):
        StreamDraft(tiny_target(seed=5), **options)


def test_replay_counts_forwards():
    """Perfect guesses (2 streams): 1 forward for the first token, then 3 tokens per forward."""
    from mirror_rt.training.ss_training import _replay

    ids = list(range(10, 40))
    guess = torch.tensor([[ids[t + 2], ids[t + 3]] if t + 3 < len(ids) else [0, 0] for t in range(len(ids))])
    assert _replay(guess, ids, 5, 7) == 3  # 1 + 3 + 3 tokens
    wrong = torch.zeros_like(guess)
    assert _replay(wrong, ids, 5, 7) == 7


def _saved_streams(folder, draft) -> None:
    import json

    from safetensors.torch import save_file

    from mirror_rt.models.ss_draft import stream_config

    folder.mkdir()
    own = {k: v.contiguous() for k, v in draft.state_dict().items() if not k.startswith("base.")}
    save_file(own, str(folder / "streams.safetensors"))
    (folder / "streams.json").write_text(json.dumps(stream_config(draft)))


def test_streams_load_over_an_int8_copy_and_refuse_non_finite_weights(tmp_path):
    """`run --draft-streams DIR` over the default draft (an int8 copy of the target): loading the whole state dict
    reached the quantized base modules, which raised KeyError '...q_proj.scale' (a traceback). And streams whose
    training diverged (NaN or inf) are refused by name, not run at a mean accepted length of 1."""
    from mirror_rt.models.quantize import int8_copy
    from mirror_rt.models.ss_draft import load_streams

    base = tiny_target(seed=3)
    trained = StreamDraft(base, n_streams=2, n_stream_layers=2)
    with torch.no_grad():
        for p in trained.stream_layers.parameters():
            p.normal_(0, 0.5)
    _saved_streams(tmp_path / "ok", trained)
    loaded = load_streams(int8_copy(base), tmp_path / "ok")
    pairs = zip(loaded.stream_layers.parameters(), trained.stream_layers.parameters())
    assert all(torch.allclose(a.double(), b.double(), atol=1e-6) for a, b in pairs)  # the int8 copy runs fp32
    with torch.no_grad():
        trained.stream_embed[0, 0] = float("nan")
    _saved_streams(tmp_path / "nan", trained)
    with pytest.raises(ValueError, match="stream weights are not finite"):
        load_streams(base, tmp_path / "nan")


def test_the_loss_summary_never_mixes_the_first_and_last_steps():
    """first_loss was the mean of the first 10 steps and final_loss of the last 20: under 20 steps they shared
    steps (train-exit's were equal under 10), and neither said what it averaged."""
    from mirror_rt.training.checkpoints import loss_summary

    assert loss_summary([5.0, 4.0, 3.0, 2.0]) == {"first_loss": 4.5, "final_loss": 2.5, "loss_mean_over_steps": 2}
    losses = [float(i) for i in range(100, 0, -1)]
    assert loss_summary(losses) == {"first_loss": 90.5, "final_loss": 10.5, "loss_mean_over_steps": 20}
    assert loss_summary([3.0]) == {"first_loss": 3.0, "final_loss": 3.0, "loss_mean_over_steps": 1}
    assert loss_summary([])["first_loss"] is None


def test_tensor_files_are_as_readable_as_the_json_beside_them(tmp_path):
    """safetensors writes 0600: streams, adapters and torch bundles copied for another account could not be read."""
    import os

    from mirror_rt.models.tensor_files import save_tensors

    old = os.umask(0o022)
    try:
        save_tensors({"x": torch.zeros(2)}, tmp_path / "t.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "t.safetensors").stat().st_mode & 0o777 == 0o644
