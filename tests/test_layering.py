"""Imports go downward only (docs/architecture.md); `freetoken --help` does not pay for torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "freetoken_py"

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
    # the HTTP layer reaches the engine only through its declared interface (server/engine_api.py),
    # and imports llm itself lazily (in serve.py's loader)
    **{f"freetoken_py.server.{m}": ["freetoken_py.kvcache", "freetoken_py.residency", "freetoken_py.engine",
                                    "freetoken_py.scheduler", "freetoken_py.llm", "freetoken_py.loading"]
       for m in ("app", "serve", "async_engine", "openai_api", "anthropic_api", "chat", "protocol", "sse",
                 "generation", "constraints", "engine_api")},
    # the engine under the facade never reaches up into it or into the HTTP layer
    "freetoken_py.engine.engine": ["freetoken_py.server", "freetoken_py.llm"],
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


# ---- the engine interface the server uses (server/engine_api.py) ----------------------------------
SERVER_MAY_NOT_IMPORT = ("freetoken_py.llm", "freetoken_py.engine", "freetoken_py.loading", "freetoken_py.kvcache",
                         "freetoken_py.residency", "freetoken_py.scheduler")


def _imports(tree: ast.AST):
    """(module, enclosing function name or None) of every import in a module, lazy ones included."""
    def walk(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                yield from ((a.name, func) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                yield child.module, func
            yield from walk(child, inner)
    yield from walk(tree, None)


def test_server_imports_only_the_engine_interface():
    """Every server module, lazy imports included: no engine internals; llm only in serve.py's
    loader (the one place an `EngineAPI` is built)."""
    bad = []
    for path in sorted((PKG / "server").rglob("*.py")):
        for mod, func in _imports(ast.parse(path.read_text())):
            if any(mod == f or mod.startswith(f + ".") for f in SERVER_MAY_NOT_IMPORT):
                if not (path.name == "serve.py" and func == "load" and mod == "freetoken_py.llm"):
                    bad.append(f"{path.relative_to(PKG)}: {mod} (in {func or 'module'})")
    assert not bad, bad


def _api_members() -> set[str]:
    from freetoken_py.server.engine_api import EngineAPI

    return set(EngineAPI.__annotations__) | {n for n in vars(EngineAPI) if not n.startswith("_")}


def test_server_uses_only_the_declared_engine_interface():
    """Each `llm.<name>` / `x.llm.<name>` in server/ names a member of EngineAPI (a new use of the
    engine is declared there first, where the implementation's tests see it)."""
    members, used = _api_members(), {}
    for path in sorted((PKG / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                v = node.value
                if (isinstance(v, ast.Name) and v.id == "llm") or (isinstance(v, ast.Attribute) and v.attr == "llm"):
                    used.setdefault(node.attr, f"{path.relative_to(PKG)}:{node.lineno}")
    assert used, "found no engine use in server/: the scan is broken"
    undeclared = {k: where for k, where in used.items() if k not in members}
    assert not undeclared, f"server uses engine members EngineAPI does not declare: {undeclared}"


def test_llm_implements_the_engine_interface():
    """LLM has every EngineAPI member: methods and properties on the class, attributes set in __init__."""
    from freetoken_py.llm import LLM

    init = next(n for n in ast.walk(ast.parse((PKG / "llm.py").read_text()))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for tgt in n.targets
                for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    missing = [m for m in sorted(_api_members()) if not hasattr(LLM, m) and m not in assigned]
    assert not missing, missing


# ---- function size --------------------------------------------------------------------------------
MAX_FUNCTION_LINES = 60
# numba-compiled functions are kernels wherever they live (residency/_jit.py's planner core): exempt


def _numba_kernel(node) -> bool:
    names = {d.func.id if isinstance(d, ast.Call) and isinstance(d.func, ast.Name) else getattr(d, "id", None)
             for d in node.decorator_list}
    return bool(names & {"njit", "jit"})


def test_no_function_over_60_lines_outside_kernels():
    """Every function in freetoken_py but the numba kernels (kernels/, and @njit ones elsewhere)
    is at most 60 lines, decorators excluded, docstring included."""
    long = set()
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("kernels/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _numba_kernel(node):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long.add((rel, node.name))
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {sorted(long)}"
