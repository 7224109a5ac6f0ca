"""Draft vocabulary pruning: the draft's LM head over the target's most frequent tokens only.

The LM head of a small model is a large share of its weights (SmolLM2-135M: 49152 x 576, about a
third of the q4_1 draft's weight bytes: an int8 head beside 4-bit layers). A draft only has to propose the tokens the target will
produce, and those concentrate on a small part of the vocabulary, so the draft may compute its
head over a kept set of K ids (`choose_kept`: the ids most frequent in the target's own text,
plus its special ids) and map the result back to the full vocabulary with -inf everywhere else
(`PrunedHeadDraft`). Ids map back exactly: the draft's logits at kept ids are the unpruned
model's, its argmax is kept[argmax of the pruned logits], and its softmax is 0 outside the kept
set, so a draft token is always a kept id and speculative sampling stays lossless (q = 0 there).
What pruning costs is acceptance: a target token outside the kept set is never proposed.
Kept sets travel as JSON (`save_kept` / `load_kept`); `mirror-rt prune-vocab` makes one and
`mirror-rt export --draft-vocab FILE` puts it in the draft graph.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def token_counts(sequences, vocab_size: int) -> torch.Tensor:
    """Occurrences of each id [vocab_size] (int64) over lists of token ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in sequences:
        if len(ids):
            counts += torch.bincount(torch.as_tensor(list(ids), dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def choose_kept(counts: torch.Tensor, size: int, always=()) -> torch.Tensor:
    """The `size` ids to keep, ascending: every id of `always`, then by count, ties by lower id.

    Lower ids first on ties (and for never-seen ids): in BPE vocabularies they are earlier merges,
    i.e. more frequent text.
    """
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


def save_kept(path, kept, vocab_size: int, source: str = "") -> Path:
    """Write {"vocab_size", "kept", "source"} to `path` (JSON); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = [int(i) for i in kept]
    path.write_text(json.dumps({"vocab_size": vocab_size, "kept": ids, "source": source}) + "\n")
    return path


def load_kept(path, vocab_size: int) -> torch.Tensor:
    """The kept ids of `path` (int64, ascending), checked against a model of `vocab_size` tokens.

    Raises ValueError with a one-line message naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: not found (make one with mirror-rt prune-vocab)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a vocabulary file ({type(exc).__name__})") from None
    kept = data.get("kept") if isinstance(data, dict) else None
    if not isinstance(kept, list) or not kept or not all(type(i) is int for i in kept):
        raise ValueError(f"{path}: 'kept' must be a non-empty list of token ids")
    if data.get("vocab_size") != vocab_size:
        raise ValueError(f"{path}: made for a vocabulary of {data.get('vocab_size')} tokens, "
                         f"the model has {vocab_size}")
    if any(b <= a for a, b in pairwise(kept)):
        raise ValueError(f"{path}: 'kept' must be sorted ascending without repeats")
    if not 0 <= kept[0] <= kept[-1] < vocab_size:
        raise ValueError(f"{path}: 'kept' ids must be in 0..{vocab_size - 1}")
    return torch.tensor(kept, dtype=torch.long)


def coverage(kept: torch.Tensor, sequences, vocab_size: int) -> tuple[float, int]:
    """(share of answer tokens inside `kept`, answer tokens) over (ids, first answer index) pairs."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[kept] = True
    answers = [t for ids, first in sequences for t in ids[first:]]
    if not answers:
        return 0.0, 0
    return inside[torch.tensor(answers, dtype=torch.long)].float().mean().item(), len(answers)


class PrunedHeadDraft(nn.Module):
    """A draft as the graph exporters see it, with its LM head over `kept` rows only.

    Shares every weight of `model` but the head, whose kept rows are copied. `logits` returns
    full-vocabulary logits [T, vocab] with -inf at every id not kept (traceable: a -inf column
    appended, then one gather through the inverse map of length vocab).
    """

    def __init__(self, model, kept):
        super().__init__()
        self.base, self.config = model, model.config
        self.embed_tokens, self.layers, self.norm = model.embed_tokens, model.layers, model.norm
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)
        kept = torch.as_tensor(kept, dtype=torch.long, device=model.lm_head.weight.device)
        self.register_buffer("kept", kept, persistent=False)
        self.head_size = kept.shape[0]
        w = model.lm_head.weight
        self.head = nn.Linear(w.shape[1], self.head_size, bias=False, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            self.head.weight.copy_(w[kept])
        inverse = torch.full((model.config.vocab_size,), self.head_size, dtype=torch.long, device=w.device)
        inverse[kept] = torch.arange(self.head_size, device=w.device)  # kept id -> its column, others -> -inf
        self.register_buffer("inverse", inverse, persistent=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.base.embed(tokens)

    def pruned_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and the pruned head: hidden [T, hidden] -> logits [T, K] (column j is id kept[j])."""
        return self.head(self.norm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> full-vocabulary logits [T, vocab], -inf at ids not kept."""
        padded = F.pad(self.pruned_logits(h), (0, 1), value=float("-inf"))
        return torch.index_select(padded, 1, self.inverse)

    def new_cache(self, capacity: int, first: int = 0, last: int | None = None):
        return self.base.new_cache(capacity, first, last)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """tokens [T] at positions cache.length.. -> logits [T, vocab]; advances the cache by T."""
        h = self.base.run_layers(self.embed(tokens), cache)
        cache.advance(tokens.shape[0])
        return self.logits(h)


def prune_vocab_main(target: str | None = None, data=None, size: int = 16384, out: str = "draft-vocab.json",
                     cache: str | None = None, max_new_tokens: int = 96, progress: bool = True) -> dict:
    """CLI entry (`mirror-rt prune-vocab`): count the target's own text, keep `size` ids, report coverage.

    Counts prompt and answer tokens of the training questions; coverage is the share of held-out
    answer tokens (questions never counted) inside the kept set.
    """
    import time

    from mirror_rt.models.default_model import cache_dir
    from mirror_rt.models.exit_training import DEFAULT_DATA
    from mirror_rt.models.loading import load_checkpoint
    from mirror_rt.models.ss_data import answer_sequences, split

    loaded = load_checkpoint(target, cache=cache, log=lambda *a: None)
    vocab = loaded.model.config.vocab_size
    if not 1 <= size <= vocab:
        raise ValueError(f"--size must be in 1..{vocab} (the vocabulary), got {size}")
    files = [str(f) for f in (data or (DEFAULT_DATA,))]
    started = time.perf_counter()
    sequences = answer_sequences(loaded.model, loaded.tokenizer, files, cache_dir(cache) / "exit-data",
                                 max_new_tokens, progress=progress)
    train, held_out = split(sequences)
    always = tuple(i for i in loaded.tokenizer.special_ids if i < vocab)
    kept = choose_kept(token_counts([ids for ids, _ in train], vocab), size, always)
    held, answer_tokens = coverage(kept, held_out, vocab)
    source = f"prune-vocab: {Path(loaded.source).name}, {len(train)} questions of {', '.join(Path(f).name for f in files)}"
    path = save_kept(out, kept, vocab, source)
    return {"out": str(path), "vocab_size": vocab, "size": size, "always_kept": list(always),
            "train_sequences": len(train), "held_out_sequences": len(held_out),
            "held_out_answer_tokens": answer_tokens, "held_out_coverage": round(held, 4),
            "train_coverage": round(coverage(kept, train, vocab)[0], 4), "seconds": round(time.perf_counter() - started, 1)}
