"""Method names of `mirror-rt bench` -> runners on one model pair.

`ar` expands into one runner per backend and thread count available (the fastest becomes the
baseline); `sd` and `mirror` are ours on the same engine; `hf-assisted` is transformers'
assisted generation with an int8 copy of the target as the assistant (the same kind of
draft). A method whose package is missing is skipped with a message, never a crash.
"""

from __future__ import annotations

import os
import time

from mirror_rt.runtime.bench import EngineRunner

KNOWN_METHODS = ("ar", "sd", "mirror", "hf-assisted", "ov-genai", "ov-genai-sd")


def build_runners(methods: list[str], engine, model_folder: str | None, log=print) -> list:
    """Runners for `methods` (unknown names are refused, unavailable ones skipped with a line)."""
    unknown = [m for m in methods if m not in KNOWN_METHODS]
    if unknown:
        raise ValueError(f"unknown bench method(s): {', '.join(unknown)} (known: {', '.join(KNOWN_METHODS)})")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    runners = []
    for method in methods:
        if method == "ar":
            runners += [EngineRunner(f"ar-torch-{t}t", engine, "ar", threads=t) for t in sorted({1, cores})]
        elif method in ("sd", "mirror"):
            runners.append(EngineRunner(method, engine, method, threads=cores if method == "sd" else None))
        elif method == "hf-assisted":
            runners.append(_hf_assisted(model_folder, cores, log))
        else:
            log(f"bench: skipping {method}: needs an OpenVINO export of the model (mirror-rt export), "
                "not available in this build")
    return [r for r in runners if r is not None]


class HFAssistedRunner:
    """transformers' `generate(assistant_model=...)`: greedy, batch 1."""

    name = "hf-assisted"

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
