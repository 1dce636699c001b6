#!/usr/bin/env python3
"""Train the tiny qwen3_moe demo model bundled in freetoken_py/data/demo_model/.

Everything it learns from exists on every machine: the running Python's standard library and
site-packages (scripts/demo_corpus.py: deduplicated, held-out packages for the evaluation, a
validation split), plus synthetic chat transcripts (with tool calls) rendered by the model's own
chat template.  No download.  See docs/demo_model.md for the recipe and its measurements.

    nice -n 19 python scripts/train_demo_model.py            # the defaults are the recipe
    python scripts/train_demo_model.py --export-only --out DIR   # latest checkpoint -> DIR
    bash scripts/train_demo_gpu.sh                           # a larger model on one GPU in 10 minutes
                                     # (--device cuda --time-schedule --tokenizer <shipped> --max-shard-mib 16)

Stages: corpus -> byte-level BPE tokenizer -> token streams (cached in
~/.cache/freetoken-demo-train/data-*) -> Qwen3MoeForCausalLM (transformers) trained with
checkpoints in ~/.cache/freetoken-demo-train/RUN/ (rerunning the same command resumes) -> bf16
export.  Fixed seeds; the corpus depends on the Python version and the installed packages.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_corpus  # noqa: E402
import demo_train_state as ckpt  # noqa: E402

WORK_DIR = Path.home() / ".cache" / "freetoken-demo-train"
MAX_POSITIONS = 4096

# ---------------------------------------------------------------------------------------
# Special tokens and chat template
# ---------------------------------------------------------------------------------------

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Single tokens, but not "special": they are part of the visible model output.
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                 "<think>", "</think>"]

# Qwen3-style ChatML.  Every tag trims whitespace itself ({%- -%}), so the output is the
# same with or without trim_blocks/lstrip_blocks.  Needs only the `tojson` filter.
CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is not defined or content is none -%}
{%- elif content is string -%}
{{- content -}}
{%- elif content is mapping -%}
{{- content | tojson -}}
{%- elif content is iterable -%}
{%- for part in content -%}
{%- if part is string -%}
{{- part -}}
{%- elif part.type == 'text' -%}
{{- part.text -}}
{%- endif -%}
{%- endfor -%}
{%- else -%}
{{- content -}}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages and messages[0].role == 'system' -%}
{{- render_content(messages[0].content) + '\n\n' -}}
{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}
{{- '\n' + (tool | tojson) -}}
{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- set content = render_content(message.content) -%}
{%- if message.role == 'system' -%}
{%- if not loop.first -%}
{{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
{%- endif -%}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + content -}}
{%- if message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- if not loop.first or content -%}
{{- '\n' -}}
{%- endif -%}
{%- if tool_call.function is defined -%}
{%- set call = tool_call.function -%}
{%- else -%}
{%- set call = tool_call -%}
{%- endif -%}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' -}}
{%- if call.arguments is string -%}
{{- call.arguments -}}
{%- else -%}
{{- call.arguments | tojson -}}
{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
{{- '<|im_start|>user' -}}
{%- endif -%}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()

# The Qwen2 / GPT-4-style split regex (llama.cpp's `qwen2` pre-tokenizer uses the same).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Same as transformers' chat-template `tojson` (no HTML escaping)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def compile_template(source: str = CHAT_TEMPLATE):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment()
    env.filters["tojson"] = tojson
    return env.from_string(source)


# ---------------------------------------------------------------------------------------
# Code corpus: the standard library's own .py files
# ---------------------------------------------------------------------------------------

class CodeFacts:
    """Facts mined from the stdlib ASTs that the synthetic chats talk about."""

    @classmethod
    def of_stdlib(cls, files: list[tuple[str, str]]) -> "CodeFacts":
        """The facts of the corpus's stdlib files (demo_corpus.collect's `stdlib/...` paths)."""
        return cls([(r.removeprefix("stdlib/"), t) for r, t in files if r.startswith("stdlib/")])

    def __init__(self, files: list[tuple[str, str]]):
        self.functions = []   # (module, name, signature, doc first paragraph, source)
        self.modules = []     # (module, doc first paragraph)
        self.files = []       # (relpath, text, top-level classes, top-level functions)
        self.dirs: dict[str, list[str]] = {}
        for rel, text in files:
            self._add_file(rel, text)
        self.dir_names = sorted(d for d, v in self.dirs.items() if len(v) >= 3)

    def _add_file(self, rel: str, text: str) -> None:
        parts = rel.split("/")
        self.dirs.setdefault("/".join(parts[:-1]) or ".", []).append(parts[-1])
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            return
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        funcs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        self.files.append((rel, text, classes, funcs))
        lines = text.splitlines(keepends=True)
        mdoc = first_paragraph(ast.get_docstring(tree))
        if mdoc:
            self.modules.append((module, mdoc))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = first_paragraph(ast.get_docstring(node))
            src = "".join(lines[node.lineno - 1:node.end_lineno]).rstrip()
            if doc and src and len(src.splitlines()) <= 24 and len(src) <= 900:
                sig = "(" + ast.unparse(node.args) + ")"
                self.functions.append((module, node.name, sig, doc, src))


def first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    para = doc.strip().split("\n\n")[0]
    para = " ".join(line.strip() for line in para.splitlines())
    return para if 20 <= len(para) <= 400 else ""


# ---------------------------------------------------------------------------------------
# Synthetic chats (OpenAI message shape), rendered by CHAT_TEMPLATE
# ---------------------------------------------------------------------------------------

def _fn(name, desc, props, required):
    return {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": props, "required": required}}}


def _s(desc):
    return {"type": "string", "description": desc}


TOOLS = {
    "read_file": [_fn(n, "Read a text file and return its contents.",
                      {"path": _s("Path of the file to read.")}, ["path"])
                  for n in ("read_file", "Read", "open_file")],
    "write_file": [_fn(n, "Write text to a file, creating or overwriting it.",
                       {"path": _s("Path of the file to write."),
                        "content": _s("The full text to write.")}, ["path", "content"])
                   for n in ("write_file", "Write")],
    "list_dir": [_fn(n, "List the entries of a directory.",
                     {"path": _s("Directory to list.")}, ["path"])
                 for n in ("list_dir", "ls")],
    "run_shell": [_fn(n, "Run a shell command and return its output.",
                      {"command": _s("The command line to run.")}, ["command"])
                  for n in ("run_shell", "bash", "Bash", "execute_command")],
    "search": [_fn(n, "Search the web and return the top results.",
                   {"query": _s("The search query.")}, ["query"])
               for n in ("search", "web_search")],
    "grep": [_fn(n, "Search files for a regular expression.",
                 {"pattern": _s("The regular expression."),
                  "path": _s("File or directory to search in.")}, ["pattern", "path"])
             for n in ("grep", "Grep")],
    "get_weather": [_fn("get_weather", "Get the current weather for a city.",
                        {"city": _s("Name of the city."),
                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                        ["city"])],
    "calculate": [_fn(n, "Evaluate an arithmetic expression.",
                      {"expression": _s("The expression, e.g. 2 * (3 + 4).")}, ["expression"])
                  for n in ("calculate", "calculator")],
}

SYSTEM_PROMPTS = [None, None, "You are a helpful assistant.",
                  "You are a helpful coding assistant.", "You are freetoken, a small local model.",
                  "You are a concise assistant. Answer briefly.",
                  "You are an expert Python programmer."]
CITIES = ["Paris", "London", "Berlin", "Tokyo", "New York", "Madrid", "Rome", "Sydney", "Lisbon",
          "Oslo", "Cairo", "Toronto", "Seoul", "Mumbai", "Nairobi", "Lima", "Zurich", "Vienna"]
CONDITIONS = ["sunny", "cloudy", "partly cloudy", "rainy", "foggy", "windy", "snowing", "clear"]
PROJECT_DIRS = ["src", "lib", "app", "pkg", "tools", "scripts", "utils", "core"]


class ChatMaker:
    """Builds one random conversation at a time; each returns (messages, tools or None)."""

    def __init__(self, facts: CodeFacts, rng: random.Random):
        self.f, self.rng = facts, rng
        self.kinds = [(self.read_file, 14), (self.write_file, 8), (self.list_dir, 8),
                      (self.shell, 12), (self.search, 7), (self.grep, 7), (self.weather, 10),
                      (self.calc, 6), (self.two_step, 6), (self.parallel_weather, 4),
                      (self.tools_but_text, 8), (self.python_qa, 30)]

    def make(self):
        fns, weights = zip(*self.kinds)
        messages, tools = self.rng.choices(fns, weights)[0]()
        system = self.rng.choice(SYSTEM_PROMPTS)
        if system:
            messages = [{"role": "system", "content": system}] + messages
        if self.rng.random() < 0.15:
            messages += self.thanks()
        return messages, tools

    # -- helpers ----------------------------------------------------------------------
    def pick(self, seq):
        return self.rng.choice(seq)

    def toolset(self, *needed):
        """The needed tools (one random name variant each) plus 0-2 distractors, shuffled."""
        others = [k for k in TOOLS if k not in needed]
        keys = list(needed) + self.rng.sample(others, self.rng.choice([0, 1, 1, 2]))
        chosen = {k: self.pick(TOOLS[k]) for k in keys}
        tools = list(chosen.values())
        self.rng.shuffle(tools)
        return tools, {k: t["function"]["name"] for k, t in chosen.items()}

    def call(self, name, args, text=""):
        as_string = self.rng.random() < 0.3  # clients send arguments as a JSON string too
        fn = {"name": name, "arguments": json.dumps(args) if as_string else args}
        msg = {"role": "assistant", "content": text or None,
               "tool_calls": [{"id": f"call_{self.rng.randrange(16**8):08x}",
                               "type": "function", "function": fn}]}
        return msg

    def preface(self):
        return self.pick(["", "", "", "", "Let me check.", "I'll look that up.", "Sure."])

    def project_path(self, rel):
        name = rel.split("/")[-1]
        return self.pick([name, f"{self.pick(PROJECT_DIRS)}/{name}", f"./{name}",
                          f"/home/user/project/{self.pick(PROJECT_DIRS)}/{name}", rel])

    def random_file(self):
        return self.pick(self.f.files)

    def thanks(self):
        return [{"role": "user", "content": self.pick(["Thanks!", "Thank you.", "Great, thanks.",
                                                       "Perfect.", "ok thanks"])},
                {"role": "assistant", "content": self.pick([
                    "You're welcome!", "Glad I could help.",
                    "You're welcome. Let me know if you need anything else.", "Any time!"])}]

    @staticmethod
    def names(items, limit=6):
        items = [f"`{x}`" for x in items[:limit]]
        if len(items) <= 1:
            return "".join(items)
        return ", ".join(items[:-1]) + " and " + items[-1]

    def describe_file(self, path, text, classes, funcs):
        n = len(text.splitlines())
        bits = []
        if classes:
            bits.append(f"the class{'es' if len(classes) > 1 else ''} {self.names(classes)}")
        if funcs:
            bits.append(f"the function{'s' if len(funcs) > 1 else ''} {self.names(funcs)}")
        what = " and ".join(bits) if bits else "no top-level classes or functions"
        return f"`{path}` is a Python module of {n} lines. It defines {what}."

    # -- scenarios --------------------------------------------------------------------
    def read_file(self):
        rel, text, classes, funcs = self.random_file()
        path = self.project_path(rel)
        ask = self.pick(["Show me the contents of {p}.", "What's in {p}?", "Can you read {p}?",
                         "Open {p} and tell me what it does.", "Please look at {p}.",
                         "What does the file {p} define?", "Read {p} for me."]).format(p=path)
        tools, names = self.toolset("read_file")
        head = "\n".join(text.splitlines()[:self.rng.randint(6, 14)])
        return [{"role": "user", "content": ask},
                self.call(names["read_file"], {"path": path}, self.preface()),
                {"role": "tool", "content": head},
                {"role": "assistant", "content": self.describe_file(path, text, classes, funcs)}
                ], tools

    def write_file(self):
        module, name, sig, doc, src = self.pick(self.f.functions)
        path = self.pick([f"{name}.py", f"{self.pick(PROJECT_DIRS)}/{name}.py", "helpers.py",
                          "utils.py", f"{module.split('.')[-1]}_extra.py"])
        ask = self.pick(["Create {p} with a function `{n}` that does this: {d}",
                         "Write a function `{n}` into {p}. {d}",
                         "Please add a file {p} containing `{n}{s}`. Docstring: {d}"]
                        ).format(p=path, n=name, d=doc, s=sig)
        tools, names = self.toolset("write_file")
        content = src + "\n"
        return [{"role": "user", "content": ask},
                self.call(names["write_file"], {"path": path, "content": content}),
                {"role": "tool", "content": f"Wrote {len(content.encode())} bytes to {path}"},
                {"role": "assistant", "content": f"I created `{path}` with the function "
                                                 f"`{name}{sig}`."}], tools

    def list_dir(self):
        d = self.pick(self.f.dir_names)
        entries = sorted(self.f.dirs[d])
        path = self.pick([d, f"./{d}", f"{self.pick(PROJECT_DIRS)}/{d.split('/')[-1]}"])
        if d == ".":
            path = self.pick([".", "the current directory"])
        ask = self.pick(["List the files in {p}.", "What files are in {p}?",
                         "Show me what's inside {p}.", "ls {p}"]).format(p=path)
        tools, names = self.toolset("list_dir")
        arg = "." if path == "the current directory" else path
        shown = entries[:30]
        return [{"role": "user", "content": ask},
                self.call(names["list_dir"], {"path": arg}, self.preface()),
                {"role": "tool", "content": "\n".join(shown)},
                {"role": "assistant", "content": f"`{arg}` contains {len(shown)} entries, "
                                                 f"including {self.names(shown, 5)}."}], tools

    def shell_case(self):
        rel, text, _, _ = self.random_file()
        path = self.project_path(rel)
        n_lines = len(text.splitlines())
        passed, secs = self.rng.randint(3, 180), self.rng.randint(5, 900) / 100
        ver = f"3.{self.rng.randint(9, 13)}.{self.rng.randint(0, 9)}"
        cases = [
            ("Which Python version is installed?", "python --version", f"Python {ver}",
             f"Python {ver} is installed."),
            ("Run the tests.", "pytest -q", f"{passed} passed in {secs:.2f}s",
             f"All {passed} tests passed in {secs:.2f} seconds."),
            (f"How many lines does {path} have?", f"wc -l {path}", f"{n_lines} {path}",
             f"`{path}` has {n_lines} lines."),
            ("What is the current directory?", "pwd", "/home/user/project",
             "The current directory is `/home/user/project`."),
            (f"Run `python {path}`.", f"python {path}", "", "The script ran without output."),
            ("Is git clean?", "git status --short", f" M {path}",
             f"Not quite: `{path}` has uncommitted changes."),
            (f"Delete the cache files in {self.pick(PROJECT_DIRS)}.",
             "find . -name '__pycache__' -prune -exec rm -rf {} +", "",
             "Done: the `__pycache__` directories are removed."),
        ]
        return self.pick(cases)

    def shell(self):
        ask, cmd, out, answer = self.shell_case()
        if self.rng.random() < 0.2:
            ask = f"Run `{cmd}`."
        tools, names = self.toolset("run_shell")
        return [{"role": "user", "content": ask},
                self.call(names["run_shell"], {"command": cmd}, self.preface()),
                {"role": "tool", "content": out or "(no output)"},
                {"role": "assistant", "content": answer}], tools

    def search(self):
        module, mdoc = self.pick(self.f.modules)
        q = self.pick(["python {m} module", "what is python {m}", "{m} python docs",
                       "how to use {m} in python"]).format(m=module)
        ask = self.pick(["Search the web for {q}.", "Look up \"{q}\".",
                         "Can you find out what the Python module {m} is for?"]
                        ).format(q=q, m=module)
        tools, names = self.toolset("search")
        results = [{"title": f"{module} — Python documentation",
                    "url": f"https://docs.python.org/3/library/{module}.html", "snippet": mdoc}]
        return [{"role": "user", "content": ask},
                self.call(names["search"], {"query": q}, self.preface()),
                {"role": "tool", "content": json.dumps(results, ensure_ascii=False)},
                {"role": "assistant", "content": f"According to the Python documentation, "
                                                 f"`{module}`: {mdoc}"}], tools

    def grep(self):
        module, name, sig, doc, src = self.pick(self.f.functions)
        rel = module.replace(".", "/") + ".py"
        d = self.pick(PROJECT_DIRS + ["."])
        ask = self.pick(["Where is `{n}` defined?", "Find the definition of {n} in {d}.",
                         "Search {d} for the function {n}."]).format(n=name, d=d)
        lineno = self.rng.randint(10, 900)
        hit = f"{d}/{rel}:{lineno}:def {name}{sig}:"
        tools, names = self.toolset("grep")
        return [{"role": "user", "content": ask},
                self.call(names["grep"], {"pattern": f"def {name}\\b", "path": d}),
                {"role": "tool", "content": hit},
                {"role": "assistant", "content": f"`{name}` is defined in `{d}/{rel}` at line "
                                                 f"{lineno}: `def {name}{sig}`."}], tools

    def weather_result(self, city, unit):
        t = self.rng.randint(-10, 35)
        t = t if unit == "celsius" else round(t * 9 / 5 + 32)
        return {"city": city, "temperature": t, "unit": unit,
                "condition": self.pick(CONDITIONS)}

    def weather_sentence(self, r):
        sym = "°C" if r["unit"] == "celsius" else "°F"
        return f"{r['temperature']}{sym} and {r['condition']} in {r['city']}"

    def weather(self):
        city = self.pick(CITIES)
        unit = "fahrenheit" if self.rng.random() < 0.25 else "celsius"
        ask = self.pick(["What's the weather in {c}?", "Is it cold in {c} right now?",
                         "weather {c}", "How warm is it in {c} today?"]).format(c=city)
        args = {"city": city}
        if unit == "fahrenheit":
            ask += " In Fahrenheit please."
            args["unit"] = unit
        tools, names = self.toolset("get_weather")
        r = self.weather_result(city, unit)
        return [{"role": "user", "content": ask},
                self.call(names["get_weather"], args, self.preface()),
                {"role": "tool", "content": json.dumps(r, ensure_ascii=False)},
                {"role": "assistant", "content": f"It is currently {self.weather_sentence(r)}."}
                ], tools

    def parallel_weather(self):
        a, b = self.rng.sample(CITIES, 2)
        tools, names = self.toolset("get_weather")
        ra, rb = self.weather_result(a, "celsius"), self.weather_result(b, "celsius")
        msg = self.call(names["get_weather"], {"city": a})
        msg["tool_calls"] += self.call(names["get_weather"], {"city": b})["tool_calls"]
        return [{"role": "user", "content": f"Compare the weather in {a} and {b}."}, msg,
                {"role": "tool", "content": json.dumps(ra, ensure_ascii=False)},
                {"role": "tool", "content": json.dumps(rb, ensure_ascii=False)},
                {"role": "assistant", "content": f"It is {self.weather_sentence(ra)}, and "
                                                 f"{self.weather_sentence(rb)}."}], tools

    def calc(self):
        a, b = self.rng.randint(2, 999), self.rng.randint(2, 99)
        op = self.pick(["+", "-", "*"])
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        expr = f"{a} {op} {b}"
        ask = self.pick(["What is {e}?", "Calculate {e}.", "Compute {e} for me."]).format(e=expr)
        tools, names = self.toolset("calculate")
        return [{"role": "user", "content": ask},
                self.call(names["calculate"], {"expression": expr}),
                {"role": "tool", "content": str(value)},
                {"role": "assistant", "content": f"{expr} = {value}."}], tools

    def two_step(self):
        """List a directory, then read one of its files."""
        rel, text, classes, funcs = self.random_file()
        d = "/".join(rel.split("/")[:-1]) or "."
        tools, names = self.toolset("list_dir", "read_file")
        path = rel
        head = "\n".join(text.splitlines()[:12])
        return [{"role": "user", "content": f"Look in {d} and tell me what "
                                            f"{rel.split('/')[-1]} defines."},
                self.call(names["list_dir"], {"path": d}),
                {"role": "tool", "content": "\n".join(sorted(self.f.dirs[d])[:20])},
                self.call(names["read_file"], {"path": path}),
                {"role": "tool", "content": head},
                {"role": "assistant", "content": self.describe_file(path, text, classes, funcs)}
                ], tools

    def tools_but_text(self):
        messages, _ = self.python_qa()
        tools, _ = self.toolset(self.pick(list(TOOLS)))
        return messages, tools

    def python_qa(self):
        r = self.rng.random()
        if r < 0.08:
            greet = self.pick(["Hi!", "Hello", "hey", "Good morning!", "Who are you?"])
            return [{"role": "user", "content": greet},
                    {"role": "assistant", "content": self.pick([
                        "Hello! How can I help you today?",
                        "Hi! I am a small demo model. Ask me about Python.",
                        "Hello! What would you like to do?"])}], None
        if r < 0.25:
            module, mdoc = self.pick(self.f.modules)
            return [{"role": "user", "content": self.pick([
                        "What is the `{m}` module for?", "What does the Python module {m} do?",
                        "Explain {m} briefly."]).format(m=module)},
                    {"role": "assistant", "content": f"`{module}`: {mdoc}"}], None
        module, name, sig, doc, src = self.pick(self.f.functions)
        if r < 0.6:
            return [{"role": "user", "content": self.pick([
                        "What does `{m}.{n}` do?", "Explain the function {n} from {m}.",
                        "What is {m}.{n} used for?"]).format(m=module, n=name)},
                    {"role": "assistant", "content": f"`{module}.{name}{sig}`: {doc}"}], None
        return [{"role": "user", "content": self.pick([
                    "Write a Python function `{n}`: {d}", "Implement {n}{s} in Python. {d}",
                    "Show me how {m}.{n} is implemented."]).format(m=module, n=name, s=sig, d=doc)},
                {"role": "assistant", "content": f"Here is `{name}`:\n\n```python\n{src}\n```"}
                ], None


def make_chats(facts: CodeFacts, num_chats: int, seed: int) -> list[str]:
    """Render `num_chats` random conversations with CHAT_TEMPLATE."""
    rng = random.Random(seed)
    template = compile_template()
    maker = ChatMaker(facts, rng)
    out = []
    for _ in range(num_chats):
        messages, tools = maker.make()
        out.append(template.render(messages=messages, tools=tools, add_generation_prompt=False))
    return out


# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers,
                            processors, trainers)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKER_TOKENS), min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def strip_markers(batch_size=256):
        # Markers become single added tokens; don't spend merges on their spelling.
        for i in range(0, len(texts), batch_size):
            chunk = []
            for t in texts[i:i + batch_size]:
                for m in SPECIAL_TOKENS + MARKER_TOKENS:
                    t = t.replace(m, " ")
                chunk.append(t)
            yield chunk

    tok.train_from_iterator(strip_markers(), trainer=trainer, length=len(texts))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def tokenizer_config(tok, max_len: int) -> dict:
    added = {}
    for t in SPECIAL_TOKENS + MARKER_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": t in SPECIAL_TOKENS}
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": max_len,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None}


# ---------------------------------------------------------------------------------------
# Training data: cached token streams in the run's work dir
# ---------------------------------------------------------------------------------------

VAL_MOD = 50  # a training-corpus file is validation (never trained on) when sha1(path) % 50 == 0


def is_val(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % VAL_MOD == 0


def data_dir(args) -> Path:
    """Where the run's corpus, tokenizer and token streams are cached (shared by runs). A given
    --tokenizer (its bytes) and --stdlib / --site roots are part of the name."""
    tag = "" if args.code_comments == "keep" else f"-{args.code_comments}"
    tokenizer, roots = getattr(args, "tokenizer", ""), [getattr(args, k, "") for k in ("stdlib", "site")]
    if tokenizer:
        tag += "-tok" + hashlib.sha1(Path(tokenizer).read_bytes()).hexdigest()[:10]
    if any(roots):
        tag += "-roots" + hashlib.sha1("\0".join(str(Path(r).resolve()) if r else "" for r in roots)
                                      .encode()).hexdigest()[:10]
    return args.work_dir / f"data-v{args.vocab}-s{args.seed}-c{args.num_chats}{tag}"


def given_tokenizer(path: str, vocab: int):
    """A tokenizer.json of the same kind (--tokenizer, e.g. the shipped model's): the vocabulary
    size and every special and marker token must be what this script would make."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(path)
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"--tokenizer {path}: {tok.get_vocab_size()} tokens, --vocab says {vocab}")
    missing = [t for t in SPECIAL_TOKENS + MARKER_TOKENS if tok.token_to_id(t) is None
               or tok.encode(t).ids != [tok.token_to_id(t)]]
    if missing:
        raise SystemExit(f"--tokenizer {path}: no single token for {missing}")
    return tok


def prepare_data(args, work: Path) -> dict:
    """Corpus -> tokenizer -> token streams, cached in `work` (a resume reuses them)."""
    import numpy as np
    from tokenizers import Tokenizer
    meta_path = work / "data.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        tok = Tokenizer.from_file(str(work / "tokenizer.json"))
        arrays = {k: np.load(work / f"{k}.npy", allow_pickle=False).astype(np.int64)
                  for k in ("code", "val", "chats", "chat_offsets")}
        return {"tok": tok, "meta": meta, **arrays}
    t0 = time.time()
    roots = [Path(r) if r else None for r in (getattr(args, "stdlib", ""), getattr(args, "site", ""))]
    files, heldout = demo_corpus.collect(*roots)
    if args.code_comments == "drop":  # training and validation code only; held-out files keep theirs
        files = [(r, demo_corpus.drop_comment_lines(t)) for r, t in files]
    train_files = [(r, t) for r, t in files if not is_val(r)]
    val_files = [(r, t) for r, t in files if is_val(r)]
    facts = CodeFacts.of_stdlib(files)
    chats = make_chats(facts, args.num_chats, args.seed)
    code_bytes = sum(len(t.encode()) for _, t in train_files)
    print(f"python {sys.version.split()[0]}: {len(train_files)} training files "
          f"({code_bytes / 1e6:.1f} MB), {len(val_files)} validation, {len(heldout)} held out; "
          f"{len(chats)} chats ({time.time() - t0:.0f}s)", flush=True)
    # The tokenizer is fitted on every stdlib file, a fixed sample of the site-packages files
    # (about as many bytes again) and chats adding a quarter of those bytes.
    if getattr(args, "tokenizer", ""):
        tok = given_tokenizer(args.tokenizer, args.vocab)
    else:
        rng = random.Random(args.seed)
        stdlib = [t for r, t in train_files if r.startswith("stdlib/")]
        site = [t for r, t in train_files if r.startswith("site/")]
        rng.shuffle(site)
        fit = stdlib + site[:len(stdlib)]
        fit_bytes = sum(len(t.encode()) for t in fit)
        chat_bytes = sum(len(c.encode()) for c in chats)
        fit += chats[:max(1, int(len(chats) * min(1.0, 0.25 * fit_bytes / chat_bytes)))]
        tok = train_tokenizer(fit, args.vocab)
    eot = tok.token_to_id("<|endoftext|>")

    def stream(texts):
        out = []
        for enc in tok.encode_batch(texts):
            out += enc.ids + [eot]
        return np.asarray(out, dtype=np.uint16)

    code, val = stream([t for _, t in train_files]), stream([t for _, t in val_files])
    chat_lists = [enc.ids + [eot] for enc in tok.encode_batch(chats)]
    chat_arr = np.asarray([i for c in chat_lists for i in c], dtype=np.uint16)
    offsets = np.cumsum([0] + [len(c) for c in chat_lists]).astype(np.int64)
    meta = {"python": sys.version.split()[0], "train_files": len(train_files),
            "val_files": len(val_files), "heldout_files": len(heldout), "code_bytes": code_bytes,
            "code_tokens": int(code.size), "val_tokens": int(val.size),
            "chat_tokens": int(chat_arr.size), "chats": len(chats),
            "bytes_per_token": code_bytes / code.size, "seconds": round(time.time() - t0)}
    work.mkdir(parents=True, exist_ok=True)
    tok.save(str(work / "tokenizer.json"))
    for k, a in (("code", code), ("val", val), ("chats", chat_arr), ("chat_offsets", offsets)):
        np.save(work / f"{k}.npy", a, allow_pickle=False)
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")  # last: marks the cache complete
    print(f"data: {json.dumps(meta)}", flush=True)
    return prepare_data(args, work)


class Batches:
    """Rows of `seq_len` tokens: random windows of the code stream, or runs of whole chats
    (a chat row always starts at a chat boundary, so tool prompts are seen from the top)."""

    def __init__(self, data, seq_len, batch_size, chat_frac, seed):
        import torch
        self.code = torch.from_numpy(data["code"])
        self.chats, self.offsets = torch.from_numpy(data["chats"]), data["chat_offsets"]
        self.seq_len, self.batch_size, self.chat_frac = seq_len, batch_size, chat_frac
        self.gen = torch.Generator().manual_seed(seed)

    def _chat_row(self, seq_len):
        import torch
        n = len(self.offsets) - 1
        i = int(torch.randint(n, (1,), generator=self.gen))
        start = int(self.offsets[i])
        row = self.chats[start:start + seq_len]
        if len(row) < seq_len:  # wrap around to the first chats
            row = torch.cat([row, self.chats[:seq_len - len(row)]])
        return row

    def next(self, seq_len=None, rows=None):
        import torch
        seq_len, out = seq_len or self.seq_len, []
        for _ in range(rows or self.batch_size):
            if float(torch.rand((), generator=self.gen)) < self.chat_frac:
                out.append(self._chat_row(seq_len))
            else:
                s = int(torch.randint(len(self.code) - seq_len, (1,), generator=self.gen))
                out.append(self.code[s:s + seq_len])
        return torch.stack(out)  # [rows, seq_len]


# ---------------------------------------------------------------------------------------
# Model, training, saving
# ---------------------------------------------------------------------------------------

def build_model(args, vocab_size, ids):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=64, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=False, output_router_logits=True,
        router_aux_loss_coef=args.aux_coef, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    return Qwen3MoeForCausalLM(cfg)


def lr_at(step, args):
    """Linear warmup, then a cosine from the peak down to min_lr_frac of it at `steps`."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    f = args.min_lr_frac
    return args.lr * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * t)))


def shape_at(step, args) -> tuple[int, int]:
    """(row length, rows) of a step: short rows first (--short-seq-len, until --long-from of the
    steps), then --seq-len rows; the same tokens per step throughout."""
    if args.short_seq_len and step < args.long_from * args.steps:
        return args.short_seq_len, args.batch_size * args.seq_len // args.short_seq_len
    return args.seq_len, args.batch_size


def make_optimizer(model, args):
    import torch
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def val_loss(model, val, seq_len, windows) -> float:
    """Mean LM cross-entropy on `windows` evenly spaced windows of the validation stream."""
    import torch
    model.eval()
    seq_len = min(seq_len, len(val) - 1)  # (a small corpus: its validation stream may be shorter)
    starts = [int(i * (len(val) - seq_len - 1) / max(1, windows - 1)) for i in range(windows)]
    total, device = 0.0, next(model.parameters()).device
    with torch.no_grad(), autocast(device):
        for s in starts:
            x = torch.from_numpy(val[s:s + seq_len + 1]).unsqueeze(0).to(device)  # [1, seq_len + 1]
            logits = model(input_ids=x[:, :-1]).logits[0].float()                 # [seq_len, vocab]
            total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:]))
    model.train()
    return total / windows


def autocast(device):
    """bf16 autocast on a GPU (fp32 master weights and optimizer); nothing on the CPU, whose
    runs stay fp32 bit for bit."""
    import contextlib

    import torch
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def schedule_step(step: int, trained_s: float, args) -> float:
    """The step the LR and row-length schedules are read at: the step itself, or with
    --time-schedule the share of --max-minutes trained so far times --steps (so warmup, the
    cosine and the switch to long rows happen at the same shares of the time, whatever a step
    costs on this machine)."""
    if not args.time_schedule:
        return step
    return min(1.0, trained_s / (60 * args.max_minutes)) * args.steps


def log_metric(work: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    work.mkdir(parents=True, exist_ok=True)     # a new run logs its first validation before its first checkpoint
    with open(work / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def false_copies(x, n: int):
    """For each position t of each row (the logit that predicts x[t+1]): the token that followed the
    latest earlier occurrence of the n-gram x[t-n+1..t] in the row, where that token is *not*
    x[t+1]; -1 where the n-gram did not occur before or copying it would be right.  These are the
    predictions an induction ("copy what came next last time") guess gets wrong: the step a
    greedy loop is made of.  Returns int64 [rows, L-1]."""
    import numpy as np
    xs = x.numpy()
    out = np.full((xs.shape[0], xs.shape[1] - 1), -1, dtype=np.int64)
    for r, row in enumerate(xs.tolist()):
        last: dict = {}
        for t in range(n - 1, len(row) - 1):
            key = tuple(row[t - n + 1:t + 1])
            j = last.get(key)
            if j is not None and row[j + 1] != row[t + 1]:
                out[r, t] = row[j + 1]
            last[key] = t
    return out


def false_copy_loss(logits, x, n: int):
    """Token-level unlikelihood (Welleck et al. 2019, "Neural text generation with unlikelihood
    training") restricted to false copies: -log(1 - p(c)) for each false-copy candidate c of
    `false_copies`, summed and divided by the number of predicted tokens.  Returns (loss, share
    of positions that had a candidate)."""
    import torch
    cand = torch.from_numpy(false_copies(x, n))
    rows, cols = (cand >= 0).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return logits.sum() * 0.0, 0.0
    lp = torch.log_softmax(logits[rows, cols].float(), dim=-1)    # [M, vocab]
    p = lp.gather(-1, cand[rows, cols].unsqueeze(-1)).squeeze(-1).exp()
    return unlikelihood(p).sum() / cand.numel(), rows.numel() / cand.numel()


def unlikelihood(p):
    """-log(1 - p), elementwise: the cost of giving probability p to a token that should not come."""
    import torch
    return -torch.log1p(-p.clamp(max=1 - 1e-6))


def ul_prompts(args, data) -> list[list[int]]:
    """Token ids of prompts from the training files (never a validation or held-out one): the
    header and docstring of each file's first documented def/class, made as the held-out
    evaluation makes its prompts (demo_corpus.first_documented_def), 8-256 tokens; with
    `--seq-prompts mixed` also each file's first one-line top-level import (2+ tokens; `typed`:
    every other one without its newline, as `freetoken run "import os"` gets it). Cached in the
    data dir."""
    mixed = args.seq_prompts in ("mixed", "typed")
    path = data_dir(args) / {"docstring": "ul_prompts.json", "mixed": "ul_prompts_mixed.json",
                             "typed": "ul_prompts_typed.json"}[args.seq_prompts]
    if path.exists():
        return json.loads(path.read_text())
    files, _ = demo_corpus.collect()
    texts = []
    for rel, text in files:
        if is_val(rel):
            continue
        if args.code_comments == "drop":
            text = demo_corpus.drop_comment_lines(text)
        try:
            prompt = demo_corpus.first_documented_def(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        if prompt:
            texts.append(prompt)
        if mixed:   # the file's first one-line top-level import: how a module starts (the README's "import os")
            line = import_prompt(text, typed=args.seq_prompts == "typed" and len(texts) % 2 == 0)
            if line:
                texts.append(line)
    ids = [e.ids for e in data["tok"].encode_batch(texts) if (2 if mixed else 8) <= len(e.ids) <= 256]
    path.write_text(json.dumps(ids))
    return ids


def import_prompt(text: str, typed: bool = False) -> str | None:
    """A file's first one-line top-level import (`import x` / `from x import y`, no brackets or
    continuation) with its newline, or as a user types it on a command line (`typed`: no newline,
    like the README's `freetoken run "import os"`); None where the file has none."""
    line = next((l for l in text.splitlines() if l.startswith(("import ", "from "))), None)
    if not line or "(" in line or line.rstrip().endswith("\\"):
        return None
    return line.rstrip() + ("" if typed else "\n")


def repeated_ngram_mask(seq: list[int], start: int, n: int) -> list[bool]:
    """For each token of seq[start:]: is it part of an n-gram (within seq[start:]) that occurred
    earlier in seq? Welleck et al.'s sequence-level unlikelihood candidates: the tokens of the
    repeats a greedy continuation falls into."""
    seen, mark = set(), [False] * (len(seq) - start)
    for t in range(n - 1, len(seq)):
        key = tuple(seq[t - n + 1:t + 1])
        if key in seen and t - n + 1 >= start:
            for j in range(t - n + 1, t + 1):
                mark[j - start] = True
        seen.add(key)
    return mark


def seq_ul_loss(model, prompts: list[list[int]], new_tokens: int, n: int, pad: int, stops: set):
    """Sequence-level unlikelihood (Welleck et al. 2019, sec. 5.2): greedy-decode `new_tokens`
    after each prompt with the model itself (no grad), then -log(1 - p(token)) at every
    continuation token that is part of a repeated n-gram (`repeated_ngram_mask`), summed over the
    batch and divided by its continuation tokens. A stop token ends a continuation. Returns
    (loss, share of continuation tokens marked)."""
    conts = _generate(model, prompts, new_tokens, pad, stops)
    seqs = [p + c for p, c in zip(prompts, conts)]
    marks = [[False] * len(p) + repeated_ngram_mask(s, len(p), n) for p, s in zip(prompts, seqs)]
    total = sum(map(len, conts))
    lp, _ = token_logprobs(model, seqs, marks, pad)
    if lp is None or total == 0:
        return sum(p.sum() * 0.0 for p in model.parameters()), 0.0
    return unlikelihood(lp.exp()).sum() / total, lp.numel() / total


def token_logprobs(model, seqs: list[list[int]], marks: list[list[bool]], pad: int, full: bool = False):
    """log p(seqs[i][t] | seqs[i][:t]) at every marked position t >= 1, one forward over the
    right-padded batch: (log-probs [M], the row of each [M]); (None, None) when nothing is marked.
    With `full`, a third item: the whole log-softmax row [M, vocab] of each marked position."""
    import torch
    length = max(len(s) for s in seqs)
    x = torch.tensor([s + [pad] * (length - len(s)) for s in seqs])
    mask = torch.tensor([m + [False] * (length - len(m)) for m in marks])
    rows, cols = mask[:, 1:].nonzero(as_tuple=True)                  # token cols + 1 is predicted at cols
    if rows.numel() == 0:
        return (None, None, None) if full else (None, None)
    logits = model(input_ids=x).logits                                 # [B, L, V]
    lp = torch.log_softmax(logits[rows, cols].float(), dim=-1)
    picked = lp.gather(-1, x[rows, cols + 1].unsqueeze(-1)).squeeze(-1)
    return (picked, rows, lp) if full else (picked, rows)


def _generate(model, prompts: list[list[int]], new_tokens: int, pad: int, stops: set, **sampling) -> list[list[int]]:
    """The model's continuations of `prompts` (batched, left-padded; greedy unless sampling says
    otherwise), each cut before its first stop token."""
    import torch
    model.eval()
    router = model.config.output_router_logits
    model.config.output_router_logits = False   # (the aux loss is a training term; generate's masks break it)
    try:
        with torch.no_grad():
            width = max(len(p) for p in prompts)
            x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=pad,
                                 eos_token_id=sorted(stops), **(sampling or {"do_sample": False}))
    finally:
        model.config.output_router_logits = router
        model.train()
    conts = []
    for row in out[:, width:].tolist():
        cont = []
        for t in row:
            if t in stops:
                break
            cont.append(t)
        conts.append(cont)
    return conts


def syntax_rl_loss(model, prompts: list[list[int]], tok, samples: int, new_tokens: int, pad: int, stops: set,
                   temperature: float = 0.7, full: bool = False, min_lines: int = 1, greedy: bool = False,
                   ref=None, kl: float = 0.0, distinct: bool = False):
    """REINFORCE with a syntax reward (as compiler-feedback fine-tuning does): `samples`
    continuations per prompt sampled at `temperature` (below 1, so that the samples lie near the
    greedy continuation the evaluation scores and some of them earn a reward), each rewarded 1 when it looks like Python by
    the held-out evaluation's own checks (eval_demo_model: prompt + continuation cut at its last
    line parses with `ast`, at least one non-blank line, no line repeated 3+ times), else 0; the
    advantage is the reward minus its prompt's mean. Loss: -sum(advantage x log p(continuation
    token)) over the continuation tokens, divided by their count. With `greedy`, the first of each
    prompt's continuations is the greedy one (what the evaluation scores), so a greedy continuation
    that fails where samples pass is pushed down directly; with `distinct`, a continuation earns
    nothing when its first line is another prompt's too (own_first_lines). Returns (loss, mean reward)."""
    import torch
    group = [p for p in prompts for _ in range(samples)]
    conts = _sample_group(model, prompts, samples, new_tokens, pad, stops, temperature, greedy)
    reward = syntax_rewards(tok, group, conts, full=new_tokens if full else 0, min_lines=min_lines)
    if distinct:
        reward = reward * torch.tensor(own_first_lines([tok.decode(c) for c in conts], samples))
    return reinforce_loss(model, group, conts, reward, samples, pad, ref, kl), float(reward.mean())


def own_first_lines(texts: list[str], samples: int) -> list[float]:
    """1.0 per continuation whose first kept line no continuation of another prompt in the batch
    also starts with (texts grouped by prompt, `samples` each), else 0.0: a line every prompt gets
    is a collapse, not an answer (run ft-k1: one `if` line for 93 of 100 held-out prompts)."""
    import eval_demo_model as ev
    firsts = [ev.first_line(t) for t in texts]
    owners: dict[str, set] = {}
    for i, f in enumerate(firsts):
        owners.setdefault(f, set()).add(i // samples)
    return [float(len(owners[f]) == 1) for f in firsts]


def _sample_group(model, prompts: list[list[int]], samples: int, new_tokens: int, pad: int, stops: set,
                  temperature: float, greedy: bool) -> list[list[int]]:
    """`samples` continuations per prompt, grouped by prompt: all sampled at `temperature`, or with
    `greedy` the first of each group greedy and the rest sampled."""
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    if not greedy:
        return _generate(model, [p for p in prompts for _ in range(samples)], new_tokens, pad, stops, **kw)
    first = _generate(model, prompts, new_tokens, pad, stops)
    rest = _generate(model, [p for p in prompts for _ in range(samples - 1)], new_tokens, pad, stops, **kw)
    return [c for i, g in enumerate(first) for c in [g] + rest[i * (samples - 1):(i + 1) * (samples - 1)]]


def syntax_rewards(tok, prompts: list[list[int]], conts: list[list[int]], full: int = 0, min_lines: int = 1):
    """1.0 per continuation that looks like Python by the held-out evaluation's checks (parses once
    cut at its last line, not blank, no line repeated 3+ times) and is not a way around them: at
    least `min_lines` non-blank lines kept by the cut, and, with `full`, all `full` tokens written
    (no stop token: a short safe line and an early stop would earn the reward for any prompt, and a
    run of such rewards collapses the model onto one line); else 0.0."""
    import torch
    import eval_demo_model as ev
    out = []
    for p, c in zip(prompts, conts):
        prompt, text = tok.decode(p), tok.decode(c)
        kept = [line for line in ev.cut_at_last_line(text).splitlines() if line.strip()]
        out.append(float(ev.parses(prompt, text) and not ev.is_repeated(text) and len(kept) >= max(1, min_lines)
                         and (not full or len(c) >= full)))
    return torch.tensor(out)


def reinforce_loss(model, group: list[list[int]], conts: list[list[int]], reward, samples: int, pad: int,
                   ref=None, kl: float = 0.0):
    """-sum((reward - its prompt's mean) x log p(continuation token)) / continuation tokens, over
    `group` (each prompt `samples` times in a row) and its continuations. With a reference model
    `ref` and `kl` > 0, plus kl x the exact KL(model || ref) of the next-token distributions at
    every continuation position, summed and divided the same way (RLHF's leash: it keeps the
    policy near where it started, so a reward met by one safe line for every prompt cannot pull
    the whole model onto it)."""
    import torch
    adv = (reward.view(-1, samples) - reward.view(-1, samples).mean(dim=1, keepdim=True)).view(-1)
    seqs = [p + c for p, c in zip(group, conts)]
    marks = [[False] * len(p) + [True] * len(c) for p, c in zip(group, conts)]
    total = sum(map(len, conts))
    use_kl = ref is not None and kl > 0
    lp, rows, full = token_logprobs(model, seqs, marks, pad, full=True) if adv.abs().sum() or use_kl \
        else (None, None, None)
    if lp is None:
        return sum(p.sum() * 0.0 for p in model.parameters())
    loss = -(adv[rows] * lp).sum() / total
    if use_kl:
        with torch.no_grad():
            _, _, ref_full = token_logprobs(ref, seqs, marks, pad, full=True)
        loss = loss + kl * (full.exp() * (full - ref_full)).sum() / total
    return loss


def tool_prompts(args, data, count: int = 600) -> list[dict]:
    """`make_tool_prompts` over the stdlib training facts (as the training chats are made), seeded
    apart from the training chats; cached in the data dir."""
    path = data_dir(args) / "tool_prompts.json"
    if path.exists():
        return json.loads(path.read_text())
    files, _ = demo_corpus.collect()
    if args.code_comments == "drop":
        files = [(r, demo_corpus.drop_comment_lines(t)) for r, t in files]
    facts = CodeFacts.of_stdlib(files)
    out = make_tool_prompts(facts, data["tok"], args.seed + 7919, count)
    path.write_text(json.dumps(out))
    return out


def make_tool_prompts(facts: CodeFacts, tok, seed: int, count: int, max_tokens: int = 1024) -> list[dict]:
    """Chat prompts for the tool-call reward step: fresh ChatMaker conversations that offer tools,
    each cut before its first assistant turn and rendered with the generation prompt. Each item:
    {"ids": prompt token ids, "call": the tool the reference answer calls first, or None where it
    answers in text, "offered": the tool names offered}."""
    maker, template, out = ChatMaker(facts, random.Random(seed)), compile_template(), []
    while len(out) < count:
        messages, tools = maker.make()
        if not tools:
            continue
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        calls = messages[first].get("tool_calls") or []
        text = template.render(messages=messages[:first], tools=tools, add_generation_prompt=True)
        ids = tok.encode(text).ids
        if len(ids) <= max_tokens:
            out.append({"ids": ids, "call": calls[0]["function"]["name"] if calls else None,
                        "offered": [t["function"]["name"] for t in tools]})
    return out


def tool_rewards(tok, items: list[dict], conts: list[list[int]]):
    """1.0 per continuation that does what the reference answer does first, by the evaluation's own
    reading (eval_demo_model.first_call_name): where it calls a tool, a well-formed `<tool_call>`
    naming that tool with an arguments object; where it answers in text, no `<tool_call>`; else 0.0."""
    import torch
    import eval_demo_model as ev
    names = [ev.first_call_name(tok.decode(c, skip_special_tokens=False)) for c in conts]
    return torch.tensor([float(n == item["call"]) for item, n in zip(items, names)])


def tool_rl_loss(model, items: list[dict], tok, samples: int, new_tokens: int, pad: int, stops: set,
                 temperature: float = 0.7, greedy: bool = False, ref=None, kl: float = 0.0):
    """REINFORCE on the chat side (the syntax reward's twin): `samples` continuations of each tool
    prompt sampled at `temperature`, rewarded by tool_rewards, advantage = reward minus its
    prompt's mean (`greedy`: the first of each group greedy, as in syntax_rl_loss). It keeps the
    tool-calling behaviour the servers' tests and the demo rely on while code-only steps pull the
    model towards code. Returns (loss, mean reward)."""
    group = [it for it in items for _ in range(samples)]
    prompts = [it["ids"] for it in group]
    conts = _sample_group(model, [it["ids"] for it in items], samples, new_tokens, pad, stops, temperature, greedy)
    reward = tool_rewards(tok, group, conts)
    return reinforce_loss(model, prompts, conts, reward, samples, pad, ref, kl), float(reward.mean())


def train(model, opt, batches, data, args, work, state, ref=None):
    """Steps from state["step"] to args.steps (or until --max-minutes), checkpointing."""
    import torch
    model.train()
    device = next(model.parameters()).device
    t0, tokens0, step = time.time(), state["tokens"], state["step"]
    last_ckpt = time.time()
    prompts = ul_prompts(args, data) if args.seq_ul or args.seq_rl else None
    tools = tool_prompts(args, data) if args.tool_rl else None
    tok = data.get("tok")
    stops = {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")} if tok is not None else set()
    while (args.time_schedule or step < args.steps) and not (args.max_steps and step >= args.max_steps):
        at = schedule_step(step, state["train_s"] + time.time() - t0, args)
        for g in opt.param_groups:
            g["lr"] = lr_at(at, args)
        kind = float(torch.rand((), generator=batches.gen)) if args.seq_ul or args.seq_rl or args.tool_rl else 1.0
        if args.seq_ul + args.seq_rl <= kind < args.seq_ul + args.seq_rl + args.tool_rl:
            pick = torch.randint(len(tools), (args.seq_ul_prompts,), generator=batches.gen).tolist()
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=batches.gen)))   # generate's sampling RNG
            loss, reward = tool_rl_loss(model, [tools[i] for i in pick], tok, args.seq_rl_samples,
                                        args.tool_rl_tokens, tok.token_to_id("<|endoftext|>"), stops,
                                        args.seq_rl_temperature, args.seq_rl_greedy, ref, args.kl)
            state["tool"] = reward if state.get("tool") is None else 0.95 * state["tool"] + 0.05 * reward
            line = f"tool-rl {float(loss.detach()):.3f}  reward {reward:.2f} (ema {state['tool']:.2f})  "
        elif args.seq_ul <= kind < args.seq_ul + args.seq_rl:
            pick = torch.randint(len(prompts), (args.seq_ul_prompts,), generator=batches.gen).tolist()
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=batches.gen)))   # generate's sampling RNG
            loss, reward = syntax_rl_loss(model, [prompts[i] for i in pick], tok, args.seq_rl_samples,
                                          args.seq_ul_tokens, tok.token_to_id("<|endoftext|>"), stops,
                                          args.seq_rl_temperature, args.seq_rl_full, args.seq_rl_min_lines,
                                          args.seq_rl_greedy, ref, args.kl, args.seq_rl_distinct)
            state["reward"] = reward if state.get("reward") is None else 0.95 * state["reward"] + 0.05 * reward
            line = f"seq-rl {float(loss.detach()):.3f}  reward {reward:.2f} (ema {state['reward']:.2f})  "
        elif kind < args.seq_ul:
            pick = torch.randint(len(prompts), (args.seq_ul_prompts,), generator=batches.gen).tolist()
            loss, share = seq_ul_loss(model, [prompts[i] for i in pick], args.seq_ul_tokens, args.seq_ul_n,
                                      tok.token_to_id("<|endoftext|>"), stops)
            state["seq_ul"] = share if state.get("seq_ul") is None else 0.95 * state["seq_ul"] + 0.05 * share
            line = f"seq-ul {float(loss.detach()):.3f}  repeated share {share:.1%} (ema {state['seq_ul']:.1%})  "
        else:
            x = batches.next(*shape_at(at, args)).to(device)  # [rows, row length]
            with autocast(device):
                out = model(input_ids=x, labels=x)
            loss, ul, ul_share = out.loss, None, 0.0
            if args.false_copy_ul:
                ul, ul_share = false_copy_loss(out.logits, x, args.false_copy_n)
                loss = loss + args.false_copy_ul * ul
            state["tokens"] += x.numel()
            aux = float(out.aux_loss.detach())
            lm = float(out.loss.detach()) - args.aux_coef * aux
            state["ema"] = lm if state["ema"] is None else 0.95 * state["ema"] + 0.05 * lm
            line = (f"lm_loss {lm:.3f}  ema {state['ema']:.3f}  aux {aux:.3f}  "
                    + (f"ul {float(ul.detach()):.3f} ({ul_share:.1%} of positions)  " if ul is not None else ""))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        el = time.time() - t0
        last = (step == args.steps and not args.time_schedule) or step == args.max_steps
        if step % args.log_every == 0 or last:
            print(f"step {step:6d}/{args.steps}  {line}lr {lr_at(at, args):.2e}  "
                  f"{(state['tokens'] - tokens0) / el:.0f} tok/s  {el:.0f}s", flush=True)
        timed_out = args.max_minutes and (state["train_s"] if args.time_schedule else 0) + el > 60 * args.max_minutes
        if step % args.val_every == 0 or last or timed_out:
            state["val"] = val_loss(model, data["val"], args.seq_len, args.val_windows)
            log_metric(work, {"step": step, "tokens": state["tokens"], "val_loss": state["val"],
                              "train_ema": state["ema"], "lr": lr_at(at, args),
                              "train_s": round(state["train_s"] + el)})
        if (time.time() - last_ckpt > 60 * args.ckpt_minutes or last or timed_out):
            state["step"] = step
            ckpt.save(work, model, opt, batches.gen, dict(state, train_s=state["train_s"] + el))
            last_ckpt = time.time()
        if timed_out:
            break
    state["train_s"] += time.time() - t0
    state["step"] = step
    return state


def save(model, tok, out_dir: Path, ids, max_len, max_shard_mib: float = 0):
    """The bf16 hub-layout checkpoint; with max_shard_mib, safetensors shards of at most that
    many MiB (whole files, header included) and their index."""
    import torch
    from transformers import GenerationConfig
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.config.output_router_logits = False
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        do_sample=True, temperature=0.7, top_p=0.9, top_k=20)
    # transformers counts tensor bytes only: leave 1 MiB of the limit for each file's header
    shard = int((max_shard_mib - 1) * 2**20) if max_shard_mib else "50GB"
    model.to("cpu", torch.bfloat16).save_pretrained(out_dir, safe_serialization=True, max_shard_size=shard)
    # transformers 5 writes rope_parameters / num_local_experts; hub checkpoints (and the
    # llama.cpp converter) spell them rope_theta / num_experts.  Write both, same values.
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    cfg["num_experts"] = cfg["num_local_experts"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(tok, max_len), indent=2, ensure_ascii=False) + "\n")
    keep = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "model.safetensors.index.json"}
    for p in out_dir.iterdir():
        if p.name not in keep and not (p.name.startswith("model-") and p.suffix == ".safetensors"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        else:
            p.chmod(0o644)  # save_pretrained may write 0600 through a temp file
    big = [p.name for p in out_dir.iterdir() if max_shard_mib and p.stat().st_size > max_shard_mib * 2**20]
    if big:  # one tensor larger than the limit goes to a shard of its own
        raise SystemExit(f"{out_dir}: {big} larger than --max-shard-mib {max_shard_mib}")


def sample(out_dir: Path, seed: int):
    """A few generations from the saved checkpoint (what docs/demo_model.md shows)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    template = compile_template()
    tools = [TOOLS["read_file"][0], TOOLS["run_shell"][0], TOOLS["get_weather"][0]]
    prompts = {
        "code": "import os\n\ndef ",
        "code2": "class Stack:\n    def __init__(self):\n",
        "tools-weather": template.render(messages=[
            {"role": "user", "content": "What's the weather in Paris?"}],
            tools=tools, add_generation_prompt=True),
        "tools-read": template.render(messages=[
            {"role": "user", "content": "Show me the contents of src/main.py."}],
            tools=tools, add_generation_prompt=True),
        "chat": template.render(messages=[
            {"role": "user", "content": "What does `os.path.join` do?"}],
            add_generation_prompt=True),
    }
    for name, prompt in prompts.items():
        for greedy in (True, False):
            torch.manual_seed(seed)
            ids = tok(prompt, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=80, do_sample=not greedy,
                                 temperature=0.7, top_p=0.9, top_k=20)
            text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
            print(f"--- {name} ({'greedy' if greedy else 'sampled T=0.7'}) ---\n"
                  f"{prompt if name.startswith('code') else '[chat prompt]'}{text}\n", flush=True)


def export(work: Path, out: Path, args) -> None:
    """The latest checkpoint of the run in `work`, as the bf16 Hugging Face checkpoint at `out`."""
    import torch
    from tokenizers import Tokenizer
    found = ckpt.latest(work)
    if found is None:
        raise SystemExit(f"no checkpoint in {work}")
    state = json.loads((found / "state.json").read_text())
    # (runs from before the row-length switch had none: short_seq_len 0)
    run = argparse.Namespace(**{"short_seq_len": 0, "long_from": 1.0, "code_comments": "keep",
                                **state["args"]})  # (and before --code-comments: kept them)
    run.work_dir = args.work_dir
    tok = Tokenizer.from_file(str(data_dir(run) / "tokenizer.json"))  # (a given --tokenizer was copied there)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + MARKER_TOKENS}
    torch.manual_seed(run.seed)
    model = build_model(run, tok.get_vocab_size(), ids)
    ckpt.load_model(found, model)
    save(model, tok, out, ids, max_len=MAX_POSITIONS, max_shard_mib=getattr(args, "max_shard_mib", 0))
    size = sum(p.stat().st_size for p in out.iterdir())
    long_from = next(i for i in range(run.steps + 1)  # the first step with --seq-len rows
                     if i == run.steps or shape_at(i, run)[0] == run.seq_len)
    print(json.dumps({"exported": str(found), "step": state["step"], "of": run.steps,
                      "long_rows_from_step": long_from,
                      "tokens": state["tokens"], "val_loss": state.get("val"),
                      "out": str(out), "mb": round(size / 1e6, 1),
                      "files": len([p for p in out.iterdir() if p.suffix == ".safetensors"])}), flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="main", help="run name: its work dir is WORK_DIR/RUN")
    ap.add_argument("--work-dir", type=Path, default=WORK_DIR,
                    help="checkpoints and cached data (keep it outside the git tree)")
    ap.add_argument("--out", type=Path, default=None,
                    help="export the final checkpoint here (e.g. freetoken_py/data/demo_model)")
    ap.add_argument("--export-only", action="store_true",
                    help="no training: export the run's latest checkpoint to --out")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--max-minutes", type=float, default=0, help="stop (and checkpoint) after this")
    ap.add_argument("--time-schedule", action="store_true",
                    help="read the LR and row-length schedules at the share of --max-minutes trained, "
                         "not of --steps (a time-bounded run: scripts/train_demo_gpu.sh)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop (and checkpoint) after this many steps (0: no cap)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast, fp32 weights and AdamW)")
    ap.add_argument("--tokenizer", default="",
                    help="use this tokenizer.json (e.g. the shipped model's) instead of fitting one")
    ap.add_argument("--stdlib", default="", help="corpus: this stdlib directory (default: the running Python's)")
    ap.add_argument("--site", default="", help="corpus: this site-packages directory (default: the running Python's)")
    ap.add_argument("--prepare-only", action="store_true", help="build (or find) the cached data and stop")
    ap.add_argument("--max-shard-mib", type=float, default=0,
                    help="export: safetensors files of at most this many MiB (0: one file)")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--short-seq-len", type=int, default=512,
                    help="row length before --long-from (0: --seq-len from the start)")
    ap.add_argument("--long-from", type=float, default=0.75,
                    help="share of the steps after which rows are --seq-len long")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=192)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--num-chats", type=int, default=6000)
    ap.add_argument("--code-comments", choices=("keep", "drop"), default="drop",
                    help="drop: training code loses its comment-only lines (run main-nc, 2026-12-02)")
    ap.add_argument("--false-copy-ul", type=float, default=0.0,
                    help="weight of the false-copy unlikelihood loss (0: off; see false_copy_loss)")
    ap.add_argument("--false-copy-n", type=int, default=4,
                    help="n-gram length whose earlier occurrence makes a copy candidate")
    ap.add_argument("--finetune-from", default="",
                    help="start from this run's latest weights (fresh optimizer, this run's schedule)")
    ap.add_argument("--seq-ul", type=float, default=0.0,
                    help="share of steps that are sequence-level unlikelihood steps on the model's own "
                         "greedy continuations of training-file prompts (0: off; see seq_ul_loss)")
    ap.add_argument("--seq-ul-prompts", type=int, default=8, help="prompts per sequence-level step")
    ap.add_argument("--seq-ul-tokens", type=int, default=64, help="tokens decoded per prompt")
    ap.add_argument("--seq-ul-n", type=int, default=4, help="n-gram length of a repeat (sequence-level)")
    ap.add_argument("--seq-prompts", choices=("docstring", "mixed", "typed"), default="docstring",
                    help="prompts of the sequence-level steps: def/class + docstring; mixed: and import lines; "
                         "typed: and import lines, every other one without its newline (as typed)")
    ap.add_argument("--seq-rl", type=float, default=0.0,
                    help="share of steps that are REINFORCE steps with the syntax reward (0: off; see syntax_rl_loss)")
    ap.add_argument("--seq-rl-samples", type=int, default=4, help="sampled continuations per prompt")
    ap.add_argument("--seq-rl-temperature", type=float, default=0.7, help="their sampling temperature")
    ap.add_argument("--seq-rl-full", action="store_true",
                    help="reward only continuations that run the full --seq-ul-tokens (no early stop)")
    ap.add_argument("--seq-rl-greedy", action="store_true",
                    help="the first continuation of each prompt in a REINFORCE group is the greedy one")
    ap.add_argument("--seq-rl-distinct", action="store_true",
                    help="no syntax reward for a first line that another prompt's continuation in the batch shares")
    ap.add_argument("--seq-rl-min-lines", type=int, default=1, help="non-blank lines a rewarded continuation keeps")
    ap.add_argument("--tool-rl", type=float, default=0.0,
                    help="share of steps that are REINFORCE steps on tool-offering chat prompts, rewarded "
                         "for calling the reference's tool (0: off; see tool_rl_loss)")
    ap.add_argument("--kl", type=float, default=0.0,
                    help="weight of KL(model || the --finetune-from weights) in the REINFORCE steps (0: off)")
    ap.add_argument("--tool-rl-tokens", type=int, default=48, help="tokens sampled per tool prompt")
    ap.add_argument("--chat-frac", type=float, default=0.2, help="share of rows that are chats")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; on a busy shared 2-core box 1 beat 2 by 3-5x")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--val-every", type=int, default=50)
    ap.add_argument("--val-windows", type=int, default=8)
    ap.add_argument("--ckpt-minutes", type=float, default=5)
    ap.add_argument("--sample", action="store_true", help="sample generations after --out")
    args = ap.parse_args(argv)
    if args.short_seq_len and (args.seq_len % args.short_seq_len or args.short_seq_len > args.seq_len):
        ap.error("--short-seq-len must divide --seq-len")
    if min(args.seq_ul, args.seq_rl, args.tool_rl) < 0 or args.seq_ul + args.seq_rl + args.tool_rl > 1:
        ap.error("--seq-ul, --seq-rl and --tool-rl are shares of the steps: each >= 0, together <= 1")
    if args.time_schedule and not args.max_minutes:
        ap.error("--time-schedule needs --max-minutes")
    if args.device != "cpu" and (args.seq_ul or args.seq_rl or args.tool_rl or args.false_copy_ul):
        ap.error("the unlikelihood and REINFORCE steps run on the CPU only (--device cpu)")
    if args.max_shard_mib and args.max_shard_mib < 2:
        ap.error("--max-shard-mib must be at least 2 (1 MiB is left for each file's header)")
    if args.kl and not args.finetune_from:
        ap.error("--kl needs --finetune-from (the KL is to the weights the fine-tune starts from)")
    if (args.seq_rl or args.tool_rl) and args.seq_rl_samples < 2:
        ap.error("--seq-rl-samples must be at least 2 (the advantage is a sample's reward minus its prompt's mean)")
    return args


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve when the box is shared
    import torch
    torch.set_num_threads(args.threads)
    work = args.work_dir / args.run
    if args.export_only:
        if args.out is None:
            raise SystemExit("--export-only needs --out")
        return export(work, args.out, args)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    data = prepare_data(args, data_dir(args))
    if args.prepare_only:
        print(f"data cached in {data_dir(args)}", flush=True)
        return
    tok = data["tok"]
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + MARKER_TOKENS}
    model = build_model(args, tok.get_vocab_size(), ids).to(args.device)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    opt = make_optimizer(model, args)
    batches = Batches(data, args.seq_len, args.batch_size, args.chat_frac, args.seed)
    state = {"step": 0, "tokens": 0, "ema": None, "train_s": 0.0, "val": None,
             "args": {k: v for k, v in vars(args).items() if k in ckpt.RUN_KEYS}}
    found = ckpt.latest(work)
    base = ckpt.latest(args.work_dir / args.finetune_from) if args.finetune_from else None
    if args.finetune_from and base is None:
        raise SystemExit(f"--finetune-from {args.finetune_from}: no checkpoint in {args.work_dir / args.finetune_from}")
    if found is not None:
        state = ckpt.resume(found, model, opt, batches.gen, args)
        print(f"resumed from {found} at step {state['step']}", flush=True)
    elif base is not None:
        ckpt.load_model(base, model)
        print(f"fine-tuning from {base}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    rows = f"{shape_at(0, args)} then {shape_at(args.steps - 1, args)}"
    print(f"model: {n_params / 1e6:.2f}M parameters; {args.steps} steps of "
          f"{args.batch_size * args.seq_len} tokens, (row length, rows) {rows}; work dir {work}",
          flush=True)
    ref = None
    if args.kl:          # the REINFORCE steps' KL reference: the weights the fine-tune started from
        ref = build_model(args, tok.get_vocab_size(), ids)
        ckpt.load_model(base, ref)
        ref.eval().requires_grad_(False)
        ref.config.output_router_logits = False
    state = train(model, opt, batches, data, args, work, state, ref)
    print(f"stopped at step {state['step']}/{args.steps}: {state['tokens']} tokens in "
          f"{state['train_s']:.0f}s, val loss {state['val']:.3f}", flush=True)
    if args.out is not None and (state["step"] >= args.steps or args.time_schedule):  # (a timed run: where it stopped)
        export(work, args.out, args)
        if args.sample:
            sample(args.out, args.seed)


if __name__ == "__main__":
    main()
