"""`freetoken eval`: measurements of what a fast configuration changes (kld.py: next-token
distributions against a reference). Sits above llm: may import llm and everything below it,
never server."""
