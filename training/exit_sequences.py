"""Whole-sequence distillation data for attention exit adapters (see models.exit_adapter).

An attention adapter reads the keys and values that layer ℓe-1 cached for every earlier position,
so its data are whole sequences, not independent positions: per question, the prompt (first turn,
chat template) followed by the target's own greedy answer (the answers `exit_data.collect` caches),
run through the target once, keeping the exit hidden state, layer ℓe-1's keys and values (float16)
and the final layer's top-k log-probs at every position. Held out by question as `ExitData.split`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.models.exit_adapter import ExitAdapter, cached_mix


@dataclass
class ExitSequence:
    """One question's sequence; row t predicts token t+1."""

    hidden: torch.Tensor  # [T, hidden] float16: hidden state after the exit layer
    keys: torch.Tensor  # [KVH, T, D] float16: layer ℓe-1's keys (RoPE applied, as cached)
    values: torch.Tensor  # [KVH, T, D] float16
    top_ids: torch.Tensor  # [T, k] int64: final layer's top-k ids (column 0: the target's next token)
    top_logprobs: torch.Tensor  # [T, k] float32
    first: int  # first row trained on (after the chat template's shared prefix)
    prompt_len: int  # rows prompt_len-1.. predict the answer
    question: int  # index of the question in file order

    def answer_rows(self) -> torch.Tensor:
        return torch.arange(self.prompt_len - 1, self.hidden.shape[0] - 1)

    def trained_rows(self) -> torch.Tensor:
        return torch.arange(self.first, self.hidden.shape[0] - 1)


@torch.inference_mode()
def sequence_data(model, prompts: list[list[int]], answers: list[list[int]], exit_layer: int, skip: int,
                  top_k: int = 64, progress: bool = True) -> list[ExitSequence]:
    """Run prompt + answer of every question through the target (one forward each)."""
    from tqdm import tqdm

    out = []
    for i, (prompt, answer) in enumerate(tqdm(list(zip(prompts, answers)), desc="exit sequences", unit="question",
                                              disable=not progress)):
        ids = torch.tensor(list(prompt) + list(answer), device=model.embed_tokens.weight.device)
        T = len(ids)
        cache = new_cache(model, T)
        exit_h = model.run_layers(model.embed(ids), cache, 0, exit_layer)
        h = model.run_layers(exit_h, cache, exit_layer, model.config.n_layers)
        top = torch.topk(F.log_softmax(model.logits(h).float(), dim=-1), min(top_k, model.config.vocab_size), dim=-1)
        last = exit_layer - 1
        out.append(ExitSequence(exit_h.half(), cache.keys[last, :, :T].half().clone(),
                                cache.values[last, :, :T].half().clone(), top.indices, top.values,
                                min(skip, len(prompt) - 1), len(prompt), i))
    return out


def split_sequences(seqs: list[ExitSequence], every: int = 5) -> tuple[list[ExitSequence], list[ExitSequence]]:
    """(train, held_out): every `every`-th question (file order) is held out, as ExitData.split."""
    held = [s for s in seqs if s.question % every == every - 1]
    return [s for s in seqs if s.question % every != every - 1], held


def exit_logits_at(model, adapter: ExitAdapter | None, seq: ExitSequence, rows: torch.Tensor) -> torch.Tensor:
    """Early-exit logits [len(rows), vocab] at `rows` of `seq` (None: the untrained exit).

    The adapter's attention runs over the whole sequence (every row's keys); the LM head only at `rows`.
    """
    dtype = model.embed_tokens.weight.dtype
    if adapter is None:
        return model.logits(seq.hidden[rows].to(dtype))
    mixed = cached_mix(model, adapter, seq.hidden.to(dtype), seq.keys.to(dtype), seq.values.to(dtype))
    return model.logits(adapter.project(mixed[rows]))


@torch.inference_mode()
def evaluate_sequences(model, adapter: ExitAdapter | None, held_out: list[ExitSequence]) -> dict:
    """Coverage of the target's next token by the exit's top-1 / top-8 on the answer rows (None: untrained exit)."""
    hits1 = hits8 = n = 0
    for seq in held_out:
        rows = seq.answer_rows()
        top = torch.topk(exit_logits_at(model, adapter, seq, rows).float(), 8, dim=-1).indices
        target = seq.top_ids[rows, :1]
        hits1 += (top[:, :1] == target).sum().item()
        hits8 += (top == target).any(-1).sum().item()
        n += len(rows)
    return {"top1": hits1 / n if n else None, "top8": hits8 / n if n else None, "positions": n}  # none: null
