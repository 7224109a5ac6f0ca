"""`mirror-rt eval-draft`: rollouts as the runtime drafts them, acceptance against the text, side by side."""

import pytest
import torch
from conftest import perturbed_copy, tiny_target

from mirror_rt.devices.torch.backend import TorchModel, TorchStreamDraft
from mirror_rt.models.ss_draft import StreamDraft
from mirror_rt.runtime.reference import generate
from mirror_rt.training.draft_eval import (
    DraftRow,
    evaluate_drafts,
    format_rows,
    greedy_rollout,
)


def _greedy(model, context, n):
    return [t for step in generate(TorchModel(model), context, n) for t in step]


def _sure_streams(base, seed):
    """Streams with random weights made confident (large embeddings), so their guesses are fed."""
    draft = StreamDraft(base, n_streams=2, n_stream_layers=2, rank=4)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embed = draft.stream_embed
        embed.copy_(torch.randn(embed.shape, generator=gen, dtype=embed.dtype) * 3)
    return TorchStreamDraft(draft)


@pytest.mark.parametrize("seed", range(3))
def test_rollout_is_the_drafts_greedy_continuation(seed):
    """Plain, SS and oracle-guessing rollouts all give the draft's own greedy tokens; the cache is left
    holding the context plus what was fed, so rolling back restores the context exactly."""
    base = tiny_target(seed=seed)
    context = [(seed * 5 + i * 7) % 90 + 2 for i in range(8)]
    expected = _greedy(base, context, 7)
    text = expected[:1] + [(expected[1] + 1) % 97] + expected[2:]  # the oracle's first guess is wrong
    cases = [(TorchModel(base), None), (_sure_streams(base, seed), None), (_sure_streams(base, seed), text)]
    for draft, oracle in cases:
        cache = draft.new_cache(32)
        draft.forward(context[:-1], cache)
        tokens, times = greedy_rollout(draft, cache, context, 7, oracle=oracle)
        assert tokens == expected and 1 <= len(times) <= 7
        cache.rollback(len(context) - 1)
        again, _ = greedy_rollout(draft, cache, context, 7, draft_lookup=3)
        assert again == expected


def test_oracle_guesses_save_forwards_and_plain_costs_gamma():
    base = tiny_target(seed=4)
    context = [3, 14, 15, 92, 65, 35]
    expected = _greedy(base, context, 7)
    counts = {}
    for name, draft, oracle in [("plain", TorchModel(base), None), ("oracle", _sure_streams(base, 4), expected)]:
        cache = draft.new_cache(32)
        draft.forward(context[:-1], cache)
        counts[name] = len(greedy_rollout(draft, cache, context, 7, oracle=oracle)[1])
    # oracle, 2 streams: 1 token, then 3 per forward (the window's last token is never guessed): 1 + 3 + 3
    assert counts == {"plain": 7, "oracle": 3}


@pytest.mark.parametrize("seed", [11, 5, 6])
def test_prompt_lookup_guesses_keep_the_tokens_and_save_forwards_when_right(seed):
    """Lookup guesses from a context that repeats itself: always the draft's own greedy tokens; with
    lookup off a rollout costs gamma forwards. Seed 11's model repeats one token, so every guess is right."""
    base = tiny_target(seed=seed)
    prompt = [4, 8, 15, 16, 23, 42]
    context = prompt + _greedy(base, prompt, 12) + prompt
    expected = _greedy(base, context, 7)
    forwards = {}
    for lookup in (0, 3):
        draft = TorchModel(base)
        cache = draft.new_cache(64)
        draft.forward(context[:-1], cache)
        tokens, times = greedy_rollout(draft, cache, context, 7, draft_lookup=lookup)
        assert tokens == expected
        forwards[lookup] = len(times)
    assert forwards[0] == 7
    if seed == 11:
        assert forwards[3] == 3  # 1 + 3 guesses; 1 + 1 (the latest match runs into the end); the last token


def test_accepted_length_and_row_totals():
    from mirror_rt.runtime.acceptance import matched  # greedy acceptance, as eval-draft counts it

    assert matched([5, 9, 2], [5, 9, 4]) == 2
    assert matched([5, 9], [5, 9]) == 2 and matched([1], [2]) == 0
    row = DraftRow("d", gamma=3)
    row.add(3, [0.01] * 3)
    row.add(1, [0.02] * 3)
    row.add(0, [0.01] * 3)
    s = row.summary()
    # position 1: 3 windows reached, 2 matched; position 2: 2 reached, 1 matched; position 3: 1 reached, 1 matched
    assert s["acceptance_per_position"] == [round(2 / 3, 3), 0.5, 1.0]
    assert s["mean_accepted_length"] == round(1 + 4 / 3, 3) and s["forwards_per_window"] == 3.0
    assert s["ms_per_window"] == pytest.approx(40.0)


def test_side_by_side_rows_on_greedy_text():
    """The target itself as a draft accepts every window of its own greedy text; a noisy copy does not."""
    target = tiny_target(seed=0)
    prompts = [[2, 7, 19, 40], [11, 3, 5], [60, 61, 62, 63, 64]]
    sequences = [(p + _greedy(target, p, 24), len(p)) for p in prompts]
    drafts = {"self": TorchModel(target), "noisy": TorchModel(perturbed_copy(target, noise=0.6, seed=2))}
    rows = evaluate_drafts(drafts, sequences, gammas=(4,), stride=3, progress=False)
    self_row, noisy = rows
    assert self_row["draft"] == "self" and self_row["mean_accepted_length"] == 5.0
    assert self_row["acceptance_per_position"] == [1.0] * 4 and self_row["rollout_vs_first"] == 1.0
    assert noisy["windows"] == self_row["windows"] == 3 * len(range(0, 24 - 4 + 1, 3))
    assert noisy["mean_accepted_length"] < 5.0


def _questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "category": "c", "turns": ["hi"]}\n')
    return str(path)


def test_cli_refuses_a_missing_bundle(tmp_path, capsys):
    from mirror_rt.cli import main

    assert main(["eval-draft", "--bundle", "/nonexistent/bundle", "--target", "tiny",
                 "--data", _questions(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mirror-rt: error:") and "/nonexistent/bundle" in err[0]


def test_cli_refuses_missing_question_files(tmp_path, capsys):
    """Data never defaults to a path outside the package: a missing file is one line, before any model loads."""
    from mirror_rt.cli import main

    assert main(["eval-draft", "--bundle", "/b", "--target", "tiny", "--data", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mirror-rt: error: question file not found: {tmp_path / 'none.jsonl'}"]


@pytest.mark.parametrize("args, says", [(["--gamma", "1000"], "--gamma must be in 1..64, got 1000"),
                                        (["--data", "EMPTY"], "eval-draft: no questions in")])
def test_cli_refuses_what_cannot_be_measured(tmp_path, capsys, args, says):
    """A window longer than any request may ask for, or a file without questions: one line (a TypeError in the
    table came out of both)."""
    from mirror_rt.cli import main

    (tmp_path / "empty.jsonl").write_text("")
    args = [str(tmp_path / "empty.jsonl") if a == "EMPTY" else a for a in args]
    data = [] if "--data" in args else ["--data", _questions(tmp_path)]
    assert main(["eval-draft", "--bundle", "/b", "--target", "tiny", *data, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_a_table_without_windows_shows_dashes():
    table = format_rows([{**DraftRow("d", gamma=40).summary(), "rollout_vs_first": None}])
    assert "| d | 40 | 0 |" in table and "None" not in table


def test_cli_refuses_a_draft_of_another_vocabulary(tmp_path, capsys):
    """A bundle of a 64-token model against the 258-token `tiny` target: one line naming both sizes."""
    from conftest import write_hf_folder

    from mirror_rt.cli import main
    from mirror_rt.exporters.export import export_bundle

    bundle = export_bundle(str(write_hf_folder(tmp_path / "hf", vocab_size=64)), tmp_path / "b", fmt="torch",
                           progress=False)
    assert main(["eval-draft", "--bundle", str(bundle), "--target", "tiny", "--data", _questions(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mirror-rt: error: {bundle}: the draft has 64 tokens, the target 258"]


class _CharTokenizer:
    """Characters as token ids (a vocabulary of 97): enough for the answer cache's prompts."""

    eos_token_ids = ()

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 97 for c in text]

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)

    def chat_prompt(self, messages):
        return self.encode(messages[0]["content"])


def test_held_out_questions_alone_are_answered(tmp_path, monkeypatch):
    """eval-draft --questions 2 answered every question of --data before measuring 2 of them; it now answers those 2,
    and takes the same ones from the answers of all where those are cached (train-draft's)."""
    import json

    from mirror_rt.training import exit_data
    from mirror_rt.training.exit_data import answer_sequences, split

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"question number {i}?"]}) + "\n"
                            for i in range(20)))
    answered, decode = [], exit_data.decode_batch
    monkeypatch.setattr(exit_data, "decode_batch", lambda m, prompts, *a, **k: answered.extend(prompts) or decode(
        m, prompts, *a, **k))
    model, tokenizer = tiny_target(seed=4), _CharTokenizer()
    some = answer_sequences(model, tokenizer, [data], tmp_path / "cache", 6, progress=False, held_out=2)
    assert len(answered) == 2 and len(some) == 2
    every = answer_sequences(model, tokenizer, [data], tmp_path / "cache", 6, progress=False)
    assert len(answered) == 22 and [s[0][:s[1]] for s in split(every)[1][:2]] == [s[0][:s[1]] for s in some]
    cached = answer_sequences(model, tokenizer, [data], tmp_path / "cache", 6, progress=False, held_out=2)
    assert len(answered) == 22 and cached == split(every)[1][:2]
