"""The README's fresh-machine commands are the ones CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    lines = ROOT.joinpath("README.md").read_text().splitlines()
    start = lines.index("```bash")
    block = lines[start + 1:lines.index("```", start)]
    return [line for line in block if line and not line.startswith("#")]


def test_two_fresh_machine_commands_and_ci_runs_the_test_one():
    install_run, install_test = _readme_commands()
    assert "freetoken run" in install_run and "pytest" in install_test
    ci = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert install_test in ci
