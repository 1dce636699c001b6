"""Imports go downward only (docs/architecture.md); `freetoken --help` does not pay for torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

# subpackage -> packages it must never import (directly or transitively)
FORBIDDEN = {
    "freetoken_py.kvcache": ["freetoken_py.engine", "freetoken_py.scheduler", "freetoken_py.server", "freetoken_py.llm"],
    "freetoken_py.models": ["freetoken_py.engine", "freetoken_py.scheduler", "freetoken_py.server", "freetoken_py.llm"],
    "freetoken_py.layers": ["freetoken_py.engine", "freetoken_py.scheduler", "freetoken_py.server", "freetoken_py.llm"],
    "freetoken_py.engine.runner": ["freetoken_py.scheduler", "freetoken_py.server", "freetoken_py.llm"],
    "freetoken_py.scheduler.scheduler": ["freetoken_py.server", "freetoken_py.llm"],
    # hybrids' prefix-state snapshots: the store below the scheduler, the policy below the engine
    "freetoken_py.kvcache.snapshots": ["freetoken_py.engine", "freetoken_py.scheduler", "freetoken_py.server",
                                       "freetoken_py.llm"],
    "freetoken_py.scheduler.prefix_state": ["freetoken_py.engine", "freetoken_py.server", "freetoken_py.llm"],
    "freetoken_py.kernels": ["freetoken_py.engine", "freetoken_py.scheduler", "freetoken_py.server",
                             "freetoken_py.llm", "freetoken_py.models"],
    # format decoders sit between stored and logical tensors: below models, kernels and engine
    "freetoken_py.formats": ["freetoken_py.engine", "freetoken_py.scheduler", "freetoken_py.server", "freetoken_py.llm",
                             "freetoken_py.models", "freetoken_py.kernels", "freetoken_py.residency"],
    "freetoken_py.hw": ["freetoken_py.engine", "freetoken_py.scheduler", "freetoken_py.server", "freetoken_py.llm"],
    # simulate + attach import every residency module; models stay out too (attach.py is
    # duck-typed on the loaded model)
    **{f"freetoken_py.residency.{m}": ["freetoken_py.engine", "freetoken_py.scheduler", "freetoken_py.server",
                                       "freetoken_py.llm", "freetoken_py.models"] for m in ("simulate", "attach", "kv_split")},
    # the load pipeline: below the facade, the scheduler and the server
    "freetoken_py.loading": ["freetoken_py.scheduler", "freetoken_py.server", "freetoken_py.llm"],
    # the evaluations sit on the LLM facade; the KLD one needs nothing of the HTTP layer
    "freetoken_py.evals.kld": ["freetoken_py.server"],
    # the HTTP layer reaches the engine only through LLM, and imports llm itself lazily (in the loader)
    **{f"freetoken_py.server.{m}": ["freetoken_py.kvcache", "freetoken_py.residency", "freetoken_py.engine",
                                    "freetoken_py.scheduler", "freetoken_py.llm"]
       for m in ("app", "serve", "async_engine", "openai_api", "anthropic_api", "chat", "protocol", "sse",
                 "generation", "constraints")},
}

_BLOCKER = """
import importlib, importlib.abc, sys
forbidden = {forbidden!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == f or name.startswith(f + ".") for f in forbidden):
            raise ImportError("layering violation: " + name)
sys.meta_path.insert(0, Block())
importlib.import_module({module!r})
"""


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_imports_go_downward(module):
    code = _BLOCKER.format(forbidden=FORBIDDEN[module], module=module)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1]


def test_cli_import_is_light():
    code = "import sys, freetoken_py.cli; print(','.join(m for m in ('torch', 'numba', 'transformers') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == ""


def test_help_works():
    proc = subprocess.run([sys.executable, "-m", "freetoken_py", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "run" in proc.stdout and "probe" in proc.stdout
