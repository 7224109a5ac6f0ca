"""Tool calls: the prompt that offers tools and the parser that reads a call (it knows only a tokenizer).

A chat template that renders `tools` gets them; otherwise a system message lists them and asks for Hermes-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and earlier calls are written back that way. `auto`
answers are parsed afterwards (Hermes tags, or one call object); forced ones follow `serving.tool_schema`.
`parallel_tool_calls: false` keeps the first call.
"""

from __future__ import annotations

import json
import re
import uuid

from mirror_rt.serving import protocol
from mirror_rt.serving.errors import APIError

TOOL_PROMPT = ("You are a function calling AI model. You may call one or more functions to assist with the user "
               "query. The functions you may call, as JSON signatures:\n<tools>\n{tools}\n</tools>\nTo call a "
               "function, answer with a JSON object holding the function's name and arguments within "
               "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}}\n</tool_call>")
# a `required` call cut short: its name and its arguments so far
CUT_ITEM = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"(?:\s*,\s*"parameters"\s*:\s*(.*))?', re.S)
CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def prompt_ids(req: protocol.ChatRequest, tokenizer) -> list[int]:
    """Token ids of the conversation (and the tools it offers), ready for the assistant's turn."""
    offered = [t.model_dump(exclude_none=True) for t in req.tools] if req.tool_mode() else []
    native = bool(offered) and getattr(tokenizer, "renders_tools", False)
    messages = [_message(m, native) for m in req.messages]
    if offered and not native:
        text = TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in offered))
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
        else:
            messages.insert(0, {"role": "system", "content": text})
    try:
        return tokenizer.chat_prompt(messages, tools=offered if native else None)
    except ValueError as exc:  # no chat template (/v1/completions takes plain text), or one that refuses these
        raise APIError(400, str(exc), "messages") from None


def _message(message: protocol.Message, native: bool) -> dict:
    role = "system" if message.role == "developer" else message.role
    out = {"role": role, "content": message.text()}
    if message.role == "tool" and message.tool_call_id is not None and native:
        out["tool_call_id"] = message.tool_call_id
    if not message.tool_calls:
        return out
    calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in message.tool_calls]
    if native:
        out["tool_calls"] = [{"type": "function", "id": c.id, "function": call}
                             for c, call in zip(message.tool_calls, calls)]
        return out
    written = "\n".join(f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>" for call in calls)
    out["content"] = (out["content"] + "\n" if out["content"] else "") + written
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_calls(text: str, names: tuple[str, ...], mode: str | None,
                parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, tool_calls in OpenAI's shape) of a finished answer; content None when only calls (at most one
    when not `parallel`, as vLLM keeps the first)."""
    if mode is None:
        return text, []
    if mode not in ("auto", "required"):  # a named function: the output is its arguments
        return None, [_call(mode, text)]
    found = _required(text, names) if mode == "required" else _auto(text, names)
    if found is None:
        return text, []
    content, calls = found
    return content, calls if parallel else calls[:1]


def _required(text: str, names) -> tuple[str | None, list[dict]] | None:
    """The calls of a `required` answer (a JSON array of {"name", "parameters"}); cut by the token budget, the
    whole items and the cut one with its arguments so far."""
    start = text.lstrip()
    if not start.startswith("["):  # the grammar writes an array: only a text cut before it starts
        return None
    decoder, calls, pos = json.JSONDecoder(), [], len(text) - len(start) + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            cut = CUT_ITEM.match(text, pos)
            if cut and cut.group(1) in names:
                calls.append(_call(cut.group(1), cut.group(2) or ""))
            break
        if isinstance(item, dict) and item.get("name") in names:
            calls.append(_call(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return None, calls  # the array is the grammar's wrapper, never content, even cut before its first call


def _auto(text: str, names) -> tuple[str | None, list[dict]] | None:
    """Hermes tags anywhere in the text; else the whole text as one call object (or a list of them)."""
    blocks = [m.group(1) for m in CALL.finditer(text)]
    calls = [c for c in (_object_call(b, names) for b in blocks) if c is not None]
    if calls:
        rest = CALL.sub("", text).strip()
        return rest or None, calls
    try:
        whole = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    objects = whole if isinstance(whole, list) else [whole]
    calls = [c for c in (_object_call(o, names) for o in objects) if c is not None]
    return (None, calls) if calls else None


def _object_call(block, names) -> dict | None:
    """A call from {"name": ..., "arguments" | "parameters": {...}} (text or parsed) naming a known tool."""
    if isinstance(block, str):
        try:
            block = json.loads(block)
        except json.JSONDecodeError:
            return None
    if not isinstance(block, dict) or block.get("name") not in names:
        return None
    arguments = block.get("arguments", block.get("parameters", {}))
    return _call(block["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name,
                                                                                     "arguments": arguments}}
