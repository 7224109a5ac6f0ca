"""`llama-cpp` and `llama-cpp-lookup` bench rows: llama.cpp (llama-cpp-python) on the model's own GGUF (the default
model's cached file, or the `.gguf` given), on our chat-templated token ids as given (its vocabulary checked against
ours at load), from an empty cache each answer; `llama-cpp-lookup` adds its prompt-lookup drafter guessing gamma tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from mirror_rt.runtime.engine import GenerationError

METHODS = ("llama-cpp", "llama-cpp-lookup")
# llama-cpp-python's prompt lookup writes a prompt's logits rows past its n_batch buffer (a 769-token prompt failed
# at the default 512): the lookup row evaluates prompts of up to this many tokens in one batch
LOOKUP_BATCH = 2048
CONTEXT = 8192  # llama.cpp's KV cache (it allocates n_ctx positions at load: a 128K-context model's would take GBs)
PROBE = "<|im_start|>user\nHello, world! 12345 ünïcödé\n<|im_end|>"  # chat markers, digits, non-ASCII


def find_gguf(model: str | None, cache: str | None = None) -> Path | None:
    """The model's GGUF: the default model's cached file, or `model` itself when it is a .gguf (else None)."""
    from mirror_rt.models.default_model import DEFAULT_MODEL, GGUF_NAME, cache_dir, default_model_folder

    if model in (None, "", "default", DEFAULT_MODEL):
        gguf = cache_dir(cache) / "downloads" / GGUF_NAME
        if not gguf.exists():
            default_model_folder(cache, log=lambda *_: None)  # fetches it on a fresh machine
        return gguf if gguf.exists() else None
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def weight_types(gguf: Path) -> str:
    """`q4_k weights (q6_k: output, attn_v x14, ffn_down x14)`: the most common type of the 2-D weights, the
    exceptions by type, a layer's tensors counted."""
    from gguf import GGUFReader

    matrices = {t.name: t.tensor_type.name.lower() for t in GGUFReader(str(gguf)).tensors if len(t.shape) > 1}
    main = Counter(matrices.values()).most_common(1)[0][0]
    others = {}
    for name, kind in matrices.items():
        if kind != main:
            part = name.removesuffix(".weight")
            others.setdefault(kind, Counter())[part.split(".")[-1] if part.startswith("blk.") else part] += 1
    groups = [f"{kind}: " + ", ".join(p + (f" x{n}" if n > 1 else "") for p, n in parts.items())
              for kind, parts in others.items()]
    return f"{main} weights" + (f" ({'; '.join(groups)})" if groups else "")


class LlamaCppRunner:
    """llama-cpp-python's `Llama.generate` on our prompt ids, batch 1."""

    def __init__(self, name: str, llm, tokenizer, lookup, label: str, precision: str):
        self.name, self.llm, self.tokenizer, self.lookup = name, llm, tokenizer, lookup
        self.label, self.precision, self.target_only = label, precision, lookup is None

    def answer(self, messages, config):
        ids = self.tokenizer.chat_prompt(messages)
        room = self.llm.n_ctx() - len(ids)
        if room < 1:
            raise GenerationError(f"prompt too long for llama.cpp: {len(ids)} tokens, context {self.llm.n_ctx()}")
        if self.lookup is not None and len(ids) >= self.llm.n_batch:
            raise GenerationError(f"prompt too long for llama-cpp-python's prompt lookup: {len(ids)} tokens, "
                                  f"batch {self.llm.n_batch}")
        if self.lookup is not None:
            self.lookup.num_pred_tokens = config.gamma  # read on every guess
        stops = set() if config.ignore_eos else set(self.tokenizer.eos_token_ids)
        self.llm.set_seed(config.seed)
        self.llm.reset()  # an empty cache: no prefix reuse from the previous answer
        new, t0, first = [], time.perf_counter(), None
        for token in self.llm.generate(ids, **_sampling(config.sampling), reset=True):
            first = time.perf_counter() - t0 if first is None else first  # the prompt read and its first token
            new.append(token)
            if token in stops or len(new) >= min(config.max_new_tokens, room):
                break
        wall = time.perf_counter() - t0
        text = self.tokenizer.decode([t for t in new if t not in stops])
        stats = {"new_tokens": len(new), "wall_time_s": round(wall, 4), "prompt_tokens": len(ids),
                 "tokens_per_s": round(len(new) / wall, 2) if wall > 0 else 0.0,
                 "prompt_ids_as_ours": list(self.llm.input_ids[:len(ids)]) == ids}
        if first is not None:  # the report's prompt and decode tokens/s, as our rows give them
            stats |= {"time_to_first_token_s": round(first, 4), "stage_seconds": {"target_prefill": round(first, 4)}}
        return text, len(new), wall, [], stats


def _same_size(theirs: int, ours: int, gguf: Path) -> bool:
    """Whether llama.cpp's vocabulary size is ours: equal, or larger by the file's trailing unused tokens only (the
    padding of an embedding rounded up, Qwen's [PAD151665]..., which our tokenizer leaves out)."""
    if theirs == ours:
        return True
    from mirror_rt.models.gguf_vocab import VocabError, read_vocab

    try:
        vocab = read_vocab(gguf)
    except VocabError:
        return False
    return theirs == len(vocab.tokens) and vocab.size == ours


def _sampling(sampling) -> dict:
    """llama.cpp's sampler settings for ours: temperature 0 is its greedy sampler; no penalties; min-p ours (its
    default is 0.05)."""
    if sampling.temperature <= 0:
        return {"temp": 0.0, "repeat_penalty": 1.0}
    return {"temp": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or 0,
            "min_p": sampling.min_p, "typical_p": 1.0, "repeat_penalty": 1.0}


def llama_runners(methods: list[str], gguf: Path | None, tokenizer, threads: int, log=print) -> list:
    """Runners for the llama.cpp entries of `methods` (a missing package or GGUF skips them with one line)."""
    wanted = [m for m in METHODS if m in methods]
    if not wanted:
        return []
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as exc:
        log(f"bench: skipping {', '.join(wanted)}: {exc} (pip install -e \".[llama-cpp]\": builds llama.cpp)")
        return []
    if gguf is None:
        log(f"bench: skipping {', '.join(wanted)}: needs the model as a .gguf file (--model path/to/model.gguf)")
        return []
    weights = weight_types(gguf)
    runners = []
    for method in wanted:
        lookup = LlamaPromptLookupDecoding(max_ngram_size=2) if method == "llama-cpp-lookup" else None
        batch = {"n_batch": LOOKUP_BATCH} if lookup else {}
        llm = llama_cpp.Llama(str(gguf), n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads,
                              draft_model=lookup, verbose=False, **batch)
        vocabulary = llm.tokenize(PROBE.encode(), add_bos=False, special=True)
        if not _same_size(llm.n_vocab(), tokenizer.vocab_size, gguf) or vocabulary != tokenizer.encode(PROBE):
            log(f"bench: skipping {method}: {gguf.name}'s vocabulary differs from the model's tokenizer")
            continue
        label = (f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), {threads} threads; {weights}, matmuls on "
                 "8-bit quantized activations, f16 KV" + (", prompt lookup (max n-gram 2)" if lookup else ""))
        runners.append(LlamaCppRunner(method, llm, tokenizer, lookup, label, weights.split()[0]))
    return runners
