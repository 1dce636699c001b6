"""docs/options.md, generated from the CLI itself (typer's click commands): one table per command,
every option with its default and help text, then the environment variables (freetoken_py/envs.py).
tests/test_options_doc.py checks the file equals this output, so an option added or changed in
freetoken_py/cli.py without regenerating fails. Everything after NOTES_MARKER in the file is
written by hand (what an option does beyond its help line) and kept as it is by --write.

    python scripts/options_doc.py           # print
    python scripts/options_doc.py --write   # write docs/options.md
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "options.md"
HEADER = ["# Command-line options", "",
          "Generated from `freetoken_py/cli.py` by `python scripts/options_doc.py --write` (checked by",
          "`tests/test_options_doc.py`); `freetoken COMMAND --help` prints the same. `--model` takes a",
          "checkpoint directory or a hub id `ORG/NAME[@REV]` (README, \"A real model by hub id\").", ""]


NOTES_MARKER = "<!-- written by hand below this line; scripts/options_doc.py keeps it -->"


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _commands(cmd, prefix: str):
    """(full name, click command) for every leaf command, in the CLI's order."""
    if hasattr(cmd, "commands"):        # a group (typer vendors its own click)
        for name, sub in cmd.commands.items():
            yield from _commands(sub, f"{prefix} {name}")
    else:
        yield prefix, cmd


def _row(p) -> str:
    names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
    if p.param_type_name == "argument":
        names = f"`{p.name.upper()}` (argument)"
    default = "" if p.default is None or p.param_type_name == "argument" else f"`{_cell(p.default)}`"
    return f"| {names} | {default} | {_cell(getattr(p, 'help', '') or '')} |"


def render() -> str:
    import typer

    from freetoken_py.cli import app

    lines = list(HEADER)
    for name, cmd in _commands(typer.main.get_command(app), "freetoken"):
        lines += [f"## `{name}`", "", _cell((cmd.help or "").strip().split("\n\n")[0]), "",
                  "| option | default | meaning |", "|---|---|---|"]
        lines += [_row(p) for p in cmd.params if p.name != "help"] + [""]
    return "\n".join(lines + _env_table()) + _notes()


def _env_table() -> list[str]:
    from freetoken_py.envs import ENV_VARS

    return ["## Environment variables", "", "Declared in `freetoken_py/envs.py`, read when needed (never at import).", "",
            "| variable | meaning |", "|---|---|", *(f"| `{k}` | {_cell(v)} |" for k, v in ENV_VARS.items()), ""]


def _notes() -> str:
    """The hand-written part of the current file (from NOTES_MARKER on), or "" when it has none."""
    text = OUT.read_text() if OUT.exists() else ""
    return "\n" + text[text.index(NOTES_MARKER):] if NOTES_MARKER in text else ""


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if "--write" in sys.argv[1:]:
        OUT.write_text(render())
    else:
        print(render(), end="")
