"""The OpenAI-compatible server (`mirror-rt serve`; the `serve` extra): app, scheduler, metrics, uvicorn process.
It reaches the engine only through `Engine.stream` and `Generation.cancel`; the decode core never imports it.
Design notes: docs/design/serving.md.
"""
