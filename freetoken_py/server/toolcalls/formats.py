"""The tool-call formats the parser knows, and which one a model uses (from its chat template,
else its config's `model_type`)."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from freetoken_py.server.toolcalls import bodies

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ToolFormat:
    """`open` ... `close` is tool-call markup in the generated text. Without `call_open` the
    region is one call whose body `parse` reads; with it the region is a section holding any
    number of `call_open` body `call_close` calls. `in_reasoning`: calls may be emitted inside a
    <think> block (and are then calls, not reasoning)."""
    name: str
    open: str
    close: str
    parse: Callable[[str, dict], bodies.Parsed | None]
    call_open: str | None = None
    call_close: str | None = None
    in_reasoning: bool = False
    inner: tuple[str, ...] = ()  # tags inside a call body that a vocabulary may hold as single tokens

    @property
    def markup(self) -> tuple[str, ...]:
        return tuple(t for t in (self.open, self.close, self.call_open, self.call_close, *self.inner) if t)


FORMATS = {f.name: f for f in (
    ToolFormat("qwen3_json", "<tool_call>", "</tool_call>", bodies.qwen3_json),
    ToolFormat("qwen3_coder_xml", "<tool_call>", "</tool_call>", bodies.qwen3_coder_xml, in_reasoning=True,
               inner=("</parameter>",)),
    ToolFormat("glm45", "<tool_call>", "</tool_call>", bodies.glm45,
               inner=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    # GLM-4.7 / GLM-5.x: the same calls without the newlines (one parser; the grammar writes them as the template does)
    ToolFormat("glm47", "<tool_call>", "</tool_call>", bodies.glm45,
               inner=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    ToolFormat("deepseek_v31", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", bodies.deepseek,
               "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", inner=(bodies.DEEPSEEK_SEP,)),
    ToolFormat("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", bodies.kimi_k2,
               "<|tool_call_begin|>", "<|tool_call_end|>", inner=(bodies.KIMI_ARGS,)),
    ToolFormat("minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>", bodies.minimax_m2,
               "<invoke", "</invoke>", inner=("</parameter>",)),
    ToolFormat("deepseek_dsml", f"<{bodies.DSML}function_calls>", f"</{bodies.DSML}function_calls>",
               bodies.deepseek_dsml, f"<{bodies.DSML}invoke", f"</{bodies.DSML}invoke>",
               inner=(f"<{bodies.DSML}parameter", bodies.DSML_PARAM_CLOSE)),
)}
SUPPORTED = (*FORMATS, "none")  # (and "harmony", gpt-oss's, with its own parser: toolcalls/harmony.py)

# (format, markers that identify it in a chat template); checked in order, first match wins:
# MiniMax's and GLM's markup contain "<tool_call>", and Qwen3-Coder's too, so plain Qwen3 is last.
_TEMPLATE_MARKERS = (
    ("harmony", ("<|channel|>", "<|call|>")),
    # DeepSeek-V3.2's DSML (`function_calls` / `invoke`); DSML in other dialects is refused
    ("deepseek_dsml", ("｜DSML｜function_calls", "dsml_token }}function_calls")),
    ("unsupported:deepseek_dsml", ("｜DSML｜",)),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>", "<|im_system|>tool_declare")),
    ("glm47", ("{function-name}<arg_key>",)),   # the instructions of GLM-4.7's and GLM-5.x's templates
    ("glm45", ("<arg_key>", "<arg_value>")),
    ("deepseek_v31", ("tool▁calls▁begin", "tool▁call▁begin")),
    ("unsupported:mistral", ("[TOOL_CALLS]",)),
    ("unsupported:llama3", ("<|python_tag|>",)),
    ("qwen3_coder_xml", ("<function=", "<parameter=")),
    ("qwen3_json", ("<tool_call>",)),
)

# config.json model_type -> format, for a template that renders tools in no way we can name
_MODEL_TYPES = {
    "deepseek_v3": "deepseek_v31", "deepseek_v32": "deepseek_dsml", "kimi_k2": "kimi_k2", "kimi_k25": "kimi_k2",
    "glm_moe_dsa": "glm47",
    "glm4_moe": "glm45", "glm4_moe_lite": "glm45", "minimax_m2": "minimax_m2",
    "qwen3_next": "qwen3_coder_xml", "qwen3_5_moe": "qwen3_coder_xml", "qwen3_5_moe_text": "qwen3_coder_xml",
    "qwen3_moe": "qwen3_json", "gpt_oss": "harmony",
}


def detect_tool_format(chat_template: str | None, model_type: str | None = None) -> str:
    """The tool-call format a chat template teaches: a key of FORMATS, "none" (the template has no
    tool support), or "unsupported:<family>" (recognised, not implemented). A template that
    mentions tools in no known way takes its model_type's format, else is "unsupported:unknown"."""
    if not chat_template:
        return "none"
    for family, markers in _TEMPLATE_MARKERS:
        if any(m in chat_template for m in markers):
            return family
    if not re.search(r"\btools\b", chat_template):
        return "none"
    return _MODEL_TYPES.get(model_type or "", "unsupported:unknown")  # refuse rather than guess


def markup_tokens(tool_format: str) -> tuple[str, ...]:
    """The tags the parser reads for a format, <think> and </think> included: what the
    detokenizer must not drop as special tokens (Tokenizer.keep_in_text)."""
    if tool_format == "harmony":
        from freetoken_py.server.toolcalls.harmony import HARMONY
        return HARMONY.tags
    fmt = FORMATS.get(tool_format)
    return (THINK_OPEN, THINK_CLOSE) + (fmt.markup if fmt else ())


def detect_reasoning(chat_template: str | None) -> bool:
    """True when the template knows `<think>` blocks (Qwen3, DeepSeek, GLM, Kimi, MiniMax)."""
    return bool(chat_template) and THINK_OPEN in chat_template
