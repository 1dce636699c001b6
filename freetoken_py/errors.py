"""User-facing error types. Anything raised as a FreetokenError is printed as one line by the CLI
(exit code 2) and turned into a 4xx by the server; everything else is a bug."""
from __future__ import annotations


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """An exception's message cut to its first line (and to `limit` characters), or its type's name
    when it has none: for one-line reports of errors raised by libraries."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


class FreetokenError(Exception):
    """A problem the user can fix; the message says what and how."""


class ModelLoadError(FreetokenError):
    """The checkpoint directory is missing something, or a file/tensor is malformed."""


class UnsupportedModelError(ModelLoadError):
    """config.json names an architecture this build does not implement."""


class ContextLengthError(FreetokenError):
    """The prompt (plus requested output) does not fit in the model's context window."""


class RequestAbortedError(FreetokenError):
    """A request was aborted by the engine (integrity failure, cancellation)."""
