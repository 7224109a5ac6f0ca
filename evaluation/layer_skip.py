"""How often a draft made of some of the target's own layers (no training) picks the target's greedy token.

Per question, the target's greedy answer, then teacher-forced on it the share of answer positions where the layer
subset's argmax is the target's (a cheap self-draft pays only if it agrees often enough).

    python -m mirror_rt.evaluation.layer_skip --data specbench-dev --limit 10
"""

from __future__ import annotations

import argparse

# the variants measured in docs/drafts.md: (name, layers dropped) for a 30-layer model
VARIANTS = (("last 5", range(25, 30)), ("5 spread", (4, 9, 14, 19, 24)), ("20-24", range(20, 25)),
            ("10-19", range(10, 20)), ("15-24", range(15, 25)), ("6-19", range(6, 20)),
            ("every 3rd from 2", range(2, 29, 3)), ("odd 11-27", range(11, 28, 2)))


def target_answers(model, tokenizer, questions: list, max_new_tokens: int) -> list[tuple]:
    """(ids [1, prompt + answer], prompt length) per question: the target's greedy answer."""
    import torch

    out = []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question.turns[0]}],
                                            add_generation_prompt=True, return_tensors="pt")[:, -300:]
        with torch.inference_mode():
            answer = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id)
        out.append((answer, ids.shape[1]))
    return out


def agreement(model, texts: list[tuple], keep: list[int]) -> float:
    """Share of answer positions where the model with only layers `keep` picks the full model's token."""
    import torch

    layers = model.model.layers
    hits = total = 0
    with torch.inference_mode():
        full = [model(ids, use_cache=False).logits[0, start - 1:-1].argmax(-1) for ids, start in texts]
        model.model.layers = torch.nn.ModuleList(layers[i] for i in keep)
        try:
            for (ids, start), chosen in zip(texts, full):
                drafted = model(ids, use_cache=False).logits[0, start - 1:-1].argmax(-1)
                hits, total = hits + int((drafted == chosen).sum()), total + chosen.numel()
        finally:
            model.model.layers = layers
    return hits / max(total, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="SpecBench-style jsonl of questions")
    parser.add_argument("--limit", type=int, default=10, help="questions (default 10)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="answer tokens per question (default 48)")
    parser.add_argument("--model", default=None, help="a Hugging Face folder or .gguf (default: the default model)")
    args = parser.parse_args(argv)
    import torch
    import transformers

    from mirror_rt.evaluation.specbench import read_questions
    from mirror_rt.models.loading import resolve_folder

    torch.set_num_threads(1)
    folder = str(resolve_folder(args.model))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    texts = target_answers(model, tokenizer, read_questions(args.data, None, args.limit), args.max_new_tokens)
    n = model.config.num_hidden_layers
    print(f"| layers dropped | layers kept (of {n}) | top-1 agreement with the target |\n|---|---|---|")
    for name, dropped in VARIANTS:
        keep = [i for i in range(n) if i not in set(dropped)]
        if len(keep) < n:
            print(f"| {name} | {len(keep)} | {agreement(model, texts, keep):.3f} |", flush=True)


if __name__ == "__main__":
    main()
