"""The HTTP API room: the OpenAI-compatible server over one engine loop.

* `protocol` — request bodies read byte by byte, the request schemas and the policy of every field;
* `app` — the FastAPI app (handlers, streaming, errors in the OpenAI shape);
* `engine_loop` — the engine's own thread and the asyncio callers around it;
* `server` — ``python -m v41cp serve`` on uvicorn (one process, or rank 0 of several);
* `text` — the checkpoint's tokenizer, its chat format, streaming detokenization with stop strings.
"""
