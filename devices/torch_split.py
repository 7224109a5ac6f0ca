"""Torch target split at the early-exit layer: prefix (layers < exit) and suffix (the rest).

`forward_prefix` runs the embeddings and layers 0..exit-1 over a window and returns, per
position, the early-exit top-kappa ids and log-probs (the target's own final norm and LM
head applied to the exit hidden state, after a trained `ExitAdapter` when one is given: it
changes which branches the draft precomputes, never the output). The hidden state stays here until
`forward_suffix` finishes the window. `forward` composes both, so the object is also a plain
`LoadedModel` and the same weights serve every mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from mirror_rt.devices.torch_backend import TorchModel
from mirror_rt.models.exit_adapter import cached_exit_logits, check_compatible


class TorchSplitTarget(TorchModel):
    """A torch target with an early exit after layer `exit_layer` (1-based count of layers)."""

    def __init__(self, model, exit_layer: int | None = None, kappa: int = 8, device: str = "cpu",
                 exit_adapter=None):
        super().__init__(model, device)
        n = model.config.n_layers
        self.exit_layer = n // 2 if exit_layer is None else exit_layer
        if not 1 <= self.exit_layer < n:
            raise ValueError(f"--exit-layer must be in 1..{n - 1} for a {n}-layer target, got {self.exit_layer}")
        if not 1 <= kappa <= model.config.vocab_size:
            raise ValueError(f"--kappa must be in 1..{model.config.vocab_size}, got {kappa}")
        self.kappa = kappa
        if exit_adapter is not None:
            check_compatible(exit_adapter, model, self.exit_layer)
            p = self.model.embed_tokens.weight
            exit_adapter = exit_adapter.to(device=p.device, dtype=p.dtype).eval()
        self.exit_adapter = exit_adapter  # models.exit_adapter.ExitAdapter or None (untrained exit)
        self._hidden = None  # [T, hidden] between prefix and suffix

    @torch.inference_mode()
    def forward_prefix(self, tokens: Sequence[int], cache) -> tuple[np.ndarray, np.ndarray]:
        """Layers 0..exit-1 over tokens [T]; returns exit top-kappa ids [T, kappa] and log-probs [T, kappa]."""
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)
        h = self.model.run_layers(self.model.embed(ids), cache, 0, self.exit_layer, cache_first=0)
        self._hidden = h
        last = self.exit_layer - 1  # an attention adapter reads this layer's keys (this window's rows written)
        logits = cached_exit_logits(self.model, h, self.exit_adapter, cache.keys[last], cache.values[last],
                                    cache.length)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logprobs, self.kappa, dim=-1)
        return top.indices.cpu().numpy(), top.values.cpu().numpy()

    @torch.inference_mode()
    def forward_prefix_only(self, tokens: Sequence[int], cache) -> None:
        """Layers 0..exit-1 without the early exit (when Mirror switches it off)."""
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)
        self._hidden = self.model.run_layers(self.model.embed(ids), cache, 0, self.exit_layer, cache_first=0)

    @torch.inference_mode()
    def forward_suffix(self, cache) -> np.ndarray:
        """Remaining layers, final norm, LM head over the window of the last prefix call -> logits [T, vocab]."""
        h, self._hidden = self._hidden, None
        h = self.model.run_layers(h, cache, self.exit_layer, self.model.config.n_layers, cache_first=0)
        cache.advance(h.shape[0])
        logits = self.model.logits(h)
        return (logits if logits.dtype in (torch.float32, torch.float64) else logits.float()).cpu().numpy()
