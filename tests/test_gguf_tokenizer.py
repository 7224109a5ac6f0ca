"""A GGUF's tokenizer is built from the file itself (models/gguf_vocab.py) and splits text as llama.cpp does.

Small files of each family (tests/gguf_vocab_support.py): Qwen2 / DeepSeek-R1, Llama 3, SmolLM2, SentencePiece.
Their special tokens stay single, BOS/EOS/EOT/EOM lie inside the vocabulary, the chat template renders, text
survives encode/decode; and where llama-cpp-python is installed (the `llama-cpp` extra, never in CI), the ids
equal llama.cpp's own tokenization of the same file, BOS included as the file asks.
"""

from __future__ import annotations

import random

import pytest
from gguf_vocab_support import FAMILIES, QWEN_CONTROL, TRICKY, qwen2_gguf, write_gguf

from mirror_rt.models.gguf_vocab import VocabError, read_vocab, write_tokenizer
from mirror_rt.models.tokenizer import HFTokenizer

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (GGUF path, tokenizer folder written from it)."""
    root = tmp_path_factory.mktemp("gguf-vocab")
    out = {}
    for family, make in FAMILIES.items():
        path = make(root / f"{family}.gguf")
        write_tokenizer(path, root / family)
        out[family] = path, root / family
    return out


def sample_texts(seed: int = 0, count: int = 300) -> list[str]:
    """TRICKY, plus seeded random strings mixing spaces, digits, letters of several scripts, emoji and markers."""
    pools = [" \t\n\r", "abcXYZ'", "0123456789", ".,!?-_/()<>|", "éßñ", "東京日本語", "한국", "🙂🚀", "\u0301",
             "αβ", "абв", "\u00a0\u3000", "<｜User｜>", "</s>", "<think>"]
    rng = random.Random(seed)
    texts = list(TRICKY)
    for _ in range(count):
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40))))
    return texts


def test_qwen2_special_tokens_are_single_and_bos_eos_inside_the_vocabulary(files):
    path, folder = files["qwen2"]
    vocab, tok = read_vocab(path), HFTokenizer(folder)
    for name in [*QWEN_CONTROL, "<think>", "</think>", "</s>"]:
        assert tok.encode(name) == [vocab.tokens.index(name)], name
    ids = tok.encode("<｜User｜>hi<｜Assistant｜>")
    assert [ids[0], ids[-1]] == [vocab.tokens.index(n) for n in QWEN_CONTROL[1:3]] and len(ids) > 2
    bos, eos = vocab.special["bos"], vocab.special["eos"]
    assert tok.eos_token_ids == (eos,) and max(bos, eos) < tok.vocab_size == vocab.size == len(vocab.tokens) - 5
    ids = tok.chat_prompt([{"role": "user", "content": "What is 2+2?"}])
    assert ids[:2] == [bos, vocab.tokens.index("<｜User｜>")] and ids[-1] == vocab.tokens.index("<｜Assistant｜>")
    assert tok.decode(ids) == "What is 2+2?"  # control tokens skipped, text whole
    assert tok.decode(tok.encode("<think>\nx\n</think>")) == "<think>\nx\n</think>"  # user-defined: kept


def test_end_tokens_are_eos_eot_and_eom(files):
    path, folder = files["llama3"]
    vocab = read_vocab(path)
    names = [vocab.tokens[i] for i in HFTokenizer(folder).eos_token_ids]
    assert names == ["<|eot_id|>", "<|eom_id|>"] and vocab.add_bos  # llama3's default: BOS added


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_template_renders_and_text_round_trips(files, family):
    _, folder = files[family]
    tok = HFTokenizer(folder)
    chat = [{"role": "user", "content": "Hi 123"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "東京 🙂"}]
    assert tok.has_chat_template and "東京 🙂" in tok.decode(tok.chat_prompt(chat))
    plain = [t for t in TRICKY if not any(marker in t for marker in ("<｜", "<|", "</s>"))]
    for text in plain:
        assert tok.decode(tok.encode(text)) == text, text


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tokenizer_info_names_single_special_tokens_and_the_template(files, family):
    """What GET /tokenizer_info serves (lm-evaluation-harness reads the end token's id as /tokenize's first id)."""
    _, folder = files[family]
    tok = HFTokenizer(folder)
    info = tok.info()
    assert info["chat_template"] and "{%" in info["chat_template"]
    named = [info[key] for key in ("bos_token", "eos_token", "pad_token", "unk_token") if info[key] is not None]
    assert info["eos_token"] is not None
    for token in named:
        assert len(tok.encode(token)) == 1 and tok.encode(token)[0] in tok.special_ids, token


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_completion_prompt_gets_the_bos_the_file_asks_for(files, family):
    """A plain text prompt's ids (Engine.prompt_ids with chat=False: /v1/completions, `run --no-chat`) start with
    the BOS the file adds (tokenizer.ggml.add_bos_token, which llama.cpp, vLLM and transformers put before a
    prompt): Llama 3's yes; a chat prompt's BOS is its template's, once. It was never added."""
    from types import SimpleNamespace

    from mirror_rt.runtime.engine import Engine

    path, folder = files[family]
    vocab, tok = read_vocab(path), HFTokenizer(folder)
    text = "Hello world 42"
    ids = Engine.prompt_ids(SimpleNamespace(tokenizer=tok), text, chat=False)
    bos = [vocab.special["bos"]] if vocab.add_bos and "bos" in vocab.special else []
    assert ids == bos + tok.encode(text) and (family != "llama3" or bos)
    chat = tok.chat_prompt([{"role": "user", "content": text}])
    assert chat[:2] != [vocab.special.get("bos")] * 2  # never a BOS of the tokenizer's before the template's


def test_smollm_adds_no_bos_and_splits_digits(files):
    path, folder = files["smollm"]
    vocab, tok = read_vocab(path), HFTokenizer(folder)
    assert not vocab.add_bos and tok.eos_token_ids == (2,)
    assert tok.token_names(tok.encode("2024")) == ["2", "0", "2", "4"]


def test_trailing_padding_tokens_share_one_tokenizer(tmp_path):
    """Files padded to other sizes (Qwen's 7B and 1.5B) write the same tokenizer.json: one fingerprint."""
    for pads in (3, 9):
        write_tokenizer(qwen2_gguf(tmp_path / f"p{pads}.gguf", pads=pads), tmp_path / f"p{pads}")
    assert HFTokenizer(tmp_path / "p3").sha256() == HFTokenizer(tmp_path / "p9").sha256()


def test_a_special_token_past_the_embedding_is_refused(tmp_path):
    path = qwen2_gguf(tmp_path / "short.gguf", layers=1, embedding_rows=500)
    with pytest.raises(VocabError, match=r"short\.gguf: its (bos|eos|pad) token .* is past the model's 500 "):
        write_tokenizer(path, tmp_path / "out")


def test_an_unknown_pre_tokenizer_is_one_line(tmp_path):
    path = qwen2_gguf(tmp_path / "odd.gguf", pre="no-such-pre")
    with pytest.raises(VocabError, match=r"odd\.gguf: pre-tokenizer 'no-such-pre' is not supported \(supported: "):
        read_vocab(path)
    path = write_gguf(tmp_path / "t5.gguf", "llama", ["<pad>", "a"], [3, 1], model="t5")
    with pytest.raises(VocabError, match=r"t5\.gguf: tokenizer kind 't5' is not supported"):
        read_vocab(path)


def test_convert_gguf_takes_the_files_tokenizer(tmp_path):
    """The issue's Qwen2 GGUF defects, through the conversion: BOS, special tokens whole, eos inside the model."""
    import json

    from mirror_rt.models.gguf import convert_gguf

    path = qwen2_gguf(tmp_path / "tiny-qwen2.gguf", layers=1)
    folder = convert_gguf(path, tmp_path / "model", log=lambda *a: None)
    vocab, tok = read_vocab(path), HFTokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    assert tok.encode("<｜User｜>") == [vocab.tokens.index("<｜User｜>")]
    assert config["eos_token_id"] == tok.eos_token_ids[0] < config["vocab_size"] == len(vocab.tokens)
    assert tok.chat_prompt([{"role": "user", "content": "hi"}])[0] == config["bos_token_id"] == vocab.special["bos"]


@pytest.fixture(scope="module")
def llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]'): no comparison with "
                    "llama.cpp's tokenization")
    return llama_cpp


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ids_equal_llama_cpp(files, family, llama_cpp):
    from tokenizers import Tokenizer

    path, folder = files[family]
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    wrong = [text for text in sample_texts() if ours.encode(text).ids
             != theirs.tokenize(text.encode("utf-8"), add_bos=True, special=True)]
    assert wrong == []
