"""Chat templates of a Hugging Face tokenizer folder, rendered as transformers renders them, without it.

The template comes from `chat_template.jinja` (which wins, as in transformers) or `tokenizer_config.json`'s
`chat_template` (a string, or named templates of which `default` is used). Rendering uses the environment
transformers' `apply_chat_template` uses: a sandboxed immutable jinja2 environment with trim_blocks and
lstrip_blocks, loop controls, a `tojson` filter that keeps non-ASCII text (json.dumps), the
`raise_exception` and `strftime_now` globals and the `{% generation %}` block (its body, no masks); the
template sees `messages`, `tools`, `documents`, `add_generation_prompt` and the special tokens as strings.
It does not tokenize. tests/test_tokenizer.py compares its ids with transformers' on many chats.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_template(folder: Path, config: dict) -> str | None:
    """The folder's chat template source, or None."""
    path = Path(folder) / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:
            raise ValueError(f"{folder}: several chat templates and none named 'default' ({', '.join(named)})")
        return named["default"]
    return template or None


def special_tokens(folder: Path, config: dict) -> dict:
    """The special tokens a template sees (transformers' `special_tokens_map`): name -> string, and
    `additional_special_tokens` -> list of strings. `special_tokens_map.json` counts only for folders whose
    config has no `added_tokens_decoder` (older saves), as in transformers."""
    values = {k: config[k] for k in (*SPECIAL_TOKEN_KEYS, "additional_special_tokens") if config.get(k)}
    legacy = Path(folder) / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        values |= {k: v for k, v in json.loads(legacy.read_text(encoding="utf-8")).items() if v}
    values |= {k: v for k, v in (config.get("extra_special_tokens") or {}).items() if v}
    out = {}
    for key, value in values.items():
        out[key] = [_content(v) for v in value] if isinstance(value, list) else _content(value)
    return out


def _content(token) -> str:
    """A token as saved: a string, or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else str(token)


def compile_template(source: str):
    """The jinja2 template of `source`, in transformers' chat-template environment."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks it for masks)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class TemplateError(ValueError):
    """The chat template refused the messages: its `raise_exception` ("roles must alternate"), or a field it
    reads that they lack."""


def render(template, messages: list[dict], specials: dict, add_generation_prompt: bool = True,
           tools: list[dict] | None = None) -> str:
    """The chat as text, ready for the assistant turn when `add_generation_prompt` (`tools`: for a template
    that renders them); TemplateError where the template refuses them."""
    import jinja2

    try:
        return template.render(messages=messages, tools=tools or None, documents=None,
                               add_generation_prompt=add_generation_prompt, **specials)
    except jinja2.exceptions.TemplateError as exc:
        raise TemplateError(f"the chat template refused the messages: {exc}") from None
