"""The CI regression gates (bench/gates.py) fail on a planted slowdown and a planted accuracy bug
and pass on main; their thresholds come from bench/gates.json."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gates  # noqa: E402


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(gates.GATES.read_text())


def test_thresholds_file_names_its_date_command_and_every_gate(recorded):
    assert recorded["set"]["command"] == "python bench/gates.py --record" and recorded["set"]["date"] != "unset"
    assert 0 < recorded["decode"]["min_fraction"] < recorded["decode"]["recorded_fraction"]
    assert set(recorded["kld"]["budgets"]) == set(recorded["kld"]["configs"]) == {"int8", "int4", "fp8_kv"}
    assert recorded["kld"]["budgets"]["fp8_kv"] <= 0.005
    tools = recorded["tools"]
    assert tools["set"]["command"].startswith("python bench/gates.py --record") and tools["set"]["date"]
    assert set(tools["floors"]) == set(tools["recorded"]) and set(tools["floors"]) <= set(gates.TOOL_RUNS)
    assert all(0 <= tools["floors"][n] <= tools["recorded"][n] for n in tools["floors"])
    assert tools["floors"]["constrained"] > 0 and tools["floors"]["required"] > 0   # the grammar runs can fail it


def test_record_derives_the_thresholds_from_the_figures(recorded):
    res = {"decode": {"fraction": 0.5}, "kld": {"configs": {"int8": {"mean_kld": 1e-5}, "fp8_kv": {"mean_kld": 0.002}}}}
    new = gates.record(recorded, res, "cmd")
    assert new["decode"]["min_fraction"] == 0.3 and new["kld"]["budgets"] == {"int8": 4e-5, "fp8_kv": 0.005}
    assert new["decode"]["set"]["command"] == new["kld"]["set"]["command"] == "cmd"
    assert recorded["kld"]["budgets"] != new["kld"]["budgets"]
    res = {"tools": {"runs": {"constrained": {"valid": 0.875}, "unconstrained": {"valid": 0.1}}}}
    new = gates.record(recorded, res, "cmd --only tools")
    assert new["tools"]["floors"] == {"constrained": 0.625, "unconstrained": 0.0}
    assert new["tools"]["set"]["command"] == "cmd --only tools" and new["set"] == recorded["set"]   # one gate only
    full = {"decode": {"fraction": 0.5}, "kld": {"configs": {}}, **res}
    assert gates.record(recorded, full, "cmd")["set"]["command"] == "cmd"                       # every gate


def test_tools_gate_passes_on_main_and_fails_on_a_parser_that_drops_arguments(recorded, monkeypatch):
    ok = gates.tools_gate(recorded["tools"])
    assert ok["passed"], ok
    import freetoken_py.server.toolcalls as toolcalls

    real = toolcalls.parse_output

    def drops_arguments(*args, **kwargs):    # the planted bug: every call's arguments lost
        import dataclasses

        out = real(*args, **kwargs)
        out.tool_calls = [dataclasses.replace(call, arguments="{}") for call in out.tool_calls]
        return out

    monkeypatch.setattr(toolcalls, "parse_output", drops_arguments)
    bad = gates.tools_gate(dict(recorded["tools"], requests=4))     # half the suite: the bug shows on any call
    assert not bad["passed"], bad
    grammar_run = bad["runs"]["constrained"]
    # still parsed, no longer valid (only calls of tools without required fields survive "{}")
    assert grammar_run["valid"] < grammar_run["floor"] < grammar_run["parseable"]


def test_kld_gate_passes_on_main_and_fails_on_a_wrong_fp8_scale(recorded):
    ok = gates.kld_gate(recorded["kld"], only=("fp8_kv",))
    assert ok["passed"], ok

    def wrong_scale(name, llm):        # the planted bug: K scales 50x too small, most values clip
        llm.runner.cache.k_scale.mul_(0.02)

    bad = gates.kld_gate(recorded["kld"], only=("fp8_kv",), tamper=wrong_scale)
    assert not bad["passed"] and bad["configs"]["fp8_kv"]["mean_kld"] > recorded["kld"]["budgets"]["fp8_kv"]


def test_decode_gate_fails_on_a_planted_slowdown(recorded):
    """On the demo model (the bench model is CI's): a 0.2 s sleep per decode step, against the
    same gate's fraction without it as the threshold's base (steps here take milliseconds)."""
    cfg = dict(recorded["decode"], decode_tokens=6, rounds=2, min_fraction=None)
    clean = gates.decode_gate(cfg, model_dir=gates.common.DEMO)
    assert clean["passed"] and clean["fraction"] > 0
    slow = gates.decode_gate(dict(cfg, min_fraction=clean["fraction"] / 2), model_dir=gates.common.DEMO,
                             after_step=lambda: time.sleep(0.2))
    assert not slow["passed"], (clean, slow)


def test_ci_runs_the_gates_after_the_readme_tests():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    tests = next(i for i, line in enumerate(ci) if "python -m pytest -q" in line)
    assert "python bench/gates.py" in ci[tests + 1:]


def test_expert_gate_has_a_floor_per_format_and_fails_on_a_planted_slowdown(recorded, monkeypatch):
    """The expert-kernel gate (bench/expert_roofline.py): every format it runs has a floor below its
    recorded share; a small run passes at half its own shares and fails with a 20 ms sleep per
    kernel call planted in the measured loop."""
    cfg = recorded["experts"]
    assert set(cfg["floors"]) == set(cfg["recorded"]) == set(cfg["formats"]) >= {"int8", "int4", "fp8", "nvfp4"}
    assert all(0 < cfg["floors"][f] < cfg["recorded"][f] for f in cfg["formats"])
    import expert_roofline

    small = dict(cfg, formats=["int8", "fp8"], bank_mib=64, rounds=2, sample_s=0.05, floors={})
    clean = gates.experts_gate(small)
    assert clean["passed"] and all(r["share"] > 0 for r in clean["formats"].values())
    floors = {f: r["share"] / 2 for f, r in clean["formats"].items()}
    real = expert_roofline.moe_experts
    monkeypatch.setattr(expert_roofline, "moe_experts", lambda *a, **k: (time.sleep(0.02), real(*a, **k))[1])
    slow = gates.experts_gate(dict(small, floors=floors))
    assert not slow["passed"], (clean, slow)


def test_expert_roofline_heavy_tailed_weights_hold_subnormal_fp8_codes():
    """bench/expert_roofline.py --weights student-t3: heavier tails than the default uniform weights
    (kurtosis), and an fp8 bank quantised from them (the real block rule, quantize_fp8_blocks) holds
    the subnormal e4m3 codes the uniform one lacks: what the option is there to measure."""
    import expert_roofline
    from freetoken_py.quant.fp8 import quantize_fp8_blocks

    def stats(kind):
        w = expert_roofline._weights((512, 1024), torch.Generator().manual_seed(0), kind)
        z = (w - w.mean()) / w.std()
        b = quantize_fp8_blocks(w)[0].view(torch.uint8)
        sub = (((b & 0x78) == 0) & ((b & 0x7F) != 0)).float().mean().item()
        return float((z ** 4).mean()), sub

    (k_u, sub_u), (k_t, sub_t) = stats("uniform"), stats("student-t3")
    assert k_u < 2.0 and k_t > 6.0, (k_u, k_t)            # uniform: 1.8; t(3): heavy (unbounded in theory)
    assert sub_u < 1e-4 < 3e-4 < sub_t, (sub_u, sub_t)
