"""tokenizer.json via the `tokenizers` library, chat templates rendered in Jinja's sandbox,
and incremental detokenization for streaming."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from freetoken_py.errors import FreetokenError, ModelLoadError
from freetoken_py.models.checkpoint import read_json


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json (needed for text prompts; "
                                 "pass token ids through the Python API instead)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot parse tokenizer ({str(exc).splitlines()[0]})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = read_json(cfg_path) if cfg_path.exists() else {}
        self.chat_template = cfg.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"
        if not self.chat_template and jinja_path.exists():
            self.chat_template = jinja_path.read_text(encoding="utf-8")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token is not None
        self._compiled = None
        self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._keep: frozenset[int] = frozenset()

    def keep_in_text(self, markup) -> None:
        """Special tokens that `decode` keeps by default even when it skips special tokens: the
        tool-call and reasoning tags of the model's chat format, which the output parser must see
        (GLM's <tool_call> and Kimi's <|tool_call_begin|> are special tokens). Strings that are
        not special tokens of this vocabulary are ignored. This changes every later decode; a
        server request passes its own (`SamplingParams.keep_special_tokens`) instead."""
        self._keep = self.special_ids(markup)

    def special_ids(self, tokens) -> frozenset[int]:
        """The ids of those of `tokens` (strings) that are special tokens of this vocabulary."""
        return frozenset(i for i in map(self.token_to_id, tokens) if i in self._special_ids)

    def added_token_ids(self) -> list[int]:
        """The ids of the vocabulary's added tokens (special or not), in id order."""
        return sorted(self._tok.get_added_tokens_decoder())

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            bos = self.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()) -> str:
        """keep: special token ids kept in the text on top of `keep_in_text`'s (one request's)."""
        keep = self._keep | keep if keep else self._keep
        if skip_special_tokens and keep:
            ids = [i for i in ids if i in keep or i not in self._special_ids]
            skip_special_tokens = False
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise FreetokenError("this model has no chat template (tokenizer_config.json has no "
                                 "'chat_template'); run without --chat")
        if self._compiled is None:
            self._compiled = _sandbox().from_string(self.chat_template)
        try:
            messages = [_with_json_arguments(m) for m in messages]
            return self._compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except FreetokenError:
            raise
        except Exception as exc:
            raise FreetokenError(f"chat template failed: {exc}") from None


# model_type -> the project's own template (freetoken_py/data/chat_templates/) for a family whose
# checkpoints ship no Jinja template: DeepSeek-V3.2 publishes a Python encoder instead
BUNDLED_TEMPLATES = {"deepseek_v32": "deepseek_v32.jinja"}


def bundled_chat_template(model_type: str | None) -> str | None:
    """The bundled chat template for a model_type whose checkpoints ship none, else None."""
    name = BUNDLED_TEMPLATES.get(model_type or "")
    return (Path(__file__).parent / "data" / "chat_templates" / name).read_text(encoding="utf-8") if name else None


class TemplateArguments(dict):
    """A tool call's arguments as templates see them: a dict (most templates iterate `.items()`)
    that prints and concatenates as its JSON text (DeepSeek V3.1's writes `name + '<｜tool▁sep｜>'
    + arguments`, as for the OpenAI convention's string arguments)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other):
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + str(self) if isinstance(other, str) else NotImplemented


def _with_json_arguments(message):
    """The message with each tool call's dict arguments as TemplateArguments (copies, not in place)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and type(fn.get("arguments")) is dict:
            call = {**call, "function": {**fn, "arguments": TemplateArguments(fn["arguments"])}}
        out.append(call)
    return {**message, "tool_calls": out}


def _sandbox():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise FreetokenError(f"chat template: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # loopcontrols ({% break %}, {% continue %}) as transformers enables it: Kimi K2-Thinking's template uses it
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without re-decoding everything (vLLM's
    prefix/read-offset scheme); holds back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], keep: frozenset[int] = frozenset()):
        """keep: special token ids this request keeps in its text (`Tokenizer.decode`)."""
        self.tok, self.keep = tokenizer, keep
        self.ids = list(prompt_ids[-5:])  # context so decoders that strip a leading space behave
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], keep=self.keep)
        full = self.tok.decode(self.ids[self.prefix_offset:], keep=self.keep)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
