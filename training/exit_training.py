"""Train the early-exit adapter by distillation from the target's final layer (training.exit_data; every 5th question
held out). Loss: KL(final || exit) over the final top-k (renormalized) plus cross-entropy on the final argmax (the token
Mirror must cover); AdamW, warmup + cosine, seeded, resumed from its checkpoint. The target is frozen. An attention
adapter (the default) trains on whole sequences: SEQS_PER_STEP questions a step, the loss on `batch_size` of their
positions. Coverage: the share of held-out positions whose final argmax is in the exit's top-1 / top-8.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from mirror_rt.models.config import SplitConfig
from mirror_rt.models.exit_adapter import ExitAdapter, exit_logits, save_exit_adapter
from mirror_rt.training.checkpoints import finite_loss, load_state, loss_summary, save_state
from mirror_rt.training.exit_data import (
    ExitData,
    ExitSequence,
    cached_answers,
    collect,
    evaluate_sequences,
    exit_coverage,
    exit_logits_at,
    sequence_data,
    shared_prefix_len,
    split_sequences,
)


@dataclass(frozen=True)
class TrainExitConfig:
    """One training run; CLI flags map one to one onto these fields."""

    target: str | None = None  # model reference (None: the default model)
    exit_layer: int | None = None  # None: the model's default (models.config.SplitConfig)
    data: tuple[str, ...] = ()  # SpecBench-format jsonl files (required)
    steps: int = 600  # optimizer steps
    rank: int | None = None  # adapter rank (None: DEFAULT_RANK, or the model's hidden size where smaller)
    attention: bool = True  # read layer ℓe-1's cached keys (models.exit_adapter); False: per position only
    lr: float | None = None  # AdamW peak learning rate (None: 3e-3 with attention, 1e-2 without)
    seed: int = 0  # adapter init and batch order
    out: str | None = None  # adapter path (.safetensors + .json); None: <cache>/exit-adapters/<model>-l<exit>
    resume: bool = True  # continue from the checkpoint next to `out` when present
    batch_size: int = 512  # positions per step
    save_every: int = 50  # checkpoint period in steps
    max_new_tokens: int = 96  # tokens per generated answer
    max_prompt_tokens: int = 128  # first-turn text cut to this many tokens
    hold_out_every: int = 5  # every n-th question is held out
    threads: int | None = 1  # torch threads (1 is fastest on a shared 2-core CPU)
    cache: str | None = None  # cache folder (None: MIRROR_RT_CACHE or ~/.cache/mirror-rt)

    def __post_init__(self):
        if self.lr is None:
            object.__setattr__(self, "lr", 3e-3 if self.attention else 1e-2)
        for name in ("steps", "rank", "batch_size", "save_every", "max_new_tokens", "max_prompt_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.hold_out_every < 2:
            raise ValueError(f"--hold-out-every must be >= 2, got {self.hold_out_every}")


SEQS_PER_STEP = 8  # questions per step of an attention adapter
DEFAULT_RANK = 512


def distill_loss(model, adapter: ExitAdapter, batch: ExitData) -> torch.Tensor:
    """KL(final top-k || exit) + CE(final argmax) over a batch of positions (scalar)."""
    h = batch.hidden.to(model.embed_tokens.weight.dtype)
    return _kl_ce(exit_logits(model, h, adapter), batch.top_ids, batch.top_logprobs)


def _kl_ce(logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor:
    logq = F.log_softmax(logits.float(), dim=-1)  # [B, vocab]
    p_log = F.log_softmax(top_logprobs, dim=-1)  # final top-k renormalized, [B, k]
    q_top = logq.gather(1, top_ids)
    kl = (p_log.exp() * (p_log - q_top)).sum(-1).mean()
    return kl - q_top[:, 0].mean()


def sequence_loss(model, adapter: ExitAdapter, seqs: list[ExitSequence], positions: int,
                  gen: torch.Generator) -> torch.Tensor:
    """The loss of `distill_loss` on `positions` rows drawn from SEQS_PER_STEP random training sequences."""
    per_seq = max(1, positions // SEQS_PER_STEP)
    logits, ids, logprobs = [], [], []
    for i in torch.randint(len(seqs), (SEQS_PER_STEP,), generator=gen).tolist():
        seq = seqs[i]
        rows = seq.trained_rows()
        rows = rows[torch.randperm(len(rows), generator=gen)[:per_seq]]
        logits.append(exit_logits_at(model, adapter, seq, rows))
        ids.append(seq.top_ids[rows])
        logprobs.append(seq.top_logprobs[rows])
    return _kl_ce(torch.cat(logits), torch.cat(ids), torch.cat(logprobs))


def _batch_loss(model, adapter, train, cfg: TrainExitConfig, gen: torch.Generator) -> torch.Tensor:
    if isinstance(train, ExitData):
        index = torch.randint(len(train), (min(cfg.batch_size, len(train)),), generator=gen)
        return distill_loss(model, adapter, train.select(index))
    return sequence_loss(model, adapter, train, cfg.batch_size, gen)


@torch.inference_mode()
def evaluate_exit(model, exit_layer: int, adapter: ExitAdapter | None, held_out: ExitData,
                  chunk: int = 512) -> dict:
    """Coverage of the target's next token by the exit's top-1 and top-8 on `held_out` (taken at `exit_layer`)."""
    if adapter is not None and adapter.config.exit_layer != exit_layer:
        raise ValueError(f"adapter is for exit layer {adapter.config.exit_layer}, not {exit_layer}")
    dtype = model.embed_tokens.weight.dtype
    return exit_coverage((exit_logits(model, held_out.hidden[s:s + chunk].to(dtype), adapter),
                          held_out.top_ids[s:s + chunk, :1]) for s in range(0, len(held_out), chunk))


def _lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def fit(model, adapter: ExitAdapter, train: ExitData | list[ExitSequence], cfg: TrainExitConfig,
        checkpoint: Path | None, progress: bool = True) -> list[float]:
    """Train `adapter` in place for cfg.steps on positions (ExitData) or, for attention adapters, sequences;
    returns the loss per step (resumed steps included)."""
    from tqdm import tqdm

    model.requires_grad_(False)  # the target is frozen: no gradient buffers for its 49152 x hidden head
    adapter.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = _resume(checkpoint, adapter, optimizer, gen, cfg) if checkpoint is not None and cfg.resume else []
    with tqdm(total=cfg.steps, initial=len(losses), desc="train-exit", unit="step", disable=not progress) as bar:
        for step in range(len(losses), cfg.steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, cfg.steps, cfg.lr)
            loss = _batch_loss(model, adapter, train, cfg, gen)
            losses.append(finite_loss(loss, step))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            bar.update()
            if checkpoint is not None and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps):
                _save_checkpoint(checkpoint, adapter, optimizer, gen, losses, cfg)
    return losses


def _run_key(cfg: TrainExitConfig) -> dict:
    """The settings a checkpoint must share to be resumed (not `steps`: a run may be extended)."""
    keep = ("target", "exit_layer", "data", "rank", "attention", "lr", "seed", "batch_size", "max_new_tokens",
            "max_prompt_tokens", "hold_out_every")
    return {k: v for k, v in asdict(cfg).items() if k in keep}


def _save_checkpoint(path: Path, adapter, optimizer, gen, losses, cfg) -> None:
    save_state(path, {"adapter": adapter.state_dict(), "optimizer": optimizer.state_dict(),
                      "generator": gen.get_state(), "losses": losses, "key": _run_key(cfg)})


def _resume(path: Path, adapter, optimizer, gen, cfg) -> list[float]:
    if not path.is_file():
        return []
    state = load_state(path, ("adapter", "optimizer", "generator", "losses", "key"))
    if state["key"] != _run_key(cfg):
        return []  # another run's checkpoint: start over (it is overwritten at the first save)
    adapter.load_state_dict(state["adapter"])
    optimizer.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
    return list(state["losses"])[:cfg.steps]


def train_exit(cfg: TrainExitConfig, progress: bool = True, log=print) -> dict:
    """Collect (or reuse) the data, train, evaluate before/after on held-out questions, save; returns a report."""
    from mirror_rt.evaluation.specbench import question_files
    from mirror_rt.exporters.paths import check_writable
    from mirror_rt.models.default_model import cache_dir
    from mirror_rt.models.loading import load_checkpoint

    files = question_files(cfg.data, "train-exit")  # inputs and the output are checked before any model loads
    if cfg.out is not None:  # '' too: it trained into the cache
        check_writable(cfg.out, folder=False)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    loaded = load_checkpoint(cfg.target, log=lambda *a: None, cache=cfg.cache)
    model = loaded.model
    hidden = model.config.hidden_size
    if cfg.rank is None:
        cfg = replace(cfg, rank=min(DEFAULT_RANK, hidden))
    if cfg.rank > hidden:  # before the data is collected, not after
        raise ValueError(f"--rank must be in 1..{hidden} (the hidden size), got {cfg.rank}")
    exit_layer, _ = SplitConfig(cfg.exit_layer).resolve(model.config)
    started = time.perf_counter()
    folder, settings = cache_dir(cfg.cache) / "exit-data", (cfg.max_new_tokens, cfg.max_prompt_tokens)
    if cfg.attention:  # whole sequences: the adapter reads earlier positions' keys
        data = _sequences(model, loaded.tokenizer, files, exit_layer, folder, settings, progress)
        train, held_out = split_sequences(data, cfg.hold_out_every)
        evaluate = partial(evaluate_sequences, model, held_out=held_out)
        sizes = (sum(len(s.trained_rows()) for s in train), sum(len(s.answer_rows()) for s in held_out))
    else:
        data = collect(model, loaded.tokenizer, files, exit_layer, folder, *settings, progress=progress)
        train, held_out = data.split(cfg.hold_out_every)
        evaluate = partial(evaluate_exit, model, exit_layer, held_out=held_out)
        sizes = len(train), len(held_out)
    collected = time.perf_counter()
    log(f"train-exit: {sizes[0]} training / {sizes[1]} held-out positions at exit layer {exit_layer}")
    out = Path(cfg.out) if cfg.out is not None else _default_out(cfg, loaded.source, exit_layer)
    torch.manual_seed(cfg.seed)
    adapter = ExitAdapter.for_model(model, exit_layer, cfg.rank, attention=cfg.attention)
    before = evaluate(None)
    losses = fit(model, adapter, train, cfg, out.with_name(out.stem + ".ckpt.pt"), progress)
    adapter.eval().requires_grad_(False)
    after = evaluate(adapter)
    trained = time.perf_counter()
    notes = {"data": [Path(f).name for f in files], "steps": len(losses),
             "final_loss": loss_summary(losses)["final_loss"], "attention": cfg.attention, "batch_size": cfg.batch_size,
             "held_out_before": before, "held_out_after": after, "seed": cfg.seed, "lr": cfg.lr}
    adapter.config = replace(adapter.config, notes=notes)
    weights, meta = save_exit_adapter(adapter, out)
    out.with_name(out.stem + ".ckpt.pt").unlink(missing_ok=True)
    return {"adapter": str(weights), "config": str(meta), "exit_layer": exit_layer, "rank": cfg.rank,
            "attention": cfg.attention,
            "parameters": adapter.num_parameters(), "bytes": weights.stat().st_size, "before": before,
            "after": after, **loss_summary(losses),
            "train_positions": sizes[0], "data_s": round(collected - started, 1),
            "train_s": round(trained - collected, 1)}


def _sequences(model, tokenizer, files, exit_layer: int, folder: Path, settings: tuple, progress: bool):
    """Whole sequences of the cached answers; `collect` generates and caches them on the first run."""
    cached = cached_answers(model, tokenizer, files, folder, *settings)
    if cached is None:
        collect(model, tokenizer, files, exit_layer, folder, *settings, progress=progress)
        cached = cached_answers(model, tokenizer, files, folder, *settings)
    prompts, answers = cached
    return sequence_data(model, prompts, answers, exit_layer, shared_prefix_len(prompts), progress=progress)


def _default_out(cfg: TrainExitConfig, source: str, exit_layer: int) -> Path:
    from mirror_rt.models.default_model import cache_dir

    kind = "attn" if cfg.attention else "rank"
    return cache_dir(cfg.cache) / "exit-adapters" / f"{Path(source).name}-layer{exit_layer}-{kind}{cfg.rank}"


def train_exit_main(target: str | None = None, exit_layer: int | None = None, data=None, steps: int = 600,
                    rank: int | None = None, out: str | None = None, seed: int = 0, resume: bool = True,
                    progress: bool = True, **options) -> dict:
    """CLI entry (`mirror-rt train-exit`): train and return the report; `data`: one path or a list; `options`: further
    TrainExitConfig fields."""
    files = () if data is None else (data,) if isinstance(data, (str, Path)) else tuple(data)
    cfg = TrainExitConfig(target=target, exit_layer=exit_layer, data=tuple(str(f) for f in files), steps=steps,
                          rank=rank, out=out, seed=seed, resume=resume, **options)
    return train_exit(cfg, progress=progress)
