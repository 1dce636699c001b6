"""Tool definitions of the kinds coding agents send, as OpenAI function tools.

Shapes follow what Claude Code (Bash, Read, Edit, Write, Glob, Grep) and OpenCode (bash, read,
edit, list, webfetch) declare: JSON Schema draft-07 objects with required fields, integer
bounds, enums, booleans and defaults; descriptions shortened. Used by `freetoken eval tools`,
bench/grammar_cost.py and the grammar tests.
"""
from __future__ import annotations

_DRAFT7 = "http://json-schema.org/draft-07/schema#"


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "$schema": _DRAFT7, "type": "object", "properties": properties, "required": required,
        "additionalProperties": False}}}


CLAUDE_CODE_TOOLS = [
    _tool("Bash", "Executes a given bash command and returns its output.", {
        "command": {"type": "string", "description": "The command to execute"},
        "timeout": {"type": "integer", "minimum": 1, "maximum": 600000, "description": "Timeout in ms"},
        "description": {"type": "string", "description": "What this command does, in 5-10 words"},
        "run_in_background": {"type": "boolean"}}, ["command"]),
    _tool("Read", "Reads a file from the local filesystem.", {
        "file_path": {"type": "string", "description": "The absolute path to the file to read"},
        "offset": {"type": "integer", "minimum": 0}, "limit": {"type": "integer", "minimum": 1}}, ["file_path"]),
    _tool("Edit", "Performs exact string replacements in files.", {
        "file_path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
        "replace_all": {"type": "boolean", "default": False}}, ["file_path", "old_string", "new_string"]),
    _tool("Write", "Writes a file to the local filesystem.", {
        "file_path": {"type": "string"}, "content": {"type": "string"}}, ["file_path", "content"]),
    _tool("Glob", "Fast file pattern matching.", {
        "pattern": {"type": "string"}, "path": {"type": "string"}}, ["pattern"]),
    _tool("Grep", "A search tool built on ripgrep.", {
        "pattern": {"type": "string"}, "path": {"type": "string"},
        "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
        "-i": {"type": "boolean"}, "head_limit": {"type": "integer", "minimum": 0}}, ["pattern"]),
]

OPENCODE_TOOLS = [
    _tool("bash", "Executes a bash command.", {
        "command": {"type": "string"}, "timeout": {"type": "number", "exclusiveMinimum": 0},
        "description": {"type": "string"}}, ["command", "description"]),
    _tool("read", "Reads a file.", {
        "filePath": {"type": "string"}, "offset": {"type": "number"}, "limit": {"type": "number"}}, ["filePath"]),
    _tool("edit", "Edits a file by replacing text.", {
        "filePath": {"type": "string"}, "oldString": {"type": "string"}, "newString": {"type": "string"},
        "replaceAll": {"type": "boolean"}}, ["filePath", "oldString", "newString"]),
    _tool("list", "Lists files and directories.", {
        "path": {"type": "string"}, "ignore": {"type": "array", "items": {"type": "string"}}}, []),
    _tool("webfetch", "Fetches content from a URL.", {
        "url": {"type": "string"}, "format": {"type": "string", "enum": ["text", "markdown", "html"]},
        "timeout": {"type": "number"}}, ["url", "format"]),
]


def schemas_by_name(tools: list[dict]) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}
