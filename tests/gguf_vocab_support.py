"""Small GGUF files carrying a tokenizer of each kind mirror-rt loads, built offline in a test.

A byte-level BPE vocabulary (and a SentencePiece one) is trained here on a small multilingual text with the
`tokenizers` package, then written with gguf.GGUFWriter under a family's keys: Qwen2 / DeepSeek-R1 (`gpt2`,
`qwen2` pre-tokenizer, BOS added, its special tokens, a normal `</s>` that llama.cpp counts as control, trailing
`[PAD...]` padding tokens), Llama 3 (`llama-bpe`, eot/eom), SmolLM2 (`smollm`, no BOS) and Mistral/Llama 2
(`llama` SentencePiece with byte fallback). Optionally with a two-layer model's tensors.
"""

from __future__ import annotations

import functools
import json

import numpy as np

CORPUS = """The quick brown fox jumps over the lazy dog. I'm sure you're right; they'll say it's fine, we've
seen what he'd do. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1,234,567. What is 2+2? It is 4.
def square(x):
    return x ** 2  # the square
東京は日本の首都です。你好，世界！我爱编程。한국어 텍스트입니다. Ελληνικά. Русский текст. café naïve Straße.
Emoji: 🙂 🚀 👍 ❤️. Tabs\tand\nnewlines\n\n  and   runs of spaces. <html><body>Hello, world!</body></html>
""" * 3

TRICKY = [
    "Digits 0123456789 and 3.14159, runs of spaces:    four, tabs\t\tand\nnewlines\n\n",
    "Accents: café, naïve, Straße; CJK: 東京は日本の首都です。 你好 한국어; emoji 🙂🚀👍🏽 👨‍👩‍👧",
    "Contractions: I'm you're he's we've they'll she'd DON'T IT'S",
    "Code: def f(x):\n    return x ** 2  # square\n\n\n\tclass A: pass\n",
    "<｜User｜>What is 2+2?<｜Assistant｜><think>\nfour\n</think>\n\n4<｜end▁of▁sentence｜>",
    "<｜User", "|im_end|>", "a</s>b <|im_start|>user\nhi<|im_end|>", "[PAD5] <0x41>", "  leading and trailing  ",
    "", " ", "\n", "x'sy 'll 12,345,678.90 e\u0301 \u00a0\u3000 \r\n\r\n",
]

QWEN_CONTROL = ["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>", "<|im_start|>",
                "<|im_end|>", "<|fim_prefix|>"]
QWEN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                 "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


@functools.cache
def byte_level_vocab(size: int = 1200) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens by id, merges 'a b' by rank) of a byte-level BPE trained on CORPUS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tuple(tokens), tuple(merges)


@functools.cache
def sentencepiece_vocab(size: int = 900) -> tuple[tuple[str, ...], tuple[float, ...], tuple[int, ...]]:
    """(pieces, scores, types) of a SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte pieces, then
    '▁'-spelled pieces trained on CORPUS, earlier ones scoring higher (single characters lowest)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=size, show_progress=False))
    vocab = tok.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(head) + [-float(i) if len(p) > 1 else -1e6 for i, p in enumerate(pieces)]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tuple(head + pieces), tuple(scores), tuple(types)


def write_gguf(path, arch: str, tokens, types, *, merges=(), scores=None, pre=None, model="gpt2", ids=None,
               add_bos=None, template=None, embedding_rows=None, layers: int = 0):
    """A GGUF file with these tokenizer keys (`ids`: bos/eos/eot/eom/pad/unk -> id); `layers` > 0 adds a model
    of that many layers (hidden size 16) whose embedding has `embedding_rows` rows (default: one per token)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(16)
    w.add_block_count(max(layers, 1))
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(list(tokens))
    w.add_token_types(list(types))
    if scores is not None:
        w.add_token_scores(list(scores))
    if merges:
        w.add_token_merges(list(merges))
    for key, value in (ids or {}).items():
        getattr(w, f"add_{key}_token_id")(value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template:
        w.add_chat_template(template)
    if layers:
        _add_model(w, layers, embedding_rows or len(tokens), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_model(w, layers: int, rows: int, arch: str) -> None:
    rng = np.random.default_rng(0)
    hidden, ffn, kv = 16, 32, 8

    def rand(name, shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    rand("token_embd.weight", (rows, hidden))
    rand("output.weight", (rows, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        for name, out in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            rand(p + name + ".weight", (out, hidden))
            if arch == "qwen2":
                rand(p + name + ".bias", (out,))
        rand(p + "attn_output.weight", (hidden, hidden))
        rand(p + "ffn_gate.weight", (ffn, hidden))
        rand(p + "ffn_up.weight", (ffn, hidden))
        rand(p + "ffn_down.weight", (hidden, ffn))


def qwen2_gguf(path, pre: str = "qwen2", pads: int = 5, **options):
    """A DeepSeek-R1-Distill-Qwen-style tokenizer: trained tokens, then a normal `</s>`, the control tokens,
    `<think>`/`</think>` user-defined, and `pads` trailing unused [PADn] tokens."""
    tokens, merges = byte_level_vocab()
    tokens = [*tokens, "</s>", *QWEN_CONTROL, "<think>", "</think>"]
    types = [1] * (len(tokens) - len(QWEN_CONTROL) - 2) + [3] * len(QWEN_CONTROL) + [4, 4]
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(pads)]
    types += [5] * pads
    at = tokens.index
    ids = {"bos": at("<｜begin▁of▁sentence｜>"), "eos": at("<｜end▁of▁sentence｜>"), "pad": at("<|fim_prefix|>")}
    options = {"ids": ids, "add_bos": True, "template": QWEN_TEMPLATE} | options
    return write_gguf(path, "qwen2", tokens, types, merges=merges, pre=pre, **options)


def llama3_gguf(path):
    tokens, merges = byte_level_vocab()
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>"]
    n = len(tokens)
    ids = {"bos": n, "eos": n + 5, "eot": n + 5, "eom": n + 4}
    return write_gguf(path, "llama", [*tokens, *names], [1] * n + [3] * len(names), merges=merges,
                      pre="llama-bpe", ids=ids, template=LLAMA3_TEMPLATE)


def smollm_gguf(path):
    tokens, merges = byte_level_vocab()
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return write_gguf(path, "llama", [*names, *tokens], [3] * 3 + [1] * len(tokens), merges=merges, pre="smollm",
                      ids={"bos": 1, "eos": 2, "unk": 0, "pad": 2}, add_bos=False, template=CHATML_TEMPLATE)


def sentencepiece_gguf(path):
    pieces, scores, types = sentencepiece_vocab()
    pieces, scores, types = [*pieces, "[INST]", "[/INST]"], [*scores, 0.0, 0.0], [*types, 3, 3]
    return write_gguf(path, "llama", pieces, types, scores=scores, model="llama",
                      ids={"bos": 1, "eos": 2, "unk": 0}, add_bos=True, template=SPM_TEMPLATE)


FAMILIES = {"qwen2": qwen2_gguf, "llama3": llama3_gguf, "smollm": smollm_gguf, "sentencepiece": sentencepiece_gguf}
