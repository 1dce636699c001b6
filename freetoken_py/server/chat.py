"""Request messages (OpenAI or Anthropic) -> the messages and tools a chat template renders.

The target is the OpenAI/transformers convention every HF chat template expects: one leading
`system` message (the system messages before the first other message merged into it), `user` /
`assistant` (with `tool_calls`, arguments as a dict) / `tool` messages with string content, and
tools as `{"type": "function", "function": {name, description, parameters}}`. Unknown fields and
block types are ignored; malformed structure is an ApiError naming the field.

The prefix stays put as a conversation grows (so it stays in the prefix cache): a system message
that arrives after the conversation started stays where it is (`"late": True`; the renderer keeps
it a system message where the template writes one in place, else makes it a user message), and
deferred tools that a `tool_reference` block loads are written into that tool result, not into
the tool list of the system block.
"""
from __future__ import annotations

import json

from freetoken_py.server.protocol import ApiError, ServerLimits, bad

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request block; defeats prefix caching
TEXT_PARTS = ("text", "input_text", "output_text")  # Chat / Anthropic blocks, Responses API parts


def _text_of(content, where: str, keep_tool_results: bool = False) -> str:
    """A content value (string, or list of parts/blocks) flattened to its text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or an array of content blocks", where)
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") in TEXT_PARTS:
            text = block.get("text")
            if not isinstance(text, str):
                raise bad(f"a text block in '{where}' needs a string 'text'", where)
            parts.append(text)
        elif not isinstance(block, dict):
            raise bad(f"'{where}' contains a {type(block).__name__} where a content block was expected", where)
    return "".join(parts)


def _merge_system(system_parts: list[str], messages: list[dict]) -> list[dict]:
    system = "\n\n".join(p for p in system_parts if p)
    return ([{"role": "system", "content": system}] if system else []) + messages


def _system(content: str, system: list[str], out: list[dict]) -> None:
    """A system message: merged into the leading system prompt while nothing else came before it,
    else kept in place (a late addition must not change the tokens already sent)."""
    if not out:
        system.append(content)
    elif content:
        out.append({"role": "system", "content": content, "late": True})


def _check_list(value, name: str, limit: int) -> list:
    if not isinstance(value, list):
        raise bad(f"'{name}' must be an array", name)
    if len(value) > limit:
        raise bad(f"'{name}' has {len(value)} entries; at most {limit} are allowed", name)
    return value


def _arguments(raw, where: str):
    """Tool-call arguments as a dict when they are a JSON object (templates iterate them)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
        return parsed if isinstance(parsed, dict) else raw
    if raw is None:
        return {}
    raise bad(f"'{where}' must be a JSON string or object", where)


# ---- OpenAI ---------------------------------------------------------------------------------
def openai_messages(body: dict, limits: ServerLimits) -> list[dict]:
    if "messages" not in body:
        raise bad("'messages' is required", "messages")
    raw = _check_list(body["messages"], "messages", limits.max_messages)
    if not raw:
        raise bad("'messages' must contain at least one message", "messages")
    system, out = [], []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"'{where}' must be an object", where)
        role = msg.get("role")
        content = _text_of(msg.get("content"), f"{where}.content")
        if role in ("system", "developer"):
            _system(content, system, out)
        elif role == "user":
            out.append({"role": "user", "content": content})
        elif role == "assistant":
            out.append(_openai_assistant(msg, content, where))
        elif role in ("tool", "function"):
            out.append({"role": "tool", "content": content, "tool_call_id": str(msg.get("tool_call_id") or "")})
        else:
            raise bad(f"'{where}.role' must be system, developer, user, assistant or tool (got {role!r})",
                      f"{where}.role")
    return _merge_system(system, out)


def _openai_assistant(msg: dict, content: str, where: str) -> dict:
    out = {"role": "assistant", "content": content}
    calls = msg.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise bad(f"'{where}.tool_calls' must be an array", f"{where}.tool_calls")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad(f"'{where}.tool_calls[{j}].function.name' is required", f"{where}.tool_calls")
            args = _arguments(fn.get("arguments"), f"{where}.tool_calls[{j}].function.arguments")
            out["tool_calls"].append({"id": str(call.get("id") or ""), "type": "function",
                                      "function": {"name": fn["name"], "arguments": args}})
    return out


def openai_tools(body: dict, limits: ServerLimits) -> list[dict] | None:
    """`tools` as given (function tools only); None when absent, empty or tool_choice is "none"."""
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    out = []
    for i, tool in enumerate(_check_list(tools, "tools", limits.max_tools)):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"'tools[{i}].function.name' is required", f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"'tools[{i}].function.parameters' must be an object", f"tools[{i}]")
        out.append({"type": "function", "function": fn})
    return out or None


# ---- OpenAI Responses -------------------------------------------------------------------------
def responses_messages(body: dict, limits: ServerLimits) -> list[dict]:
    """`instructions` + `input` (a string, or items: messages, function_call, function_call_output,
    reasoning) as template messages. Reasoning items are dropped (templates re-derive them); a
    function_call joins the assistant message before it; unknown item types are ignored."""
    raw = body.get("input")
    if raw is None:
        raise bad("'input' is required", "input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    items = _check_list(raw, "input", limits.max_messages)
    system = [_text_of(body.get("instructions"), "instructions")]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            _responses_message(item, where, system, out)
        elif kind == "function_call":
            _responses_call(item, where, out)
        elif kind == "function_call_output":
            output = _text_of(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "content": output, "tool_call_id": str(item.get("call_id") or "")})
        elif kind == "item_reference":
            raise bad(f"'{where}': item references need stored responses; this server keeps none "
                      "(send the items themselves)", where)
    if not out:
        raise bad("'input' must contain at least one user, assistant or tool item", "input")
    return _merge_system(system, out)


def _responses_message(item: dict, where: str, system: list[str], out: list[dict]) -> None:
    role = item.get("role")
    content = _text_of(item.get("content"), f"{where}.content")
    if role in ("system", "developer"):
        _system(content, system, out)
    elif role in ("user", "assistant"):
        out.append({"role": role, "content": content})
    else:
        raise bad(f"'{where}.role' must be developer, system, user or assistant (got {role!r})", f"{where}.role")


def _responses_call(item: dict, where: str, out: list[dict]) -> None:
    if not isinstance(item.get("name"), str) or not item["name"]:
        raise bad(f"'{where}.name' is required", f"{where}.name")
    call = {"id": str(item.get("call_id") or ""), "type": "function",
            "function": {"name": item["name"], "arguments": _arguments(item.get("arguments"), f"{where}.arguments")}}
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    out[-1].setdefault("tool_calls", []).append(call)


def responses_tools(body: dict, limits: ServerLimits) -> list[dict] | None:
    """Flat Responses function tools (`{"type": "function", "name", "parameters", ...}`) as
    template tools, with the function tools inside a `namespace` entry (Codex puts each MCP
    server's tools in one; the client runs them) offered under their own names; tools the server
    would have to run (web_search, local_shell, file_search, custom, ...) are skipped, not
    rejected. None when none are left or tool_choice is "none"."""
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    out = [tool for _, tool in responses_functions(_check_list(tools, "tools", limits.max_tools))]
    return out or None


def responses_functions(tools: list, where: str = "tools") -> list[tuple[str | None, dict]]:
    """(namespace or None, template tool) for every function tool, namespaces opened one level."""
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"'{where}[{i}]' must be an object", f"{where}[{i}]")
        if tool.get("type") == "namespace" and isinstance(tool.get("tools"), list) and where == "tools":
            name = tool.get("name") if isinstance(tool.get("name"), str) else None
            out += [(name, t) for _, t in responses_functions(tool["tools"], f"tools[{i}].tools")]
        elif tool.get("type") == "function":
            out.append((None, _responses_function(tool, f"{where}[{i}]")))
    return out


def _responses_function(tool: dict, where: str) -> dict:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad(f"'{where}.name' is required", f"{where}.name")
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad(f"'{where}.parameters' must be an object", f"{where}.parameters")
    fn = {"name": tool["name"], "description": str(tool.get("description") or ""),
          "parameters": params or {"type": "object", "properties": {}}}
    return {"type": "function", "function": fn}


# ---- Anthropic ------------------------------------------------------------------------------
def anthropic_system(body: dict) -> str:
    """`system` as a string or text blocks; Claude Code's billing-header block is dropped."""
    system = body.get("system")
    if isinstance(system, list):
        system = [b for b in system if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                            and b["text"].lstrip().startswith(BILLING_HEADER))]
    text = _text_of(system, "system")
    return "" if text.lstrip().startswith(BILLING_HEADER) else text


def anthropic_messages(body: dict, limits: ServerLimits) -> list[dict]:
    if "messages" not in body:
        raise bad("messages: field required")
    raw = _check_list(body["messages"], "messages", limits.max_messages)
    if not raw:
        raise bad("messages: at least one message is required")
    system, out = [anthropic_system(body)], []
    definitions = _tool_definitions(body.get("tools"))
    for i, msg in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(msg, dict):
            raise bad(f"{where}: must be an object")
        role, content = msg.get("role"), msg.get("content")
        if role == "system":  # Claude Code sends these mid-conversation
            _system(_text_of(content, f"{where}.content"), system, out)
        elif role == "user":
            out += _anthropic_user(content, where, definitions)
        elif role == "assistant":
            out.append(_anthropic_assistant(content, where))
        else:
            raise bad(f"{where}.role: must be 'user' or 'assistant' (got {role!r})")
    return _merge_system(system, out)


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content: must be a string or an array of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise bad(f"{where}.content.{j}: must be an object")
    return content


def _anthropic_user(content, where: str, definitions: dict[str, dict] | None = None) -> list[dict]:
    """Tool results become `tool` messages (in order); the remaining text one user message.
    A tool result's `tool_reference` blocks (Claude Code's ToolSearch loading deferred tools)
    become the definitions of the tools they load, written at that point."""
    out, texts = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of([block], f"{where}.content.{j}"))
        elif kind == "tool_result":
            result = _text_of(block.get("content"), f"{where}.content.{j}.content")
            result += _loaded_tools_text(block.get("content"), definitions or {}, bool(result))
            if block.get("is_error") is True:
                result = "Error: " + result
            out.append({"role": "tool", "content": result, "tool_call_id": str(block.get("tool_use_id") or "")})
        # images, documents, tool_reference and unknown blocks carry no text for the template
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _anthropic_assistant(content, where: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of([block], f"{where}.content.{j}"))
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str):
                raise bad(f"{where}.content.{j}.name: a tool_use block needs a string name")
            args = _arguments(block.get("input"), f"{where}.content.{j}.input")
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": block["name"], "arguments": args}})
        # thinking / redacted_thinking are dropped from history (templates re-derive them)
    out = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    return out


def anthropic_tools(body: dict, limits: ServerLimits, for_template: bool = False) -> list[dict] | None:
    """Custom tools as OpenAI-style function tools: the ones the model may call. Deferred tools
    (`defer_loading`) join only once a `tool_reference` block has loaded them; server tools
    without a schema are skipped. `for_template`: the tools the template renders in its system
    block, i.e. without the loaded ones (their definitions are in the tool result that loaded
    them, so loading a tool does not change the start of the prompt)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    loaded = _referenced_tools(body.get("messages"))
    out = []
    for i, tool in enumerate(_check_list(tools, "tools", limits.max_tools)):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad(f"tools.{i}.name: field required")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or (tool.get("defer_loading") is True and tool["name"] not in loaded):
            continue
        if for_template and tool["name"] in loaded:
            continue
        fn = {"name": tool["name"], "description": str(tool.get("description") or ""), "parameters": schema}
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_definitions(tools) -> dict[str, dict]:
    """name -> template tool for every custom tool with a schema (deferred ones included)."""
    out = {}
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, dict) and isinstance(tool.get("name"), str) and isinstance(tool.get("input_schema"), dict):
            out[tool["name"]] = {"type": "function", "function": {
                "name": tool["name"], "description": str(tool.get("description") or ""),
                "parameters": tool["input_schema"]}}
    return out


def _loaded_tools_text(content, definitions: dict[str, dict], after_text: bool) -> str:
    """The tools a tool result's `tool_reference` blocks load, as `<tools>` JSON lines (the way
    Hermes/Qwen templates list tools), so the model sees each definition where it was loaded."""
    names = [b["tool_name"] for b in content if isinstance(b, dict) and b.get("type") == "tool_reference"
             and isinstance(b.get("tool_name"), str)] if isinstance(content, list) else []
    if not names:
        return ""
    lines = [json.dumps(definitions.get(n) or {"type": "function", "function": {"name": n}}, ensure_ascii=False)
             for n in names]
    return ("\n" if after_text else "") + "Loaded tools:\n<tools>\n" + "\n".join(lines) + "\n</tools>"


def _referenced_tools(messages) -> set[str]:
    names: set[str] = set()
    for msg in messages if isinstance(messages, list) else []:
        content = msg.get("content") if isinstance(msg, dict) else None
        for block in content if isinstance(content, list) else []:
            if not isinstance(block, dict):
                continue
            inner = block.get("content") if block.get("type") == "tool_result" else [block]
            for b in inner if isinstance(inner, list) else []:
                if isinstance(b, dict) and b.get("type") == "tool_reference" and isinstance(b.get("tool_name"), str):
                    names.add(b["tool_name"])
    return names


# ---- reasoning switches -> template variables ------------------------------------------------
RESERVED_TEMPLATE_VARS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
EFFORT_THINKS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}
# gpt-oss (harmony) always reasons, at one of three efforts: the template's `reasoning_effort`
HARMONY_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


def openai_template_kwargs(body: dict, effort=None, effort_field: str = "reasoning_effort") -> dict:
    """`chat_template_kwargs` (vLLM / SGLang), a top-level `enable_thinking`, and the reasoning
    effort ("none" / "minimal" switch thinking off, "low".."high" on) as the template's variables;
    explicit kwargs win. {} leaves the template's own default. The effort is also passed as
    `reasoning_effort` low / medium / high (gpt-oss's template reads it; none / minimal -> low,
    xhigh -> high)."""
    out = {}
    if effort is not None:
        if not isinstance(effort, str) or effort not in EFFORT_THINKS:  # (a list or dict: a 400 too)
            raise bad(f"'{effort_field}' must be one of {', '.join(EFFORT_THINKS)}", effort_field)
        out["enable_thinking"] = EFFORT_THINKS[effort]
        out["reasoning_effort"] = HARMONY_EFFORT[effort]
    if body.get("enable_thinking") is not None:
        if not isinstance(body["enable_thinking"], bool):
            raise bad("'enable_thinking' must be a boolean", "enable_thinking")
        out["enable_thinking"] = body["enable_thinking"]
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict) or any(k in RESERVED_TEMPLATE_VARS for k in extra):
            raise bad("'chat_template_kwargs' must be an object of template variables (not "
                      f"{', '.join(RESERVED_TEMPLATE_VARS)})", "chat_template_kwargs")
        out.update(extra)
    return out


def anthropic_template_kwargs(body: dict) -> dict:
    """Anthropic `thinking`: disabled -> enable_thinking false, enabled / adaptive -> true.
    budget_tokens is checked here and enforced by the grammar (constraints.anthropic_think_budget).
    gpt-oss's `reasoning_effort`: disabled -> low, a budget under 4096 tokens -> low, under 16384
    -> medium, else high; adaptive -> medium."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("disabled", "enabled", "adaptive"):
        raise bad("thinking.type: must be one of 'disabled', 'enabled', 'adaptive'")
    budget = thinking.get("budget_tokens")
    if budget is not None and (type(budget) is not int or budget < 1):
        raise bad("thinking.budget_tokens: must be a positive integer")
    return {"enable_thinking": kind != "disabled", "reasoning_effort": anthropic_effort(kind, budget)}


def anthropic_effort(kind: str, budget: int | None) -> str:
    """Anthropic thinking -> a harmony reasoning effort (see anthropic_template_kwargs)."""
    if kind == "disabled":
        return "low"
    if kind == "adaptive" or budget is None:
        return "medium"
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"


def template_error(exc: Exception) -> ApiError:
    return bad(f"the chat template could not render this conversation: {exc}", "messages")
