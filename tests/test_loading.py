"""Model references resolve to folders, presets or one-line errors."""

import json

import pytest
from conftest import write_hf_folder

import mirror_rt
from mirror_rt.models.loading import ModelError, load_checkpoint


def test_hf_folder_loads(tmp_path):
    ckpt = load_checkpoint(str(write_hf_folder(tmp_path / "m")))
    assert ckpt.model.config.vocab_size == 64 and ckpt.tokenizer.encode("w5 w6") == [5, 6]


def test_missing_path_named(tmp_path):
    with pytest.raises(ModelError, match="model not found: .*nope"):
        load_checkpoint(str(tmp_path / "nope"))


def test_unsupported_architecture_named(tmp_path):
    folder = write_hf_folder(tmp_path / "g", model_type="gpt2")
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_checkpoint(str(folder))


def test_weights_not_matching_config(tmp_path):
    folder = write_hf_folder(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="weights do not match"):
        load_checkpoint(str(folder))


@pytest.mark.parametrize("fields, says", [
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"attention_bias": True}, "unsupported attention_bias on a llama model: its o_proj has a bias too"),
    ({"mlp_bias": True}, "unsupported mlp_bias"),
])
def test_fields_that_change_the_model_are_refused_not_ignored(tmp_path, fields, says):
    """An activation, o_proj or MLP bias the runtime does not implement would run another model, silently."""
    folder = write_hf_folder(tmp_path / "m")
    (folder / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text()) | fields))
    with pytest.raises(ModelError, match=says):
        load_checkpoint(str(folder))


@pytest.mark.parametrize("fields, context", [
    ({"model_type": "mistral", "sliding_window": 16}, 16),  # full attention is exact within the window
    ({"model_type": "mistral", "sliding_window": None}, 64),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False}, 64),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True}, 16),
    ({"model_type": "mistral", "sliding_window": 4096}, 64),
])
def test_a_sliding_window_caps_the_context(tmp_path, fields, context):
    folder = write_hf_folder(tmp_path / "m", **fields)
    assert load_checkpoint(str(folder)).model.config.max_seq_len == context


def test_shapes_that_do_not_match_are_named(tmp_path):
    folder = write_hf_folder(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"weights do not match the config: layers\.0\.mlp\.\w+\.weight is "
                                         r"\[\d+, \d+\] in the weights, \[\d+, \d+\] by the config \(and 5 more\)"):
        load_checkpoint(str(folder))


def test_a_truncated_weights_file_is_one_line(tmp_path):
    folder = write_hf_folder(tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelError, match="cannot read .*model.safetensors: "):
        load_checkpoint(str(folder))


def test_a_folder_without_a_tokenizer_is_one_line(tmp_path):
    folder = write_hf_folder(tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(ValueError, match="no tokenizer in .*m \\(expected tokenizer.json or tokenizer.model\\)"):
        load_checkpoint(str(folder))


def test_chat_messages_without_a_chat_template_are_a_prompt_error(tmp_path):
    from mirror_rt.runtime.engine import PromptError

    engine = mirror_rt.load(str(write_hf_folder(tmp_path / "m")), "target")
    assert not engine.tokenizer.has_chat_template
    with pytest.raises(PromptError, match="no chat template"):
        engine.generate([{"role": "user", "content": "w5"}], max_new_tokens=2)
    assert engine.generate("w5 w6", max_new_tokens=2).tokens  # plain text runs


def test_vocabulary_mismatch_names_both_sizes(tmp_path):
    target, draft = write_hf_folder(tmp_path / "t", 64), write_hf_folder(tmp_path / "d", 80)
    with pytest.raises(ValueError, match="vocabulary mismatch.*64.*80"):
        mirror_rt.load(str(target), str(draft))


def test_api_generate_and_stream_on_preset():
    engine = mirror_rt.load("tiny", "tiny")
    result = engine.generate("hello", mode="sd", max_new_tokens=12, gamma=3)
    assert result.stats["new_tokens"] >= 1 and result.stats["mode"] == "sd"
    pieces = list(engine.stream("hello", mode="ar", max_new_tokens=12))
    assert "".join(pieces) == engine.generate("hello", mode="ar", max_new_tokens=12).text


def test_a_request_without_a_mode_runs_the_engines_default():
    from mirror_rt.devices.torch.backend import TorchModel
    from mirror_rt.runtime.engine import Engine

    engine = mirror_rt.load("tiny", "tiny", log=lambda *_: None)
    assert mirror_rt.GenerationConfig().mode is None and engine.default_mode == "mirror"
    result = engine.generate("hello", max_new_tokens=12)
    assert result.stats["mode"] == "mirror"
    assert result.tokens == engine.generate("hello", mode="ar", max_new_tokens=12).tokens
    unsplit = Engine(TorchModel(engine.target.model), engine.tokenizer, engine.draft)  # a plain target: no early exit
    assert unsplit.default_mode == "sd" and unsplit.generate("hello", max_new_tokens=4).stats["mode"] == "sd"


def test_prompt_beyond_context_refused():
    engine = mirror_rt.load("tiny")
    with pytest.raises(ValueError, match="prompt too long: 300 tokens.*256"):
        engine.generate("x" * 300)


def test_prompt_ids_outside_the_vocabulary_refused():
    engine = mirror_rt.load("tiny")
    vocab = engine.target.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=f"prompt token id {bad} is outside the vocabulary \\(0..{vocab - 1}\\)"):
            engine.submit([1, bad, 2], mirror_rt.GenerationConfig(max_new_tokens=2))
    assert engine.pending() == 0 and engine.generate([1, vocab - 1], max_new_tokens=2).tokens  # still serves


@pytest.mark.parametrize("prompt,reason", [
    (None, "not NoneType"), (5, "not int"), (b"hi", "not bytes"), ("a\ud800", "lone surrogate at index 1"),
    ([], "empty prompt"), ([1, "a"], "not a mix"), ([{"role": "user"}], "message 0 \\(user\\) has no 'content'"),
    ([{"content": "x"}], "message 0 needs a string 'role'"), ([{"role": "user", "content": 5}], "of type int"),
])
def test_prompts_of_the_wrong_shape_get_one_line(prompt, reason):
    """Anything but text, token ids or chat messages is a PromptError naming what is wrong, not a tokenizer's
    or a template's error; the engine still serves after it."""
    engine = mirror_rt.load("tiny")
    with pytest.raises(mirror_rt.GenerationError, match=reason):
        engine.generate(prompt, max_new_tokens=2)
    assert engine.generate((5, 6, 7), max_new_tokens=2).tokens == engine.generate([5, 6, 7], max_new_tokens=2).tokens


def test_wrong_types_are_refused_before_they_reach_the_batch():
    engine = mirror_rt.load("tiny")
    for bad in ({"max_new_tokens": 1.5}, {"seed": 1.5}, {"gamma": True}, {"stop_strings": "5"}):
        with pytest.raises(ValueError, match="must be"):
            engine.generate("hello", **bad)
    assert engine.pending() == 0 and engine.generate("hello", max_new_tokens=3).tokens


def test_a_failed_step_ends_its_generations_and_the_engine_serves_on(monkeypatch):
    """Left in the batch, the generations of a failed step failed every later step (float max_new_tokens did)."""
    engine = mirror_rt.load("tiny")
    expected = engine.generate("hello", mode="ar", max_new_tokens=6).tokens
    stream = engine.stream("hello", mode="ar", max_new_tokens=6)
    pieces = iter(stream)
    next(pieces)
    monkeypatch.setattr(engine.decoder, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        list(pieces)
    monkeypatch.undo()
    assert engine.pending() == 0 and stream.stop_reason == "error"
    assert engine.generate("hello", mode="ar", max_new_tokens=6).tokens == expected
