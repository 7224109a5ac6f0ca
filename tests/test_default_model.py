"""The embedded default model (SmolLM2-135M-Instruct from a GGUF): answers, tokenizer, AR == SD.

Marked slow: the first run on a machine fetches the model (~93 MB) and converts it once.
"""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers and explain why they are prime.",
           "Translate 'good morning' into German and Spanish."]


def test_capital_of_france(real_engine):
    result = real_engine.generate(PROMPTS[0], mode="ar", max_new_tokens=30)
    assert "Paris" in result.text


@pytest.mark.parametrize("text", [
    "Digits 0123456789 and 3.14159, runs of spaces:    four, tabs\t\tand\nnewlines\n\n",
    "Accents: café, naïve, Straße, ñandú, Ångström; CJK: 東京は日本の首都です。 한국어; emoji 🙂🚀",
    "Code: def f(x):\n    return x ** 2  # square",
])
def test_tokenizer_round_trip(real_engine, text):
    tok = real_engine.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_repaired(real_engine):
    """One <|im_start|> at the start of the chat prompt (no doubled BOS); EOS is <|im_end|>."""
    tok = real_engine.tokenizer
    ids = tok.chat_prompt([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids[1] != 1
    assert tok.eos_token_ids == (2,)
    assert tok.encode("12") == [33, 34]  # digits split individually


@pytest.mark.parametrize("gamma", [2, 5])
def test_sd_equals_ar(real_engine, gamma):
    for prompt in PROMPTS[1:]:
        ar = real_engine.generate(prompt, mode="ar", max_new_tokens=48)
        sd = real_engine.generate(prompt, mode="sd", max_new_tokens=48, gamma=gamma)
        assert sd.tokens == ar.tokens and sd.text == ar.text


def test_sampling_with_stop_string(real_engine):
    result = real_engine.generate("Count from 1 to 20, separated by commas.", mode="sd", temperature=0.7,
                                  top_p=0.9, seed=3, max_new_tokens=60, stop_strings=["5"])
    assert "5" not in result.text and result.stop_reason in ("stop_string", "eos", "max_new_tokens")


def test_cli_sd_stats_equal_ar(cache_dir):
    outputs = {}
    for mode in ("ar", "sd"):
        proc = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "run", PROMPTS[0], "--mode", mode,
                               "--max-new-tokens", "40", "--stats", "--cache-dir", cache_dir],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        outputs[mode] = proc
    assert outputs["sd"].stdout == outputs["ar"].stdout and "Paris" in outputs["ar"].stdout
    assert "mean accepted length" in outputs["sd"].stderr and "tokens/s" in outputs["sd"].stderr


def test_ctrl_c_stops_mirror_promptly(cache_dir):
    """SIGINT after the first streamed text: exit 130 within seconds, what was printed stays printed."""
    import os
    import signal
    import time

    # A shell's background job (`cmd &`) starts with SIGINT ignored, and Python keeps it ignored: give the
    # child the default disposition so that this test means the same wherever CI runs it.
    proc = subprocess.Popen([sys.executable, "-m", "mirror_rt.cli", "run", "Write a long story about a dragon.",
                             "--mode", "mirror", "--max-new-tokens", "2000", "--cache-dir", cache_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(1)  # blocks until generation has started streaming
    assert first
    os.kill(proc.pid, signal.SIGINT)
    t0 = time.time()
    try:
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 130 and time.time() - t0 < 10
    assert b"interrupted" in proc.stderr.read()


@pytest.mark.parametrize("close", [False, True], ids=["left alone", "engine closed"])
def test_a_script_that_leaves_streams_unfinished_exits_cleanly(cache_dir, close):
    """A stream left with `break` (and one never read) keeps its generation alive until exit: the process
    aborted there (the draft worker inside ONNX Runtime at teardown: "terminate called", exit 134), or printed
    a traceback from a step run during teardown."""
    script = ("import mirror_rt\n"
              f"e = mirror_rt.load(cache_dir={cache_dir!r})\n"
              "g = e.stream('Write a very long essay about Rome.', max_new_tokens=2000)\n"
              "for k, piece in enumerate(g):\n"
              "    if k == 5:\n"
              "        break\n"
              "h = e.stream('Write a long essay.', max_new_tokens=500)\n"
              + ("e.close()\n" if close else "") + "print('left')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "left"
    assert "terminate called" not in done.stderr and "Traceback" not in done.stderr


def test_ctrl_c_while_the_engine_loads_exits_130_without_an_abort(cache_dir, tmp_path):
    """SIGINT while ONNX Runtime builds the sessions (a bundle not seen before: seconds, in loader threads): exit
    130 and one line. The interpreter used to tear down under those threads and abort ('terminate called
    without an active exception', exit 134)."""
    import shutil
    import signal
    import time

    from mirror_rt.devices.engines import default_bundle

    source = default_bundle(cache_dir, progress=False)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for f in source.iterdir():
        if f.is_file():
            shutil.copy(f, bundle / f.name)
    # the CLI's modules imported before 'ready' (the console script imports them under a guard of its own), so the
    # signal lands in `main` however slowly a loaded machine gets there
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from mirror_rt.cli import dispatch; "
                             "print('ready', flush=True); sys.exit(dispatch.main(sys.argv[1:]))",
                             "run", "hi", "--bundle", str(bundle)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == b"ready\n"  # imports done: the engine loads now
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert proc.returncode == 130 and "interrupted" in err and "terminate called" not in err, err
