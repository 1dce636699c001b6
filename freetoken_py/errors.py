"""User-facing error types. Anything raised as a FreetokenError is printed as one line by the CLI
(exit code 2) and turned into a 4xx by the server; everything else is a bug."""


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
