"""`freetoken serve`: OpenAI- and Anthropic-compatible HTTP APIs over one LLM.

The wire formats live here and nowhere else; the engine is reached only through `LLM` (owned by
one engine thread, see `async_engine.py`). This package never imports kvcache, residency, engine
or scheduler (tests/test_layering.py).
"""
