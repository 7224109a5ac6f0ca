"""`mirror-rt serve --kv-cache-gb 0.3` (the console script, a real server on a free port, the official openai
client): the budget holds 3488 positions, fewer than one request of the default model's 8192-token context. The
server started and then refused every chat without max_tokens ("needs 8272 KV positions but the KV cache holds
3488"). Now it serves a stated smaller context: the start-up line says it and what to raise, requests without
max_tokens stop there, /v1/models reports it, and the start-up line's sizes are binary units, true to the bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from serve_support import free_port, wait_for_line

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three primary colors."}]


@pytest.fixture(scope="module")
def small_budget(tmp_path_factory, cache_dir):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    port = free_port()
    script = shutil.which("mirror-rt")
    command = [script] if script else [sys.executable, "-m", "mirror_rt.cli"]
    with open(log, "w") as err:
        proc = subprocess.Popen([*command, "serve", "--port", str(port), "--kv-cache-gb", "0.3"], stderr=err,
                                stdout=subprocess.DEVNULL, env=dict(os.environ, MIRROR_RT_CACHE=cache_dir))
    try:
        line = wait_for_line(log, "serving ", proc, timeout=600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        yield line, client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_start_up_line_states_the_smaller_context_and_true_sizes(small_budget):
    line, _ = small_budget
    assert "context 3408 tokens, not the model's 8192: the KV budget holds no more" in line, line
    assert "raise --kv-cache-gb" in line
    assert " GB" not in line and " MB" not in line  # --kv-cache-gb counts 2**30 bytes: GiB, MiB
    assert "KV budget 306.6 MiB (218 blocks of 16 positions, both models' KV; --kv-cache-gb; one request at the " \
           "model's full context needs 8272 positions" in line, line
    assert "prefix cache up to 109 of those blocks (50%; the target's KV only:" in line, line


def test_a_chat_without_max_tokens_is_served_up_to_that_context(small_budget):
    _, client = small_budget
    assert client.models.list().data[0].model_extra["max_model_len"] == 3408
    stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0,
                                            stream=True)
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    stream.close()
    assert first.choices[0].delta.content
    answer = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0,
                                            max_tokens=8)
    assert answer.usage.completion_tokens == 8


def test_a_prompt_past_that_context_gets_vllms_sentence_naming_it(small_budget):
    _, client = small_budget
    long = [{"role": "user", "content": "hello " * 3500}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2-135m-instruct", messages=long, max_tokens=4)
    assert "maximum context length is 3408 tokens" in caught.value.body["message"], caught.value.body
