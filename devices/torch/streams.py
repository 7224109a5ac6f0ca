"""Torch backend for a Speculative Streaming draft (`models.ss_draft.StreamDraft`).

`forward` is the plain draft (the main stream); `forward_streams` also returns the lookahead
streams' logits, which the Mirror draft worker uses to confirm several tokens per forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from mirror_rt.devices.torch.backend import TorchModel


class TorchStreamDraft(TorchModel):
    """A `LoadedModel` over a StreamDraft, with `forward_streams` and `n_streams`."""

    def __init__(self, draft, device: str = "cpu"):
        super().__init__(draft.base, device)
        self.streams = draft.to(self.device).eval()
        self.n_streams = draft.n_streams
        self.capabilities = replace(self.capabilities, streams=True)

    @torch.inference_mode()
    def forward_streams(self, tokens: Sequence[int], cache) -> tuple[np.ndarray, np.ndarray]:
        """tokens [T] -> main logits [T, vocab], stream logits [T, n_s, vocab]; advances the cache by T."""
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)
        main, streams = self.streams.forward_streams(ids, cache)
        return main.float().cpu().numpy(), streams.float().cpu().numpy()
