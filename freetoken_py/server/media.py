"""Image, audio and document inputs are refused with a 400 (no model this runtime serves reads them),
never dropped silently: a client that sent a screenshot must not get an answer about nothing.

The raw request body is walked before the conversion to template messages (server/chat.py), in each
API's own shape: OpenAI chat `image_url` / `input_audio` / `file` parts; Responses `input_image` /
`input_file` / `input_audio` parts of message items and of `function_call_output` outputs;
Anthropic `image` / `document` blocks, also inside `tool_result` content. The error names the
part's path in the request (`messages[1].content[0]`, `messages.1.content.0.content.2`).
"""
from __future__ import annotations

from freetoken_py.server.protocol import bad

OPENAI_PARTS = ("image_url", "input_audio", "file", "image", "audio", "input_image", "input_file")
RESPONSES_PARTS = ("input_image", "input_file", "input_audio", "image_url", "file")
ANTHROPIC_BLOCKS = ("image", "document")
# model_type -> why it reads no images although the released model does
_TEXT_ONLY_BUILDS = {"kimi_k25": "this runtime's build of kimi_k25 loads its text model only (the vision tower "
                                 "is skipped)"}


def _why(model_type: str | None) -> str:
    return _TEXT_ONLY_BUILDS.get(model_type or "", "this model has no vision or audio input")


def _refuse(kind: str, where: str, model_type: str | None, param: str | None):
    noun = "documents" if kind in ("document", "file", "input_file") else \
        "audio" if "audio" in kind else "images"
    raise bad(f"{where}: {noun} ('{kind}' content) are not supported: {_why(model_type)}; send text only", param)


def _parts(content, kinds: tuple[str, ...], where: str, sep: str, model_type, param: str | None) -> None:
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") in kinds:
            here = f"{where}{sep}{j}" if sep == "." else f"{where}[{j}]"
            _refuse(part["type"], here, model_type, param)


def openai_media(body: dict, model_type: str | None = None) -> None:
    """/v1/chat/completions: a 400 for the first image / audio / file part of any message."""
    messages = body.get("messages")
    for i, msg in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(msg, dict):
            _parts(msg.get("content"), OPENAI_PARTS, f"messages[{i}].content", "[]", model_type,
                   "messages")


def responses_media(body: dict, model_type: str | None = None) -> None:
    """/v1/responses: a 400 for the first input_image / input_file / input_audio part of a message
    item or a function_call_output."""
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call_output":
            _parts(item.get("output"), RESPONSES_PARTS, f"input[{i}].output", "[]", model_type, "input")
        else:
            _parts(item.get("content"), RESPONSES_PARTS, f"input[{i}].content", "[]", model_type, "input")


def anthropic_media(body: dict, model_type: str | None = None) -> None:
    """/v1/messages and count_tokens: a 400 for the first image / document block of a message or of
    a tool_result's content."""
    messages = body.get("messages")
    for i, msg in enumerate(messages if isinstance(messages, list) else []):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        where = f"messages.{i}.content"
        _parts(content, ANTHROPIC_BLOCKS, where, ".", model_type, None)
        for j, block in enumerate(content):
            if isinstance(block, dict) and block.get("type") == "tool_result":
                _parts(block.get("content"), ANTHROPIC_BLOCKS, f"{where}.{j}.content", ".", model_type,
                       None)
