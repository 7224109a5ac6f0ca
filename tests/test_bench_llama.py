"""The llama.cpp bench rows: our prompt ids go in unchanged, EOS and budgets as ours, every answer from an empty
cache, time to first token (prompt and decode tokens/s in the report), the precision read from the GGUF, and clean
skips (no llama_cpp, no GGUF, another vocabulary). A fake llama_cpp module stands in for the package; the real one
runs only where it is installed (slow)."""

from __future__ import annotations

import sys
import time
import types

import numpy as np
import pytest

from mirror_rt.evaluation.bench_llama import LOOKUP_BATCH
from mirror_rt.evaluation.bench_methods import build_runners
from mirror_rt.models.tokenizer import ByteTokenizer
from mirror_rt.runtime.config import make_config
from mirror_rt.runtime.engine import GenerationError

SCRIPT = [40, 41, 42, 1, 43, 44, 45, 46, 47, 48]  # 1 is the byte tokenizer's EOS


class FakeLlama:
    """llama_cpp.Llama's surface the runner uses: generate yields SCRIPT, recording what it was given."""

    instances: list = []

    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, draft_model, verbose, n_batch=512):
        self.model_path, self.threads, self.draft_model, self.n_batch = model_path, n_threads, draft_model, n_batch
        self.input_ids, self.prompts, self.resets, self.seeds, self.vocab = np.zeros(64, dtype=np.intc), [], 0, [], 258
        FakeLlama.instances.append(self)

    def n_ctx(self):
        return 64

    def n_vocab(self):
        return self.vocab

    def tokenize(self, text, add_bos, special):
        return ByteTokenizer().encode(text.decode())

    def set_seed(self, seed):
        self.seeds.append(seed)

    def reset(self):
        self.resets += 1

    def generate(self, tokens, reset, **sampling):
        self.prompts.append(list(tokens))
        self.input_ids[:len(tokens)] = tokens
        time.sleep(0.002)  # the prompt's reading, before the first token
        yield from SCRIPT


@pytest.fixture
def fake_llama(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.__version__, module.Llama = "0.0-fake", FakeLlama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lambda max_ngram_size: types.SimpleNamespace(num_pred_tokens=10)
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    FakeLlama.instances = []
    return FakeLlama


@pytest.fixture
def gguf(tmp_path):
    """A GGUF with f32 matrices and an f16 token embedding (the runner reads only its tensor types)."""
    from gguf import GGUFWriter

    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float16))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((8, 4), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _runners(gguf, methods=("llama-cpp", "llama-cpp-lookup"), log=None):
    engine = types.SimpleNamespace(tokenizer=ByteTokenizer())
    return build_runners(list(methods), engine, None, log=log or (lambda *_: None), gguf=gguf, isolated=False)


def test_prompt_ids_go_in_unchanged_and_eos_ends_the_answer(fake_llama, gguf):
    plain, lookup = _runners(gguf)
    messages = [{"role": "user", "content": "hi"}]
    text, new_tokens, wall, _, stats = plain.answer(messages, make_config(max_new_tokens=8, seed=3))
    llm = fake_llama.instances[0]
    assert llm.prompts == [ByteTokenizer().chat_prompt(messages)]  # no BOS added, nothing else
    assert (text, new_tokens) == (ByteTokenizer().decode(SCRIPT[:3]), 4)  # the EOS counts, as in ours
    assert stats["prompt_ids_as_ours"] and wall > 0 and llm.seeds == [3] and llm.resets == 1
    assert 0 < stats["time_to_first_token_s"] == stats["stage_seconds"]["target_prefill"] <= wall + 1e-4  # (rounded)
    plain.answer(messages, make_config(max_new_tokens=6, ignore_eos=True))
    assert llm.resets == 2  # every answer from an empty cache
    assert plain.answer(messages, make_config(max_new_tokens=6, ignore_eos=True))[1] == 6


def test_rows_are_labelled_with_the_gguf_precision(fake_llama, gguf):
    plain, lookup = _runners(gguf)
    assert (plain.name, plain.precision, plain.target_only) == ("llama-cpp", "f32", True)
    assert "f32 weights (f16: token_embd)" in plain.label and "prompt lookup" not in plain.label
    assert (lookup.name, lookup.target_only) == ("llama-cpp-lookup", False) and "prompt lookup" in lookup.label
    lookup.answer([{"role": "user", "content": "hi"}], make_config(max_new_tokens=4, gamma=5))
    assert fake_llama.instances[1].draft_model.num_pred_tokens == 5  # the bench's gamma per guess
    assert (fake_llama.instances[0].n_batch, fake_llama.instances[1].n_batch) == (512, LOOKUP_BATCH)
    fake_llama.instances[1].n_batch = 2  # a prompt past the lookup row's one batch is refused in one line
    with pytest.raises(GenerationError, match="prompt lookup: [0-9]+ tokens, batch 2"):
        lookup.answer([{"role": "user", "content": "hello"}], make_config(max_new_tokens=4))


def test_another_vocabulary_is_skipped(fake_llama, gguf, monkeypatch):
    monkeypatch.setattr(FakeLlama, "n_vocab", lambda self: 300)
    lines = []
    assert _runners(gguf, log=lines.append) == [] and all("vocabulary differs" in line for line in lines)


def test_no_gguf_or_no_package_skips_with_one_line(fake_llama, gguf, monkeypatch):
    lines = []
    assert _runners(None, log=lines.append) == [] and "needs the model as a .gguf" in lines[-1]
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert _runners(gguf, log=lines.append) == [] and "skipping llama-cpp, llama-cpp-lookup" in lines[-1]
    assert len(lines) == 2


@pytest.mark.slow
def test_real_llama_cpp_on_the_default_gguf(cache_dir):
    """llama.cpp on the default model's Q4_1 GGUF: our 37 prompt ids evaluated as given, q4_1 labelled, greedy
    repeats exactly."""
    pytest.importorskip("llama_cpp")
    from mirror_rt.evaluation.bench_llama import find_gguf
    from mirror_rt.models.default_model import default_model_folder
    from mirror_rt.models.tokenizer import HFTokenizer

    engine = types.SimpleNamespace(tokenizer=HFTokenizer(default_model_folder(cache_dir)))
    (plain,) = build_runners(["llama-cpp"], engine, None, log=print, gguf=find_gguf(None, cache_dir))
    assert plain.precision == "q4_1" and "q4_1 weights (q8_0: token_embd)" in plain.label
    messages, config = [{"role": "user", "content": "What is the capital of France?"}], make_config(max_new_tokens=12)
    first, again = plain.answer(messages, config), plain.answer(messages, config)
    assert first[4]["prompt_tokens"] == 37 and first[4]["prompt_ids_as_ours"]
    assert first[:2] == again[:2] and first[1] > 0
