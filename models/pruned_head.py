"""A draft's LM head over a kept set of token ids, and the kept-ids file format.

The draft computes its head over K kept ids only and maps the result back to the full vocabulary
with -inf everywhere else (`PrunedHeadDraft`). Ids map back exactly: the draft's logits at kept ids
are the unpruned model's, its argmax is kept[argmax of the pruned logits], and its softmax is 0
outside the kept set, so a draft token is always a kept id and speculative sampling stays lossless.
Kept sets travel as JSON (`save_kept` / `load_kept`); `mirror-rt prune-vocab` (training.vocab_prune)
chooses one and `mirror-rt export --draft-vocab FILE` puts it in the draft graph.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


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

    def run_layers(self, *args, **kwargs) -> torch.Tensor:
        return self.base.run_layers(*args, **kwargs)

    def pruned_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and the pruned head: hidden [T, hidden] -> logits [T, K] (column j is id kept[j])."""
        return self.head(self.norm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> full-vocabulary logits [..., vocab], -inf at ids not kept."""
        padded = F.pad(self.pruned_logits(h), (0, 1), value=float("-inf"))
        return torch.index_select(padded, -1, self.inverse)  # rows of any rank (batched graphs: [B, T, K+1])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """tokens [T] at positions cache.length.. -> logits [T, vocab]; advances the cache by T."""
        h = self.base.run_layers(self.embed(tokens), cache)
        cache.advance(tokens.shape[0])
        return self.logits(h)
