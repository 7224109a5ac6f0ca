"""Training the Speculative Streaming streams of a draft (parameter-efficient distillation).

Only the stream parameters train (stream embeddings and the stream rows' LoRA); the base
draft is frozen, so its own predictions (the main stream) never change. Data: token
sequences of the target's own text (prompt + its greedy answer). Loss: the mean over
streams j of CE(stream j at position t, token t + 2 + j) on answer positions. Deterministic
for a seed; checkpoints every `save_every` steps and resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from mirror_rt.models.ss_draft import StreamDraft


def stream_parameters(draft: StreamDraft) -> dict[str, torch.Tensor]:
    """The trainable (saved) parameters, by name."""
    return {n: p for n, p in draft.named_parameters() if not n.startswith("base.")}


def stream_loss(draft: StreamDraft, tokens: torch.Tensor, first_answer: int) -> torch.Tensor:
    """Mean stream CE over positions whose target token t+2+j lies in the answer (index >= first_answer)."""
    cache = draft.base.new_cache(tokens.shape[0])
    _, streams = draft.forward_streams(tokens, cache)  # [T, S, vocab]
    T, S = tokens.shape[0], draft.n_streams
    losses = []
    for j in range(S):
        lo, hi = max(0, first_answer - 2 - j), T - 2 - j
        if hi <= lo:
            continue
        losses.append(F.cross_entropy(streams[lo:hi, j].float(), tokens[lo + 2 + j:hi + 2 + j]))
    return torch.stack(losses).mean() if losses else streams.sum() * 0.0


def train_streams(draft: StreamDraft, sequences: list[tuple[list[int], int]], steps: int, out_dir: Path,
                  lr: float = 2e-3, seed: int = 0, window: int = 160, save_every: int = 50, progress=True) -> list[float]:
    """Train for `steps` steps on (token ids, index of the first answer token) pairs; returns losses."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    for p in draft.base.parameters():
        p.requires_grad_(False)
    params = list(stream_parameters(draft).values())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    out_dir = Path(out_dir)
    start = _resume(draft, optimizer, out_dir)
    rng = random.Random(seed)
    order = [rng.randrange(len(sequences)) for _ in range(steps)]
    losses = []
    bar = tqdm(range(start, steps), desc="train-draft", disable=not progress, initial=start, total=steps)
    for step in bar:
        ids, first = sequences[order[step]]
        lo = max(0, min(first - 8, len(ids) - window))  # a window covering the answer
        tokens = torch.tensor(ids[lo:lo + window])
        loss = stream_loss(draft, tokens, first - lo)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % save_every == 0 or step + 1 == steps:
            save_checkpoint(draft, optimizer, out_dir, step + 1)
    return losses


def save_checkpoint(draft: StreamDraft, optimizer, out_dir: Path, step: int) -> None:
    """Stream weights (safetensors), their config, and the optimizer state for resuming."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().contiguous() for n, p in stream_parameters(draft).items()}, str(out_dir / "streams.safetensors"))
    (out_dir / "streams.json").write_text(json.dumps(stream_config(draft) | {"step": step}, indent=2))
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, out_dir / "optimizer.pt")


def stream_config(draft: StreamDraft) -> dict:
    return {"n_streams": draft.n_streams, "n_stream_layers": draft.config.n_layers - draft.first,
            "rank": draft.stream_layers[0].q.a.out_features, "base_vocab_size": draft.config.vocab_size,
            "base_layers": draft.config.n_layers, "hidden_size": draft.config.hidden_size}


def load_streams(base, folder: Path) -> StreamDraft:
    """A StreamDraft over `base` with the trained stream weights of `folder` (checked against base)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "streams.json").read_text())
    c = base.config
    if (cfg["base_vocab_size"], cfg["base_layers"], cfg["hidden_size"]) != (c.vocab_size, c.n_layers, c.hidden_size):
        raise ValueError(f"{folder}: streams were trained for another draft shape")
    draft = StreamDraft(base, cfg["n_streams"], cfg["n_stream_layers"], cfg["rank"])
    state = load_file(str(folder / "streams.safetensors"))
    missing = draft.load_state_dict(state, strict=False)
    if missing.unexpected_keys or any(not k.startswith("base.") for k in missing.missing_keys):
        raise ValueError(f"{folder}: stream weights do not match their config")
    return draft


def _resume(draft: StreamDraft, optimizer, out_dir: Path) -> int:
    state_file = out_dir / "optimizer.pt"
    if not state_file.exists():
        return 0
    trained = load_streams(draft.base, out_dir)
    draft.load_state_dict(trained.state_dict(), strict=False)
    state = torch.load(state_file, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
