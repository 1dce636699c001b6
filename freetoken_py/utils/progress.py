"""Rich progress bars on stderr, shown only when stderr is a terminal."""
from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def progress_bar(description: str, total: int, enabled: bool = True):
    """Yields `advance()`; a no-op when disabled or when stderr is not a TTY."""
    if not (enabled and sys.stderr.isatty()):
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task(description, total=total)
        yield lambda n=1: prog.advance(task, n)
