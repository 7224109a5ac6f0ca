"""vLLM's token routes, at the root and never behind the key: `POST /tokenize` (a prompt or chat messages to token ids,
with the context's size), `POST /detokenize` (token ids to text) and `GET /tokenizer_info` (the special tokens and
the chat template: lm-evaluation-harness then tokenizes through the server, with no tokenizer download)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from mirror_rt.serving import protocol, tools
from mirror_rt.serving.errors import APIError
from mirror_rt.serving.intake import read_json, refuse_unread


def add_token_routes(app: FastAPI, state) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request)
        state.require_ready()
        engine = state.engine
        state.require_model(body.get("model") if isinstance(body, dict) else None)
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            req = protocol.parse(protocol.ChatRequest, body)
            refuse_unread([m.text() for m in req.messages], engine, state.context, 0)
            ids = tools.prompt_ids(req, engine.tokenizer)
        elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
            refuse_unread([body["prompt"]], engine, state.context, 0)
            specials = body.get("add_special_tokens", True)  # vLLM's: a completion's prompt, BOS and all
            if not isinstance(specials, bool):
                raise APIError(400, "add_special_tokens must be true or false", "add_special_tokens")
            text = body["prompt"]
            ids = engine.prompt_ids(text, chat=False) if specials else engine.tokenizer.encode(text)
        else:
            raise APIError(400, "send 'prompt' (a string) or 'messages' (a list)", "prompt")
        names = engine.tokenizer.token_names(ids) if body.get("return_token_strs") is True else None
        return {"count": len(ids), "max_model_len": state.context, "tokens": ids, "token_strs": names}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        state.require_ready()
        return state.engine.tokenizer.info() | {"model_max_length": state.context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request)
        state.require_ready()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        vocab = state.engine.target.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise APIError(400, f"'tokens' must be a list of token ids in 0..{vocab - 1}", "tokens")
        return {"prompt": state.engine.tokenizer.decode(tokens)}
