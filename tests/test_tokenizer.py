"""HFTokenizer (the `tokenizers` package and jinja2, no transformers) gives transformers' text and ids: chat
templates of several styles, system prompts, multi-turn chats, with and without the generation prompt."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import write_hf_folder

transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "w5 w9 w17"}],
    [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w10 w11"}],
    [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8 w9"}, {"role": "user", "content": "w12"}],
    [{"role": "system", "content": "Ünïcödé 😀 \"quoted\" <tag>"}, {"role": "user", "content": "  w5\n\nw6\t"}],
]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEMPLATES = {
    "chatml": CHATML,
    # bos_token from the config, blocks trimmed, loop controls, tojson keeping non-ASCII text, a generation block
    "llama-like": ("{{ bos_token }}{% for m in messages %}\n  {% if m['role'] == 'system' %}{{ m['content'] | tojson }}"
                   "{% continue %}{% endif %}\n  [{{ m['role'] | upper }}] {% generation %}{{ m['content'] | trim }}"
                   "{% endgeneration %} {{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT]"
                   "{% endif %}"),
    "strict": ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
               "{{ raise_exception('bad role') }}{% endif %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
               "{% if add_generation_prompt %}a:{% endif %}"),
}


def _folder(tmp_path, template: str, in_file: bool):
    folder = write_hf_folder(tmp_path / "hf", vocab_size=40)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"bos_token": "w2", "eos_token": "</s>", "clean_up_tokenization_spaces": True}
    if in_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("in_file", [False, True], ids=["config", "jinja-file"])
@pytest.mark.parametrize("style", list(TEMPLATES))
def test_chat_prompts_equal_transformers(tmp_path, style, in_file):
    from mirror_rt.models import chat_template
    from mirror_rt.models.tokenizer import HFTokenizer

    folder = _folder(tmp_path, TEMPLATES[style], in_file)
    ours, theirs = HFTokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for chat in CHATS:
        for generation_prompt in (True, False):
            text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
            assert chat_template.render(ours._template, chat, ours._specials, generation_prompt) == text
        ids = ours.chat_prompt(chat)
        assert ids == theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.vocab_size, ours.eos_token_ids) == (len(theirs), (theirs.eos_token_id,))


def test_raise_exception_in_a_template_is_an_error(tmp_path):
    from mirror_rt.models.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(_folder(tmp_path, TEMPLATES["strict"], in_file=True))
    with pytest.raises(Exception, match="bad role"):
        tokenizer.chat_prompt([{"role": "tool", "content": "w5"}])


def test_folder_without_template_refuses_a_chat(tmp_path):
    from mirror_rt.models.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(write_hf_folder(tmp_path / "hf", vocab_size=40))
    assert not tokenizer.has_chat_template and tokenizer.encode("w5 w6") == [5, 6]
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.chat_prompt([{"role": "user", "content": "w5"}])


@pytest.mark.slow
def test_default_model_ids_equal_transformers(cache_dir):
    """SmolLM2's own template and byte-level BPE: the same ids, special ids and text as transformers."""
    from mirror_rt.models.default_model import default_model_folder
    from mirror_rt.models.tokenizer import HFTokenizer

    folder = default_model_folder(cache_dir)
    ours, theirs = HFTokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    chats = CHATS + [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "You are a pirate. Answer in 12 words."},
                      {"role": "user", "content": "Write 3 haiku, 1234567 — and ‘quotes’."},
                      {"role": "assistant", "content": "Arr!\n\n- one\n- two"}, {"role": "user", "content": "More"}]]
    for chat in chats:
        for generation_prompt in (True, False):
            expected = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=generation_prompt)
            from mirror_rt.models import chat_template

            text = chat_template.render(ours._template, chat, ours._specials, generation_prompt)
            assert ours.encode(text) == expected
        ids = ours.chat_prompt(chat)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    specials = sorted({theirs.bos_token_id, *theirs.all_special_ids, theirs.eos_token_id})
    assert (ours.vocab_size, ours.eos_token_ids, list(ours.special_ids)) == (len(theirs), (2,), specials)


@pytest.mark.slow
def test_cli_run_of_the_default_model_does_not_import_transformers(cache_dir):
    """`mirror-rt run` on the default bundle (cached) answers without importing transformers."""
    code = ("import sys; from mirror_rt.cli import main; "
            "rc = main(['run', 'What is the capital of France?', '--max-new-tokens', '4', "
            "'--cache-dir', sys.argv[1]]); "
            "print('transformers' in sys.modules, rc)")
    done = subprocess.run([sys.executable, "-c", code, cache_dir], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False 0"


def test_prefix_space_follows_the_config_as_in_transformers(tmp_path):
    """A ByteLevel pre-tokenizer saved with add_prefix_space=True runs without it unless the config asks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from mirror_rt.models.tokenizer import HFTokenizer

    vocab = {"<unk>": 0, "</s>": 1, "ab": 2, "Ġab": 3, "Ġcd": 4, "cd": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    for asked, expected in ((None, [2, 4]), (True, [3, 4])):
        folder = tmp_path / str(asked)
        folder.mkdir()
        tok.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config | ({} if asked is None else
                                                                           {"add_prefix_space": asked})))
        theirs = transformers.AutoTokenizer.from_pretrained(folder).encode("ab cd", add_special_tokens=False)
        assert HFTokenizer(folder).encode("ab cd") == theirs == expected
