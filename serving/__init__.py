"""The OpenAI-compatible server (`mirror-rt serve`): app, scheduler, metrics, and the uvicorn process.

Needs the `serve` extra (fastapi, uvicorn, prometheus-client); nothing here is imported by the
decode core, and the app talks to the engine only through `Engine.stream` and `Generation.cancel`.
"""
