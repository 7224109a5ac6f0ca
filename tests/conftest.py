"""Shared fixtures: tiny seeded models (float64), perturbed drafts, tiny HF folders.

No network and no hub: the only external model is the embedded default, fetched once per
machine into the cache by the `real_engine` fixture (tests marked `slow`).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.models.config import ModelConfig
from mirror_rt.models.transformer import random_model
from mirror_rt.runtime.backend import Capabilities

torch.set_num_threads(1)


def tiny_target(seed: int = 0, scale: float = 30.0, vocab_size: int = 97, max_seq_len: int = 256):
    """A tiny float64 Llama target; `scale` sharpens logits so greedy text is not uniform noise."""
    import dataclasses

    config = dataclasses.replace(ModelConfig.from_name("tiny"), vocab_size=vocab_size, max_seq_len=max_seq_len)
    return random_model(config, seed=seed, dtype=torch.float64, scale=scale)


def perturbed_copy(model, noise: float, seed: int):
    """A draft that agrees with `model` often but not always: its weights plus Gaussian noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise * p.std().clamp(min=1e-3))
    return draft


@pytest.fixture
def tiny_pair():
    """(target, draft) LoadedModels: tiny float64 target and a noisy copy as the draft."""
    target = tiny_target(seed=0)
    return TorchModel(target), TorchModel(perturbed_copy(target, noise=0.3, seed=1))


def write_hf_folder(folder: Path, vocab_size: int = 64, model_type: str = "llama", seed: int = 0,
                    **sizes) -> Path:
    """A tiny Hugging Face folder: config.json, safetensors weights, a word-level tokenizer (`sizes`: config
    fields to change, e.g. num_key_value_heads)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    hf = dict(model_type=model_type, vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
              tie_word_embeddings=False, eos_token_id=1) | sizes
    (folder / "config.json").write_text(json.dumps(hf))
    if model_type in ("llama", "mistral", "qwen2", "qwen3"):
        model = random_model(ModelConfig.from_hf(hf), seed=seed)
        save_file({f"model.{k}" if k != "lm_head.weight" else k: v.contiguous()
                   for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}))
    return folder


@pytest.fixture(scope="session")
def cache_dir() -> str:
    """The model cache shared by tests (the default model is fetched into it once)."""
    return os.environ.get("MIRROR_RT_CACHE") or str(Path.home() / ".cache" / "mirror-rt")


@pytest.fixture(scope="session")
def real_engine(cache_dir):
    """The embedded default model (SmolLM2-135M-Instruct), target drafting for itself."""
    import mirror_rt

    return mirror_rt.load(cache_dir=cache_dir, threads=2)


class ListCache:
    """A cache for test doubles: the fed tokens themselves."""

    def __init__(self, capacity: int):
        self.capacity, self.tokens = capacity, []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def rollback(self, length: int) -> None:
        assert 0 <= length <= len(self.tokens)
        del self.tokens[length:]


class MarkovModel:
    """A LoadedModel whose next-token log-probs depend only on the current token: log P[t].

    Sequences sampled from it form a Markov chain with transition matrix P, which makes the
    lossless-sampling property testable on one long generation. Also a split target
    (forward_prefix/forward_suffix), with an early exit that is exactly the final distribution.
    """

    def __init__(self, transition, kappa: int = 2, max_seq_len: int = 1 << 20):
        import numpy as np

        self.logp = np.log(np.asarray(transition, dtype=np.float64))
        self.vocab_size = self.logp.shape[0]
        self.max_seq_len, self.kappa = max_seq_len, kappa
        self._window = None
        self.capabilities = Capabilities(split=True)  # caches of its own: no rows of a pool

    def new_cache(self, capacity: int) -> ListCache:
        return ListCache(capacity)

    def forward(self, tokens, cache):
        assert cache.length + len(tokens) <= cache.capacity
        cache.tokens.extend(tokens)
        return self.logp[list(tokens)]

    def forward_last(self, tokens, cache):
        return self.forward(tokens, cache)[-1:]

    def forward_prefix(self, tokens, cache):
        import numpy as np

        self._window = list(tokens)
        rows = self.logp[self._window]
        ids = np.argsort(-rows, axis=-1)[:, :self.kappa]
        return ids, np.take_along_axis(rows, ids, axis=-1)

    def forward_prefix_only(self, tokens, cache):
        self._window = list(tokens)

    def forward_suffix(self, cache):
        tokens, self._window = self._window, None
        return self.forward(tokens, cache)


class Decoded(NamedTuple):
    """A sequence decoded by the batched decoder: its tokens, the sequence, its figures."""

    tokens: list
    sequence: object  # runtime.batch.sequence.Sequence
    stats: dict  # Metrics.summary() and runtime.mirror.stats.batch_stats (Mirror's reuse, phases, events...)


def decode_many(target, draft, prompts, max_num_seqs: int = 4, rules=None, draft_config=None, arrivals=None,
                **options) -> list[Decoded]:
    """`prompts` through the batched decoder, the engine's one decode path, in batches of up to `max_num_seqs`
    (each mode as asked: no load policy), every request's settings from `options` (GenerationConfig fields, sampling
    ones flat; mode sd by default); `rules`: a TokenRules per prompt (or None); `arrivals`: the step each prompt
    joins at (all at once by default)."""
    from mirror_rt.runtime.batch.decoder import BatchConfig, BatchDecoder
    from mirror_rt.runtime.batch.sequence import Sequence
    from mirror_rt.runtime.config import make_config
    from mirror_rt.runtime.mirror.stats import batch_stats

    config = make_config(**{"mode": "sd", **options})
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=max_num_seqs, adaptive_speculation=False))
    if draft_config is not None:
        decoder.mirror.draft_config = draft_config
    budget = min(config.max_new_tokens, target.max_seq_len)
    seqs = [Sequence(f"s{i}", list(p), config, max(0, min(budget, target.max_seq_len - len(p))),
                     rules=rules[i] if rules else None) for i, p in enumerate(prompts)]
    pending = sorted(zip(arrivals or [0] * len(seqs), range(len(seqs))))
    step = 0
    try:
        while pending or not decoder.idle:
            while pending and pending[0][0] <= step:
                decoder.add(seqs[pending.pop(0)[1]])
            decoder.step()
            step += 1
            assert step < 20_000
    finally:
        decoder.close()
    return [Decoded(s.tokens, s, s.metrics.summary() | batch_stats(s)) for s in seqs]


def decode(target, draft, prompt, max_num_seqs: int = 1, rules=None, **options) -> Decoded:
    """One prompt through the batched decoder (`decode_many`), alone in a batch of `max_num_seqs` rows."""
    return decode_many(target, draft, [prompt], max_num_seqs, [rules] if rules is not None else None, **options)[0]


def flat(steps) -> list:
    """The tokens of a decoder's steps (runtime.reference.generate yields one list per step)."""
    return [t for step in steps for t in step]


def random_transition(vocab: int, seed: int, concentration: float = 0.8):
    import numpy as np

    return np.random.default_rng(seed).dirichlet(np.ones(vocab) * concentration, size=vocab)


class BundleParts(NamedTuple):
    """A loaded bundle taken apart: what tests of graphs and backends look at."""

    target: object
    draft: object
    tokenizer: object
    manifest: object


def load_parts(folder, target_device: str = "cpu", draft_device: str = "cpu", strict: bool = False,
               threads: int | None = None) -> BundleParts:
    """The one `load_bundle` (an Engine), unpacked as (target, draft, tokenizer, manifest)."""
    from mirror_rt import load_bundle

    engine = load_bundle(str(folder), target=target_device, draft=draft_device, strict_devices=strict,
                         threads=threads, mode="ar")
    return BundleParts(engine.target, engine.draft, engine.tokenizer, engine.manifest)


@pytest.fixture(scope="module")
def engine():
    """A tiny float64 engine for a module's server (tests.serve_support.tiny_engine)."""
    from serve_support import tiny_engine

    return tiny_engine()


@pytest.fixture(scope="module")
def reference():
    """An identical engine no server touches: the oracle of the serving tests' equality checks."""
    from serve_support import tiny_engine

    return tiny_engine()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium for a module's page tests (they skip, saying why, where none can be had)."""
    from browser_support import browser_or_skip

    playwright, browser = browser_or_skip()
    yield browser
    browser.close()
    playwright.stop()


@pytest.fixture
def page(browser, server):
    """The playground page of the module's `server`, in a fresh browser context."""
    from browser_support import opened_page

    with opened_page(browser, server.url) as opened:
        yield opened


@pytest.fixture(scope="module")
def server(engine):
    """A real server (uvicorn on a free port) over the module's `engine`, a queue of 4; modules that need
    other settings define their own."""
    from serve_support import start

    running = start(engine, max_queued=4)
    yield running
    running.stop()


@pytest.fixture(scope="module", params=["torch", "onnx"])
def pair(request, tmp_path_factory):
    """(target, draft) of the batched decoder's tests: tiny torch models (float64), or a tiny exported ONNX bundle on
    ONNX Runtime (the default serving path: batched graphs over row pools, an int8 draft that adopts the target's
    rows)."""
    from mirror_rt.devices.torch.split import TorchSplitTarget

    if request.param == "torch":
        target = tiny_target(seed=3)
        return TorchSplitTarget(target), TorchModel(perturbed_copy(target, noise=0.3, seed=4))
    from mirror_rt import load_bundle
    from mirror_rt.exporters.export import export_bundle

    folder = export_bundle("tiny", tmp_path_factory.mktemp("bundle"), progress=False)
    engine = load_bundle(str(folder), mode="mirror")
    return engine.target, engine.draft
