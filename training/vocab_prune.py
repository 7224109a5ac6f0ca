"""Draft vocabulary pruning: the ids most frequent in the target's own text (plus its special ids) for a draft's LM
head (models.pruned_head), a large share of a small draft's weights. A target token outside the kept set is never
proposed: pruning costs acceptance.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mirror_rt.models.pruned_head import save_kept


def token_counts(sequences, vocab_size: int) -> torch.Tensor:
    """Occurrences of each id [vocab_size] (int64) over lists of token ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in sequences:
        if len(ids):
            counts += torch.bincount(torch.as_tensor(list(ids), dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def choose_kept(counts: torch.Tensor, size: int, always=()) -> torch.Tensor:
    """The `size` ids to keep, ascending: every id of `always`, then by count, ties by lower id (in BPE vocabularies an
    earlier merge, more frequent text)."""
    vocab = counts.shape[0]
    if not 1 <= size <= vocab:
        raise ValueError(f"size must be in 1..{vocab} (the vocabulary), got {size}")
    always = sorted({int(i) for i in always})
    if always and not 0 <= always[0] <= always[-1] < vocab:
        raise ValueError(f"always-kept ids must be in 0..{vocab - 1}, got {always}")
    if len(always) > size:
        raise ValueError(f"size {size} is smaller than the {len(always)} ids that must be kept")
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[always] = True
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: ties stay in id order
    rest = order[~keep[order]][:size - len(always)]
    keep[rest] = True
    return keep.nonzero().squeeze(1)


def coverage(kept: torch.Tensor, sequences, vocab_size: int) -> tuple[float, int]:
    """(share of answer tokens inside `kept`, answer tokens) over (ids, first answer index) pairs."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[kept] = True
    answers = [t for ids, first in sequences for t in ids[first:]]
    if not answers:
        return 0.0, 0
    return inside[torch.tensor(answers, dtype=torch.long)].float().mean().item(), len(answers)


def prune_vocab_main(target: str | None = None, data=None, size: int = 16384, out: str = "draft-vocab.json",
                     cache: str | None = None, max_new_tokens: int = 96, progress: bool = True) -> dict:
    """CLI entry (`mirror-rt prune-vocab`): count the training questions' prompt and answer tokens, keep `size` ids,
    report the share of held-out answer tokens inside the kept set."""
    import time

    from mirror_rt.evaluation.specbench import question_files
    from mirror_rt.exporters.paths import check_writable
    from mirror_rt.models.default_model import cache_dir
    from mirror_rt.models.loading import load_checkpoint
    from mirror_rt.training.exit_data import answer_sequences, split

    files = question_files(data, "prune-vocab")  # inputs and the output are checked before any model loads
    check_writable(out, folder=False)
    loaded = load_checkpoint(target, cache=cache, log=lambda *a: None)
    vocab = loaded.model.config.vocab_size
    if not 1 <= size <= vocab:
        raise ValueError(f"--size must be in 1..{vocab} (the vocabulary), got {size}")
    started = time.perf_counter()
    sequences = answer_sequences(loaded.model, loaded.tokenizer, files, cache_dir(cache) / "exit-data",
                                 max_new_tokens, progress=progress)
    train, held_out = split(sequences)
    always = tuple(i for i in loaded.tokenizer.special_ids if i < vocab)
    kept = choose_kept(token_counts([ids for ids, _ in train], vocab), size, always)
    held, answer_tokens = coverage(kept, held_out, vocab)
    names = ", ".join(Path(f).name for f in files)
    source = f"prune-vocab: {Path(loaded.source).name}, {len(train)} questions of {names}"
    path = save_kept(out, kept, vocab, source)
    return {"out": str(path), "vocab_size": vocab, "size": size, "always_kept": list(always),
            "train_sequences": len(train), "held_out_sequences": len(held_out),
            "held_out_answer_tokens": answer_tokens,  # none held out: null, not a coverage of 0
            "held_out_coverage": round(held, 4) if answer_tokens else None,
            "train_coverage": round(coverage(kept, train, vocab)[0], 4),
            "seconds": round(time.perf_counter() - started, 1)}
