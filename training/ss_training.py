"""Training the Speculative Streaming streams of a draft on the target's own text: only the stream parameters learn
(the base draft, its main stream, is frozen). Loss: the mean over streams j of CE(stream j at t, token t + 2 + j) on
answer positions. Seeded; checkpointed every `save_every` steps and resumed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.models.ss_draft import StreamDraft, load_streams, stream_config
from mirror_rt.training.checkpoints import finite_loss, load_state, loss_summary, save_state


def stream_parameters(draft: StreamDraft) -> dict[str, torch.Tensor]:
    """The trainable (saved) parameters, by name."""
    return {n: p for n, p in draft.named_parameters() if not n.startswith("base.")}


def stream_loss(draft: StreamDraft, tokens: torch.Tensor, first_answer: int) -> torch.Tensor:
    """Mean stream CE over positions whose target token t+2+j lies in the answer (index >= first_answer)."""
    cache = new_cache(draft.base, tokens.shape[0])
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
                  lr: float = 2e-3, seed: int = 0, window: int = 160, save_every: int = 50,
                  progress=True) -> list[float]:
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
        losses.append(finite_loss(loss, step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")  # as the summary's final_loss
        if (step + 1) % save_every == 0 or step + 1 == steps:
            save_checkpoint(draft, optimizer, out_dir, step + 1)
    return losses


def save_checkpoint(draft: StreamDraft, optimizer, out_dir: Path, step: int) -> None:
    """Stream weights (safetensors), their config, and the optimizer state for resuming."""
    from mirror_rt.models.tensor_files import save_tensors

    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {n: p.detach().contiguous() for n, p in stream_parameters(draft).items()}
    save_tensors(weights, out_dir / "streams.safetensors")
    (out_dir / "streams.json").write_text(json.dumps(stream_config(draft) | {"step": step}, indent=2))
    save_state(out_dir / "optimizer.pt", {"optimizer": optimizer.state_dict(), "step": step})


def trained_steps(out_dir: Path) -> int:
    """Steps the streams in `out_dir` were trained for (0: none there)."""
    config = out_dir / "streams.json"
    return int(json.loads(config.read_text()).get("step", 0)) if config.is_file() else 0


def _resume(draft: StreamDraft, optimizer, out_dir: Path) -> int:
    state_file = out_dir / "optimizer.pt"
    if not state_file.exists():
        return 0
    trained = load_streams(draft.base, out_dir)
    shape = ("n_streams", "n_stream_layers", "rank")
    held, asked = ([stream_config(d)[k] for k in shape] for d in (trained, draft))
    if held != asked:  # said before the optimizer's state fails in torch's words
        raise ValueError(f"{out_dir}: holds streams trained with another shape ({held[0]} streams, {held[1]} stream "
                         f"layers, rank {held[2]}); resume with the same --streams, --stream-layers and --rank, or "
                         "train into another --out")
    draft.load_state_dict(trained.state_dict(), strict=False)
    state = load_state(state_file, ("optimizer", "step"))
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


@torch.inference_mode()
def evaluate_streams(draft: StreamDraft, sequences: list[tuple[list[int], int]], gammas=(4, 7)) -> dict:
    """On held-out text (one teacher-forced forward each): stream j's top-1 accuracy (its argmax at t is token
    t + 2 + j) and draft forwards per gamma-token rollout replayed on the text (exact on the draft's own output)."""
    hits, counts = [0] * draft.n_streams, [0] * draft.n_streams
    forwards = {g: [] for g in gammas}
    for ids, first in sequences:
        tokens = torch.tensor(ids)
        _, streams = draft.forward_streams(tokens, new_cache(draft.base, len(ids)))
        guess = streams.argmax(-1)  # [T, S]
        for j in range(draft.n_streams):
            lo, hi = max(0, first - 2 - j), len(ids) - 2 - j
            if hi > lo:
                hits[j] += int((guess[lo:hi, j] == tokens[lo + 2 + j:hi + 2 + j]).sum())
                counts[j] += hi - lo
        for g in gammas:
            forwards[g] += [_replay(guess, ids, start, g) for start in range(first, len(ids) - g - 2, 4)]
    return {"stream_accuracy": [round(h / c, 3) if c else None for h, c in zip(hits, counts)],
            **{f"forwards_per_rollout_gamma{g}": round(sum(v) / len(v), 3) if v else None
               for g, v in forwards.items()}}


def _replay(guess, ids: list[int], start: int, gamma: int) -> int:
    """Forwards a stream-verified rollout of `gamma` tokens after ids[:start] takes on this text."""
    produced, forwards, t, pending = 0, 0, start - 1, []
    while produced < gamma:
        n = 0
        while n < len(pending) and t + 1 + n < len(ids) and pending[n] == ids[t + 1 + n]:
            n += 1
        produced += n + 1
        forwards += 1
        t += n + 1  # index of the new unfed token (confirmed guesses, then the main stream's token)
        pending = [int(x) for x in guess[t - 1]] if t - 1 < len(guess) else []  # streams of the row before it
    return forwards


def train_draft_main(target: str | None = None, init: str = "self", streams: int = 2, stream_layers: int = 2,
                     rank: int = 16, data=None, steps: int = 300, out: str = "draft-streams", seed: int = 0,
                     lr: float = 2e-3, max_new_tokens: int = 96, cache: str | None = None, progress=True,
                     log=print) -> dict:
    """CLI entry (`mirror-rt train-draft`): data, train the streams, evaluate before/after on held-out text."""
    import time

    from mirror_rt.evaluation.specbench import question_files
    from mirror_rt.exporters.paths import check_writable
    from mirror_rt.models.default_model import cache_dir
    from mirror_rt.models.loading import load_checkpoint
    from mirror_rt.training.exit_data import answer_sequences, split

    files = question_files(data, "train-draft")  # inputs and the output are checked before any model loads
    check_writable(out)
    target_ckpt = load_checkpoint(target, cache=cache, log=lambda *a: None)
    base = _init_base(init, target_ckpt, cache)
    t0 = time.perf_counter()
    sequences = answer_sequences(target_ckpt.model, target_ckpt.tokenizer, files, cache_dir(cache) / "exit-data",
                                 max_new_tokens, progress=progress)
    train, held_out = split(sequences)
    torch.manual_seed(seed)
    draft = StreamDraft(base, streams, stream_layers, rank)
    before = evaluate_streams(draft, held_out[:12])
    t1 = time.perf_counter()
    losses = train_streams(draft, train, steps, Path(out), lr=lr, seed=seed, progress=progress)
    after = evaluate_streams(draft, held_out[:12])
    config_path = Path(out) / "streams.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"init": init}, indent=2))
    if not losses:
        log(f"train-draft: {out} holds {trained_steps(Path(out))} steps already, not fewer than --steps {steps}: "
            "nothing trained (raise --steps to go on)")
    return {"out": str(out), "init": init, "train_sequences": len(train), "held_out_sequences": len(held_out[:12]),
            "steps_trained": len(losses), **loss_summary(losses),
            "before": before, "after": after, "data_s": round(t1 - t0, 1),
            "train_s": round(time.perf_counter() - t1, 1)}


def _init_base(init: str, target_ckpt, cache):
    """The draft the streams extend: the target itself, its first K layers, or another model."""
    import copy

    from mirror_rt.models.loading import load_checkpoint

    if init == "self":
        return copy.deepcopy(target_ckpt.model)
    if init.startswith("layers:"):
        given, n = init.split(":", 1)[1], target_ckpt.model.config.n_layers
        if not given.strip().isdigit() or not 1 <= int(given) <= n:
            raise ValueError(f"--init layers:K needs a whole number 1 <= K <= {n}, got '{given}'")
        k = int(given)
        model = copy.deepcopy(target_ckpt.model)
        import dataclasses

        model.layers = model.layers[:k]
        model.config = dataclasses.replace(model.config, n_layers=k)
        return model
    other = load_checkpoint(init, cache=cache, log=lambda *a: None)
    if other.model.config.vocab_size != target_ckpt.model.config.vocab_size:
        raise ValueError(f"vocabulary mismatch: target has {target_ckpt.model.config.vocab_size} tokens, "
                         f"draft {init} has {other.model.config.vocab_size}")
    return other.model
