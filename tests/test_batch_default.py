"""The batched decoder on the embedded default model (SmolLM2-135M-Instruct's cached ONNX bundle, what `serve`
runs): 12 questions arriving staggered into batches of 4 and 8, in ar, sd and mirror, each text equal to its
single-stream reference; a second chat turn from the prefix cache."""

import json
from pathlib import Path

import pytest

from mirror_rt.runtime.batch.decoder import BatchConfig, BatchDecoder
from mirror_rt.runtime.batch.sequence import Sequence
from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.reference import generate

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench-dev.jsonl"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundle_engine(cache_dir):
    import mirror_rt

    return mirror_rt.load(cache_dir=cache_dir)


def questions(engine, count: int) -> list[list[int]]:
    """Chat prompts of the first `count` dev questions (SpecBench's first turns), or fixed ones without the file."""
    if DATA.is_file():
        texts = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()[:count]]
    else:
        texts = [f"Give me {i + 2} short facts about the number {i * 7 + 3}." for i in range(count)]
    return [engine.prompt_ids(t) for t in texts]


def reference(engine, prompt, max_new: int) -> list[int]:
    return [t for step in generate(engine.target, prompt, max_new) for t in step]


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
@pytest.mark.parametrize("max_num_seqs", [4, 8])
def test_staggered_questions_equal_single_stream(bundle_engine, mode, max_num_seqs):
    engine = bundle_engine
    prompts = questions(engine, 12)
    settings = BatchConfig(max_num_seqs=max_num_seqs, adaptive_speculation=False)  # each mode as asked, in batches
    decoder = BatchDecoder(engine.target, engine.draft, settings, cpus=engine.cpus)
    seqs = [Sequence(f"q{i}", p, GenerationConfig(max_new_tokens=24, mode=mode, ignore_eos=True), budget=24)
            for i, p in enumerate(prompts)]
    step = 0
    pending = list(enumerate(seqs))
    while pending or not decoder.idle:
        while pending and pending[0][0] * 3 <= step:  # one arrival every 3 steps
            decoder.add(pending.pop(0)[1])
        decoder.step()
        step += 1
    decoder.close()
    for seq in seqs:
        assert seq.tokens == reference(engine, seq.prompt, 24), seq.id


def test_second_turn_from_the_prefix_cache(bundle_engine):
    """The next turn of a chat reuses the first turn's blocks: the same text, far fewer prompt tokens computed."""
    engine = bundle_engine
    decoder = BatchDecoder(engine.target, engine.draft, BatchConfig(max_num_seqs=2), cpus=engine.cpus)
    chat = [{"role": "user", "content": "Name three rivers of Europe."}]
    first = Sequence("t1", engine.prompt_ids(chat), GenerationConfig(max_new_tokens=40, mode="mirror"), budget=40)
    decoder.add(first)
    while not decoder.idle:
        decoder.step()
    answer = engine.tokenizer.decode(first.tokens)
    chat += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Which is the longest?"}]
    ids = engine.prompt_ids(chat)
    second = Sequence("t2", ids, GenerationConfig(max_new_tokens=30, mode="mirror"), budget=30)
    decoder.add(second)
    while not decoder.idle:
        decoder.step()
    decoder.close()
    assert second.reused >= 16 * ((len(first.prompt) - 1) // 16)  # at least the first turn's full blocks
    assert second.tokens == reference(engine, ids, 30)
