"""`freetoken eval`: measurements of what a fast configuration changes (kld.py: next-token
distributions against a reference; tools.py: tool-call validity with and without constrained
decoding). Sits above llm: may import llm and everything below it; kld.py never imports server,
tools.py only the server's pure conversion / rendering / grammar / parsing modules."""
