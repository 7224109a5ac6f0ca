"""Training text for Speculative Streaming streams: the target's own greedy answers.

The answers are shared with `train-exit` (same cache folder and key, `models.exit_data`):
whichever command runs first generates them, the other reuses them. Each sequence is the
chat prompt followed by the answer; questions are split train / held-out by file order
(every 5th held out), so evaluation never sees training text.
"""

from __future__ import annotations

from pathlib import Path

from mirror_rt.training import exit_data


def answer_sequences(model, tokenizer, data_files, folder: Path, max_new_tokens: int = 96,
                     max_prompt_tokens: int = 128, progress: bool = True,
                     held_out: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, index of the first answer token) per question, in file order. `held_out`: only the
    first that many held-out questions (`split`'s), answered alone where the answers of all are not cached yet."""
    key = exit_data.data_key(model, data_files, max_new_tokens, max_prompt_tokens)
    prompts = exit_data.first_turn_prompts(tokenizer, data_files, max_prompt_tokens)
    path = Path(folder) / f"{key}.answers.jsonl"
    if held_out is None or path.is_file():
        sequences = _answered(model, tokenizer, path, prompts, max_new_tokens, progress)
        return sequences if held_out is None else split(sequences)[1][:held_out]
    some = split(prompts)[1][:held_out]
    return _answered(model, tokenizer, Path(folder) / f"{key}.held-out-{held_out}.answers.jsonl", some,
                     max_new_tokens, progress)


def _answered(model, tokenizer, path: Path, prompts: list, max_new_tokens: int, progress: bool) -> list:
    """The target's greedy answers to `prompts`, read from `path` or computed (in batches) and saved there."""
    from tqdm import tqdm

    answers = exit_data._read_answers(path, prompts)
    if answers is None:
        eos = tuple(getattr(tokenizer, "eos_token_ids", ()))
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
        found = {}
        with tqdm(total=len(prompts), desc="target answers", unit="answer", disable=not progress) as bar:
            for batch in exit_data._batches(order, 16):
                rows = exit_data.decode_batch(model, [prompts[i][1] for i in batch], 1, max_new_tokens, None, eos)
                found.update((i, row[0]) for i, row in zip(batch, rows))
                bar.update(len(batch))
        answers = [found[i] for i in range(len(prompts))]
        path.parent.mkdir(parents=True, exist_ok=True)
        exit_data._write_answers(path, prompts, answers, tokenizer)
    return [(list(p) + list(a), len(p)) for (_, p), a in zip(prompts, answers)]


def split(sequences: list, every: int = 5) -> tuple[list, list]:
    """(train, held_out): every `every`-th sequence is held out."""
    return ([s for i, s in enumerate(sequences) if i % every != every - 1],
            [s for i, s in enumerate(sequences) if i % every == every - 1])
