"""`freetoken eval tools` (evals/tools.py): the scoring against hand-written outputs (judged by
jsonschema), and the command end to end on the demo model at a small size."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from freetoken_py.cli import DEMO_MODEL
from freetoken_py.evals.tool_schemas import CLAUDE_CODE_TOOLS
from freetoken_py.evals.tools import Score, ToolsEvalOptions, json_valid, requests, run_tools_eval, score_output


def _call(name, args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.mark.parametrize("text, want", [
    ("I will just answer.", (False, False, False, False)),
    (_call("Bash", {"command": "ls"}), (True, True, True, True)),
    ("ok " + _call("Read", {"file_path": "a"}) + "\n" + _call("Bash", {"command": "ls"}), (True, True, True, True)),
    (_call("Shell", {"command": "ls"}), (True, True, False, False)),                  # undeclared
    (_call("Bash", {"cmd": "ls"}), (True, True, True, False)),                        # required field missing
    (_call("Read", {"file_path": "a", "offset": -1}), (True, True, True, False)),     # minimum
    ('<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"\n</tool_call>', (True, False, True, True)),
    (_call("Bash", {"command": "ls"}) + "\n<tool_call>\n{\"name\": \"Ba", (True, False, True, True)),   # one cut
])
def test_score_output(text, want):
    attempted, parseable, declared, valid, calls = score_output(text, CLAUDE_CODE_TOOLS, "qwen3_json", False)
    assert (attempted, parseable) == want[:2]
    if parseable:
        assert (declared, valid) == want[2:] and calls == text.count("</tool_call>")


def test_score_shares_count_only_complete_successes():
    s = Score()
    for outcome in [(True, True, True, True), (True, True, False, False), (True, False, True, True),
                    (False, False, False, False)]:
        s.add(*outcome)
    s.add(True, True, True, True, 2)
    assert s.as_dict() == {"outputs": 5, "attempts": 4, "parseable": 0.75, "declared": 0.5, "valid": 0.5,
                           "call_share": 0.2}


def test_json_answers_judged_by_the_schema():
    assert json_valid('{"answer": "ok", "confidence": 0.5}', False)
    assert json_valid('<think>hm</think>\n{"answer": "ok", "confidence": 1}', True)
    assert not json_valid('{"answer": "ok", "confidence": 2}', False)          # maximum
    assert not json_valid('{"answer": "ok"}', False)                           # required
    assert not json_valid('Sure: {"answer": "ok", "confidence": 0}', False)    # text around it


def test_suite_is_rendered_as_the_server_converts_requests():
    reqs = requests()
    assert len(reqs) == 16 and reqs[0][0][0]["role"] == "system"
    assert {r[1][0]["function"]["name"] for r in reqs} == {"Bash", "bash"}


def test_constrained_calls_always_name_declared_tools_and_validate():
    out = run_tools_eval(ToolsEvalOptions(DEMO_MODEL, samples=2, num_requests=4, max_tokens=96, as_json=True))
    assert out["requests"] == 4 and out["unconstrained"]["outputs"] == 8
    for mode in ("constrained", "required"):
        s = out[mode]
        if s["attempts"]:   # every complete call is declared and valid (cut calls count as unparseable)
            assert s["declared"] == s["parseable"] == s["valid"]
    assert out["required"]["attempts"] == 8   # forced: every output starts a call
    assert out["json_schema"]["outputs"] == 8 and out["json_schema_unconstrained"]["outputs"] == 8


def test_cli_json_line_and_bad_model(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "freetoken_py", "eval", "tools", "--requests", "1", "--samples", "1",
                         "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr
    line, = ok.stdout.strip().splitlines()
    got = json.loads(line)
    assert got["eval"] == "tools" and got["requests"] == 1 and set(got["constrained"]) == set(got["unconstrained"])
    bad = subprocess.run([sys.executable, "-m", "freetoken_py", "eval", "tools", "--model", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
