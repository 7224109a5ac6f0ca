"""Distillation data for the early-exit adapter: the target's own greedy answers to the first turns of SpecBench
questions, and per position (answer, and prompt after the chat template's shared prefix) the exit hidden state with
the final layer's top-k log-probs (`collect`), or whole sequences for an attention adapter (`sequence_data`).
Answers (jsonl, shared with `train-draft` through `answer_sequences`) and features (safetensors) are cached, keyed by
model, data and settings.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.models.exit_adapter import ExitAdapter, cached_mix
from mirror_rt.models.transformer import apply_rope, rope_tables

DATA_VERSION = 2  # 2: prompt positions recorded too


@dataclass
class ExitData:
    """Positions of one data set; row i predicts the token after position i of question `question[i]`."""

    hidden: torch.Tensor  # [N, hidden] float16: hidden state after the exit layer
    top_ids: torch.Tensor  # [N, k] int64: final layer's top-k ids (column 0 = the target's next token)
    top_logprobs: torch.Tensor  # [N, k] float32: their final-layer log-probs
    question: torch.Tensor  # [N] int64: index of the question in file order
    is_answer: torch.Tensor  # [N] bool: position in the generated answer (False: in the prompt's user text)

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def select(self, mask: torch.Tensor) -> ExitData:
        return ExitData(self.hidden[mask], self.top_ids[mask], self.top_logprobs[mask], self.question[mask],
                        self.is_answer[mask])

    def split(self, every: int = 5) -> tuple[ExitData, ExitData]:
        """(train, held_out) by question: every `every`-th question is held out; it keeps answer positions only (the
        text Mirror decodes)."""
        held = (self.question % every) == every - 1
        return self.select(~held), self.select(held & self.is_answer)


def first_turn_prompts(tokenizer, data_files, max_prompt_tokens: int = 192) -> list[tuple[str, list[int]]]:
    """(question_id, prompt ids) per question, in file order, first turn cut to `max_prompt_tokens` tokens."""
    from mirror_rt.evaluation.specbench import read_questions

    prompts = []
    for path in data_files:
        for q in read_questions(path):
            ids = tokenizer.encode(q.turns[0])
            text = tokenizer.decode(ids[:max_prompt_tokens]) if len(ids) > max_prompt_tokens else q.turns[0]
            prompts.append((f"{Path(path).stem}:{q.question_id}", tokenizer.chat_prompt([{"role": "user",
                                                                                          "content": text}])))
    return prompts


def _rope(model, positions: torch.Tensor, dtype):
    """cos, sin [B, 1, T, head_dim] for positions [B, T] (as Transformer.run_layers computes them)."""
    cos, sin = rope_tables(model.inv_freq, positions, dtype)
    return cos.unsqueeze(1), sin.unsqueeze(1)


def _forward(model, ids, start: int, pad, kv, exit_layer: int):
    """ids [B, T] at columns start.. of left-padded rows -> (exit hidden, last-layer hidden), each [B, T, hidden]."""
    c = model.config
    B, T = ids.shape
    h = model.embed(ids)
    columns = start + torch.arange(T)
    cos, sin = _rope(model, (columns[None, :] - pad[:, None]).clamp(min=0), h.dtype)
    keys = torch.arange(start + T)
    # query column q sees keys pad..q; padding queries see themselves only (no empty softmax rows)
    mask = (keys[None, None, :] <= columns[None, :, None]) & ((keys[None, None, :] >= pad[:, None, None])
                                                            | (keys[None, None, :] == columns[None, :, None]))
    mask = mask.unsqueeze(1)  # [B, 1, T, S]
    for i in range(c.n_layers):
        block = model.layers[i]
        attn = block.self_attn
        y = block.input_layernorm(h)
        q = attn.q_proj(y).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(y).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(y).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv[i][0][:, :, start:start + T], kv[i][1][:, :, start:start + T] = k, v
        out = F.scaled_dot_product_attention(q, kv[i][0][:, :, :start + T], kv[i][1][:, :, :start + T],
                                             attn_mask=mask, enable_gqa=True)  # [B, H, T, D]
        h = h + attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        h = h + block.mlp(block.post_attention_layernorm(h))
        if i + 1 == exit_layer:
            exit_h = h
    return exit_h, h


@torch.inference_mode()
def decode_batch(model, prompts, exit_layer: int, max_new_tokens: int, forced=None, eos_ids=(), top_k: int = 64,
                 skip: int | None = None):
    """Greedy (or `forced`) decoding of a left-padded batch; per row (answer ids, hidden [n, H], top ids [n, k],
    log-probs [n, k], prompt positions p). With `skip`, the first p rows are prompt positions skip..len-2."""
    c = model.config
    B, P = len(prompts), max(len(p) for p in prompts)
    steps = max(len(f) for f in forced) if forced is not None else max_new_tokens
    pad = torch.tensor([P - len(p) for p in prompts])
    ids = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts])
    dtype = model.embed_tokens.weight.dtype
    kv = [tuple(torch.zeros(B, c.n_kv_heads, P + steps, c.head_dim, dtype=dtype) for _ in range(2))
          for _ in range(c.n_layers)]
    live = [forced is None or len(forced[b]) > 0 for b in range(B)]
    exit_h, h = _forward(model, ids, 0, pad, kv, exit_layer)
    rows = [_prompt_rows(model, exit_h[b, P - len(p) + skip:P - 1], h[b, P - len(p) + skip:P - 1], top_k)
            if skip is not None else ([], [], [], []) for b, p in enumerate(prompts)]
    counts = [len(r[1]) for r in rows]
    exit_h, logits = exit_h[:, -1], model.logits(h[:, -1])
    for t in range(steps):
        top = torch.topk(F.log_softmax(logits.float(), dim=-1), min(top_k, c.vocab_size), dim=-1)
        nxt = top.indices[:, 0].tolist() if forced is None else [f[t] if t < len(f) else 0 for f in forced]
        for b in range(B):
            if live[b]:
                answer, hs, tid, tlp = rows[b]
                answer.append(nxt[b])
                hs.append(exit_h[b].half())
                tid.append(top.indices[b])
                tlp.append(top.values[b])
                live[b] = (nxt[b] not in eos_ids) if forced is None else t + 1 < len(forced[b])
        if not any(live) or t + 1 == steps:
            break
        exit_h, h = _forward(model, torch.tensor(nxt)[:, None], P + t, pad, kv, exit_layer)
        exit_h, logits = exit_h[:, -1], model.logits(h[:, -1])
    return [(a, torch.stack(h), torch.stack(i), torch.stack(v), n) for (a, h, i, v), n in zip(rows, counts)]


def _prompt_rows(model, exit_h, h, top_k: int):
    """([], hidden rows, top ids rows, log-prob rows) of teacher-forced prompt positions (exit_h, h [n, hidden])."""
    top = torch.topk(F.log_softmax(model.logits(h).float(), dim=-1), min(top_k, model.config.vocab_size), dim=-1)
    return [], list(exit_h.half()), list(top.indices), list(top.values)


def data_key(model, data_files, max_new_tokens: int, max_prompt_tokens: int) -> str:
    """Cache key of the generated answers: model fingerprint, question files' contents, settings."""
    from mirror_rt.models.exit_adapter import model_fingerprint

    digest = hashlib.sha256(f"{model_fingerprint(model.config)}:{max_new_tokens}:"
                            f"{max_prompt_tokens}".encode())
    for path in data_files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (the chat template's head), leaving each at least one position."""
    return min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)


def cached_answers(model, tokenizer, data_files, folder: Path, max_new_tokens: int,
                   max_prompt_tokens: int) -> tuple[list[list[int]], list[list[int]]] | None:
    """(prompt ids, greedy answer ids) per question from the answers `collect` cached, or None when absent."""
    prompts = first_turn_prompts(tokenizer, data_files, max_prompt_tokens)
    key = data_key(model, data_files, max_new_tokens, max_prompt_tokens)
    answers = _read_answers(folder / f"{key}.answers.jsonl", prompts)
    return None if answers is None else ([p for _, p in prompts], answers)


def _decode_all(model, tokenizer, prompts, exit_layer: int, max_new_tokens: int, forced=None, skip=None,
                batch_size: int = 16, desc: str = "target answers", progress: bool = True) -> dict:
    """`decode_batch` over every prompt ((id, ids) pairs), similar lengths in a batch -> {prompt index: row}."""
    from tqdm import tqdm

    eos = tuple(getattr(tokenizer, "eos_token_ids", ()))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
    results = {}
    with tqdm(total=len(prompts), desc=desc, unit="answer", disable=not progress) as bar:
        for batch in (order[i:i + batch_size] for i in range(0, len(order), batch_size)):
            out = decode_batch(model, [prompts[i][1] for i in batch], exit_layer, max_new_tokens,
                               None if forced is None else [forced[i] for i in batch], eos, skip=skip)
            results.update(zip(batch, out))
            bar.update(len(batch))
    return results


def collect(model, tokenizer, data_files, exit_layer: int, folder: Path, max_new_tokens: int = 96,
            max_prompt_tokens: int = 192, batch_size: int = 16, progress: bool = True) -> ExitData:
    """ExitData of every question's first turn, from the cache folder or generated (see module docstring)."""
    from safetensors.torch import load_file

    from mirror_rt.models.tensor_files import save_tensors

    key = data_key(model, data_files, max_new_tokens, max_prompt_tokens)
    answers_path = folder / f"{key}.answers.jsonl"
    features_path = folder / f"{key}.layer{exit_layer}.v{DATA_VERSION}.safetensors"
    if features_path.is_file():
        return ExitData(**load_file(str(features_path)))
    prompts = first_turn_prompts(tokenizer, data_files, max_prompt_tokens)
    forced = _read_answers(answers_path, prompts)
    results = _decode_all(model, tokenizer, prompts, exit_layer, max_new_tokens, forced,
                          shared_prefix_len([p for _, p in prompts]), batch_size,
                          "exit data (forced)" if forced else "exit data (generating)", progress)
    folder.mkdir(parents=True, exist_ok=True)
    if forced is None:
        _write_answers(answers_path, prompts, [results[i][0] for i in range(len(prompts))], tokenizer)
    data = _stack(results)
    save_tensors({k: v.contiguous() for k, v in data.__dict__.items()}, features_path)
    return data


def _stack(results: dict) -> ExitData:
    index = sorted(results)
    return ExitData(hidden=torch.cat([results[i][1] for i in index]),
                    top_ids=torch.cat([results[i][2] for i in index]).long(),
                    top_logprobs=torch.cat([results[i][3] for i in index]).float(),
                    question=torch.cat([torch.full((len(results[i][1]),), i, dtype=torch.long) for i in index]),
                    is_answer=torch.cat([torch.arange(len(results[i][1])) >= results[i][4] for i in index]))


def _write_answers(path: Path, prompts, answers, tokenizer) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps({"question_id": qid, "prompt_tokens": len(prompt), "answer_ids": answer,
                                 "answer": tokenizer.decode(answer)}) + "\n"
                     for (qid, prompt), answer in zip(prompts, answers))
    tmp.replace(path)


def _read_answers(path: Path, prompts) -> list[list[int]] | None:
    """Cached answers in prompt order, or None when absent or stale."""
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if [r["question_id"] for r in rows] != [qid for qid, _ in prompts]:
        return None
    return [r["answer_ids"] for r in rows]


def answer_sequences(model, tokenizer, data_files, folder: Path, max_new_tokens: int = 96,
                     max_prompt_tokens: int = 128, progress: bool = True,
                     held_out: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, index of the first answer token) per question, in file order; `held_out`: only the first
    that many held-out questions (`split`'s), answered alone where all answers are not cached yet."""
    key = data_key(model, data_files, max_new_tokens, max_prompt_tokens)
    prompts = first_turn_prompts(tokenizer, data_files, max_prompt_tokens)
    path = Path(folder) / f"{key}.answers.jsonl"
    if held_out is None or path.is_file():
        sequences = _answered(model, tokenizer, path, prompts, max_new_tokens, progress)
        return sequences if held_out is None else split(sequences)[1][:held_out]
    some = split(prompts)[1][:held_out]
    return _answered(model, tokenizer, Path(folder) / f"{key}.held-out-{held_out}.answers.jsonl", some,
                     max_new_tokens, progress)


def _answered(model, tokenizer, path: Path, prompts: list, max_new_tokens: int, progress: bool) -> list:
    """The target's greedy answers to `prompts`, read from `path` or computed (in batches) and saved there."""
    answers = _read_answers(path, prompts)
    if answers is None:
        found = _decode_all(model, tokenizer, prompts, 1, max_new_tokens, progress=progress)
        answers = [found[i][0] for i in range(len(prompts))]
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_answers(path, prompts, answers, tokenizer)
    return [(list(p) + list(a), len(p)) for (_, p), a in zip(prompts, answers)]


def split(sequences: list, every: int = 5) -> tuple[list, list]:
    """(train, held_out): every `every`-th sequence is held out."""
    return ([s for i, s in enumerate(sequences) if i % every != every - 1],
            [s for i, s in enumerate(sequences) if i % every == every - 1])


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
    """Early-exit logits [len(rows), vocab] at `rows` of `seq` (None: the untrained exit); the adapter attends over
    the whole sequence."""
    dtype = model.embed_tokens.weight.dtype
    if adapter is None:
        return model.logits(seq.hidden[rows].to(dtype))
    mixed = cached_mix(model, adapter, seq.hidden.to(dtype), seq.keys.to(dtype), seq.values.to(dtype))
    return model.logits(adapter.project(mixed[rows]))


@torch.inference_mode()
def evaluate_sequences(model, adapter: ExitAdapter | None, held_out: list[ExitSequence]) -> dict:
    """Coverage of the target's next token by the exit's top-1 / top-8 on the answer rows (None: untrained exit)."""
    rows = [seq.answer_rows() for seq in held_out]
    return exit_coverage((exit_logits_at(model, adapter, seq, r), seq.top_ids[r, :1]) for seq, r in zip(held_out, rows))


def exit_coverage(windows) -> dict:
    """The shares of target tokens [n, 1] among the exit's top-1 / top-8 over (exit logits [n, vocab], target tokens)
    pairs, and n (none: null shares, not a coverage of 0)."""
    hits1 = hits8 = n = 0
    for logits, target in windows:
        top = torch.topk(logits.float(), 8, dim=-1).indices
        hits1 += (top[:, :1] == target).sum().item()
        hits8 += (top == target).any(-1).sum().item()
        n += len(target)
    return {"top1": hits1 / n if n else None, "top8": hits8 / n if n else None, "positions": n}
