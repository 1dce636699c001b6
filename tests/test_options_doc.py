"""docs/options.md is the CLI's own option list (scripts/options_doc.py renders it from the typer
commands): an option added, renamed or re-documented in freetoken_py/cli.py without regenerating
the file fails here."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("options_doc", ROOT / "scripts" / "options_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_options_doc_equals_the_cli():
    doc = _script()
    assert doc.OUT.read_text() == doc.render(), "docs/options.md is stale: python scripts/options_doc.py --write"


def test_every_flag_of_run_help_is_documented():
    """Read back against `freetoken run --help` itself (click's own rendering)."""
    out = subprocess.run([sys.executable, "-m", "freetoken_py", "run", "--help"], capture_output=True, text=True,
                         timeout=60, env={"COLUMNS": "200", "PATH": ""}).stdout
    flags = {w.strip(",:;.()") for line in out.splitlines() for w in line.replace("│", " ").split()
             if w.startswith("--") and len(w) > 3}
    section = (ROOT / "docs" / "options.md").read_text().split("## `freetoken run`")[1].split("## ")[0]
    assert flags and all(f"`{f}`" in section for f in flags - {"--help"}), flags
