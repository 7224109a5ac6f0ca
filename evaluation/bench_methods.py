"""Method names of `mirror-rt bench` -> runners on one model pair.

Ours: `ar` (one row per thread count), `sd`, `mirror`, `mirror-no-lookup`, the precision rows (`ar-int8`,
`mirror-q4_1`...), the torch bf16 rows (bench_engines) and the replay rows `mirror-replay[:alpha]`, `sd-replay[:alpha]`
(an instrument: evaluation.replay). Peers: `hf-assisted` (transformers' assisted generation, an
int8 copy of the target assisting), `ov-genai` (GenAI's `LLMPipeline` at its default precision), `ov-genai-f32`,
`ov-genai-sd` (an int8 nncf copy drafting), `llama-cpp` and `llama-cpp-lookup` (bench_llama). A method whose package
is missing is skipped with a line; every runner names its precision (weights / compute / KV).
"""

from __future__ import annotations

import os
import time

from mirror_rt.evaluation.bench import EngineRunner, replay_runners
from mirror_rt.evaluation.bench_llama import METHODS as LLAMA_METHODS
from mirror_rt.evaluation.bench_llama import llama_runners
from mirror_rt.evaluation.replay import replay_method
from mirror_rt.runtime.affinity import available_cores

TORCH_BF16 = ("ar-bf16", "mirror-bf16", "ar-bf16-compiled", "mirror-bf16-compiled")  # bench_engines.bf16_runners
# ar / sd / mirror over the default model's bundle with its target at one precision (`mirror-rt export --weights`):
# `mirror-int8` is Mirror over the int8 target, `ar-int8` its reference (bench_engines.precision_runners)
BUNDLE_PRECISIONS = ("fp32", "int8", "int4", "q4_1", "w8a8")
PRECISION_METHODS = tuple(f"{mode}-{p}" for p in BUNDLE_PRECISIONS for mode in ("ar", "sd", "mirror"))
KNOWN_METHODS = ("ar", "sd", "mirror", "mirror-no-lookup", *PRECISION_METHODS, *TORCH_BF16, "hf-assisted", "ov-genai",
                 "ov-genai-f32", "ov-genai-sd", *LLAMA_METHODS)
OURS = ("ar", "sd", "mirror", "mirror-no-lookup", *PRECISION_METHODS)  # run by our engines (bench_engines)
# instruments, not drafts: the target's own greedy text proposed, each token kept with probability alpha
REPLAY_METHODS = ("mirror-replay[:alpha]", "sd-replay[:alpha]")  # (evaluation.replay)


def check_methods(methods: list[str]) -> None:
    """ValueError naming the unknown methods (or a replay method's bad alpha)."""
    unknown = [m for m in methods if m not in KNOWN_METHODS and replay_method(m) is None]
    if unknown:
        raise ValueError(f"unknown bench method(s): {', '.join(unknown)} (known: "
                         f"{', '.join(KNOWN_METHODS + REPLAY_METHODS)})")


def is_ours(method: str) -> bool:
    """Whether `method` runs on our engines (a replay row too)."""
    return method in OURS or replay_method(method) is not None


def build_runners(methods: list[str], engine, model_folder: str | None, log=print, gguf=None,
                  isolated: bool = True) -> list:
    """Runners for `methods` (unknown names are refused, unavailable ones skipped with a line); `gguf`: the
    model's GGUF file, for llama.cpp. `isolated`: each peer is built and run in a child process of its own
    (evaluation.peer_process), so that a peer's crash skips its row instead of ending the bench."""
    check_methods(methods)
    cores = len(available_cores())
    runners = []
    for method in methods:
        if method == "ar":
            runners += [EngineRunner(f"ar-torch-{t}t", engine, "ar", threads=t) for t in sorted({1, cores})]
        elif method in ("sd", "mirror"):
            runners.append(EngineRunner(method, engine, method, threads=cores if method == "sd" else None))
        elif method == "mirror-no-lookup":  # ablation: the draft without prompt-lookup guesses
            runners.append(EngineRunner(method, engine, "mirror", draft_lookup=0))
        elif method in TORCH_BF16 + PRECISION_METHODS or replay_method(method) is not None:
            continue  # other engines (bench_engines' bf16 and precision rows), or the replay rows below
        elif isolated:
            runners += _isolated_peer(method, engine.tokenizer, model_folder, gguf, log)
        elif method == "hf-assisted":
            runners.append(_hf_assisted(model_folder, cores, log))
        elif method not in LLAMA_METHODS:  # llama.cpp's below, from one GGUF
            runners.append(_ov_genai(method, model_folder, engine.tokenizer, cores, log))
    runners += replay_runners(methods, engine, "sd") + replay_runners(methods, engine, "mirror")
    if not isolated:
        runners += llama_runners(methods, gguf, engine.tokenizer, cores, log)
    return [r for r in runners if r is not None]


def _isolated_peer(method: str, tokenizer, model_folder: str | None, gguf, log) -> list:
    """The runner of one peer `method`, built in a child process (a SkippedPeer if that process dies)."""
    from mirror_rt.evaluation.peer_process import portable_tokenizer, start_peers

    args = (method, portable_tokenizer(tokenizer), model_folder, None if gguf is None else str(gguf))
    return start_peers([method], "mirror_rt.evaluation.bench_methods:peer_runner", args, log)


def peer_runner(method: str, tokenizer, model_folder: str | None, gguf: str | None, log=print) -> list:
    """In a peer's child process: its runner (none when it is unavailable here, said in a line)."""
    from pathlib import Path
    from types import SimpleNamespace

    from mirror_rt.evaluation.peer_process import rebuild_tokenizer

    engine = SimpleNamespace(tokenizer=rebuild_tokenizer(tokenizer))
    return build_runners([method], engine, model_folder, log, None if gguf is None else Path(gguf), isolated=False)


class HFAssistedRunner:
    """transformers' `generate(assistant_model=...)`: greedy, batch 1."""

    name = "hf-assisted"
    label = "transformers eager; target fp32 weights/compute/KV; assistant int8 weights, fp32 activations/KV"
    precision, target_only = "fp32", False

    def __init__(self, target, assistant, tokenizer, threads: int):
        self.target, self.assistant, self.tokenizer, self.threads = target, assistant, tokenizer, threads

    def answer(self, messages, config):
        import torch

        ids = self.tokenizer.chat_prompt(messages)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            input_ids = torch.tensor([ids])
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                           assistant_model=self.assistant, do_sample=False,
                                           max_new_tokens=config.max_new_tokens,
                                           pad_token_id=self.tokenizer.eos_token_ids[0])
            wall = time.perf_counter() - t0
        finally:
            torch.set_num_threads(previous)
        new = out[0, len(ids):].tolist()
        stops = set(self.tokenizer.eos_token_ids)
        text_ids = [t for t in new if t not in stops]
        return self.tokenizer.decode(text_ids), len(new), wall, [], {}


def _hf_assisted(model_folder: str | None, threads: int, log):
    if not model_folder or not os.path.isdir(model_folder):
        log("bench: skipping hf-assisted: needs a Hugging Face model folder")
        return None
    try:
        import transformers

        from mirror_rt.models.quantize import int8_copy
        from mirror_rt.models.tokenizer import HFTokenizer
    except ImportError as exc:
        log(f"bench: skipping hf-assisted: {exc}")
        return None
    target = transformers.AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype="float32").eval()
    target.generation_config.temperature = target.generation_config.top_p = target.generation_config.top_k = None
    assistant = int8_copy(target)
    return HFAssistedRunner(target, assistant, HFTokenizer(model_folder), threads)


class OVGenAIRunner:
    """OpenVINO GenAI's `LLMPipeline` (with a draft model when `speculative`), batch 1, on our chat-templated token
    ids (no template of its own), decoded with our tokenizer; its precision hints are reported in the stats."""

    def __init__(self, name: str, pipe, tokenizer, speculative: bool, stats: dict):
        self.name, self.pipe, self.tokenizer, self.speculative, self.stats = name, pipe, tokenizer, speculative, stats
        self.label = (f"openvino genai; {stats['weights']} weights, {stats['inference_precision']} compute, "
                      f"{stats['kv_cache_precision']} KV")
        compute = stats["inference_precision"].lower()
        self.precision = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}.get(compute, compute)
        self.target_only = not speculative

    def answer(self, messages, config):
        import numpy as np
        import openvino as ov
        import openvino_genai

        ids = self.tokenizer.chat_prompt(messages)
        prompt = openvino_genai.TokenizedInputs(ov.Tensor(np.array([ids], dtype=np.int64)),
                                                ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))
        settings = self._generation_config(config)
        t0 = time.perf_counter()
        result = self.pipe.generate(prompt, settings)
        wall = time.perf_counter() - t0
        new = list(result.tokens[0])
        stops = set(self.tokenizer.eos_token_ids)
        text = self.tokenizer.decode([t for t in new if t not in stops])
        stats = {**self.stats, "new_tokens": len(new), "wall_time_s": round(wall, 4),
                 "tokens_per_s": round(len(new) / wall, 2) if wall > 0 else 0.0}
        if self.speculative:
            sd = result.extended_perf_metrics
            stats |= {"num_accepted_tokens": int(sd.get_num_accepted_tokens()),
                      "draft_acceptance_rate": round(float(sd.get_draft_acceptance_rate()), 4)}
        return text, len(new), wall, [], stats

    def _generation_config(self, config):
        settings = self.pipe.get_generation_config()
        sampling = config.sampling
        settings.max_new_tokens = config.max_new_tokens
        settings.ignore_eos = config.ignore_eos
        settings.do_sample = sampling.temperature > 0
        if settings.do_sample:
            settings.temperature, settings.top_p, settings.rng_seed = sampling.temperature, sampling.top_p, config.seed
            settings.min_p = sampling.min_p
            if sampling.top_k:
                settings.top_k = sampling.top_k
        if self.speculative:
            settings.num_assistant_tokens = config.gamma
        return settings


def _ov_genai(method: str, model_folder: str | None, tokenizer, threads: int, log):
    """`ov-genai` / `ov-genai-sd` on GenAI folders exported from the target (cached)."""
    if not model_folder:
        log(f"bench: skipping {method}: needs the target's model folder or preset")
        return None
    try:
        import nncf  # noqa: F401 -- the int8 draft's compression, imported late by the exporter
        import openvino as ov
        import openvino_genai
        import openvino_tokenizers  # noqa: F401 -- the tokenizer models GenAI's folders carry

        from mirror_rt.exporters.genai import export_genai_folder
    except ImportError as exc:
        log(f"bench: skipping {method}: {exc} (pip install openvino-genai openvino-tokenizers nncf)")
        return None
    speculative = method == "ov-genai-sd"
    properties = {"INFERENCE_NUM_THREADS": threads}
    if method == "ov-genai-f32":  # exact: the precision our fp32 rows compute at
        properties |= {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    no_tokenizer = f"bench: skipping {method}: GenAI's speculative pipeline needs a tokenizer, {model_folder} has none"
    if speculative and not os.path.isfile(os.path.join(model_folder, "tokenizer.json")):
        log(no_tokenizer)  # a preset: checked before exporting anything
        return None
    target = export_genai_folder(model_folder, weights="fp32", log=log)
    if speculative and not (target / "openvino_tokenizer.xml").exists():
        log(no_tokenizer + " that openvino_tokenizers converts")
        return None
    if speculative:
        draft = openvino_genai.draft_model(str(export_genai_folder(model_folder, weights="int8", log=log)),
                                           "CPU", **properties)
        pipe = openvino_genai.LLMPipeline(str(target), "CPU", draft_model=draft, **properties)
    else:
        pipe = openvino_genai.LLMPipeline(str(target), "CPU", **properties)
    core = ov.Core()  # hints not passed: the pipelines compile with the device defaults
    default = {key: core.get_property("CPU", key).to_string()
               for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION")}
    asked = default | {k: v for k, v in properties.items() if k in default}
    stats = {"threads": threads, "weights": "fp32 target" + (", int8 draft" if speculative else ""),
             "inference_precision": asked["INFERENCE_PRECISION_HINT"],
             "kv_cache_precision": asked["KV_CACHE_PRECISION"]}
    return OVGenAIRunner(method, pipe, tokenizer, speculative, stats)
