"""Pydantic models of every route's request and response bodies, for `/openapi.json` (and the
clients generated from it). They describe; they do not validate: handlers keep reading the body
field by field (protocol.get), so unknown fields stay tolerated and each rejection keeps its
API's own error shape and wording. `install(app)` puts them into the app's OpenAPI document:
request bodies, 200 bodies (JSON, or `text/event-stream` when `stream` is true) and error bodies.
tests/test_server_openapi.py validates real responses against this document."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from freetoken_py.core import MAX_LOGPROBS


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")   # unknown fields are accepted and ignored


class _Sampling(_Open):
    model: str | None = Field(None, description="any name: it maps to the loaded model")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    repetition_penalty: float | None = Field(None, ge=0.01, le=10)
    stream: bool | None = False
    cache_salt: str | None = Field(None, description="share prefix-cache pages only with requests of this salt")
    ignore_eos: bool | None = Field(None, description="vLLM extension: keep generating past EOS")


class _OpenAISampling(_Sampling):
    n: int | None = Field(1, ge=1, description="choices; at most --max-num-seqs; they share the prompt's pages")
    max_tokens: int | None = Field(None, ge=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100]")
    stream_options: dict[str, Any] | None = Field(None, description="include_usage: a last chunk with usage")


class ChatCompletionRequest(_OpenAISampling):
    messages: list[dict[str, Any]] = Field(..., description="system / developer / user / assistant / tool")
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(..., description="one prompt: text or token ids")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = Field(False, description="prepend the prompt (scored; max_tokens 0: only the prompt)")
    best_of: int | None = Field(None, ge=1, description="only equal to n")


class ResponsesRequest(_Sampling):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    include: list[str] | None = Field(None, description="message.output_text.logprobs is honoured")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None


class MessagesRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_tokens: int = Field(..., ge=1, description="required, as in Anthropic's API")
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_Open):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


# ---- responses ---------------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: dict[str, str]


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(..., description="null for an echoed prompt's first token")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    context_length: int
    max_output_tokens: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ResponseObject(_Open):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    usage: dict[str, Any] | None = None


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: dict[str, int]


class TokenCount(BaseModel):
    input_tokens: int


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


# path -> (request, 200 body, whether it streams with stream: true, error body)
ROUTES = {
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion, True, OpenAIError),
    "/v1/completions": (CompletionRequest, Completion, True, OpenAIError),
    "/v1/responses": (ResponsesRequest, ResponseObject, True, OpenAIError),
    "/v1/messages": (MessagesRequest, AnthropicMessage, True, AnthropicError),
    "/v1/messages/count_tokens": (CountTokensRequest, TokenCount, False, AnthropicError),
}
GETS = {"/v1/models": ModelList, "/v1/models/{model_id}": ModelCard}


def install(app) -> None:
    """Replace app.openapi with one that describes the bodies above (built once, on first use)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            models = {m for r in ROUTES.values() for m in (r[0], r[1], r[3])} | set(GETS.values())
            for model in sorted(models, key=lambda m: m.__name__):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            for path, (req, ok, streams, err) in ROUTES.items():
                _describe(doc["paths"][path]["post"], req, ok, streams, err)
            for path, ok in GETS.items():
                op = next(iter(doc["paths"][_template(doc, path)].values()))
                op["responses"] = {"200": {"description": "OK", "content": _json(ok)},
                                   "4XX": {"description": "error", "content": _json(OpenAIError)}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def _template(doc: dict, path: str) -> str:
    """FastAPI writes `{model_id:path}` as `{model_id}`; find the path as the document names it."""
    return path if path in doc["paths"] else next(p for p in doc["paths"] if p.startswith(path.split("{")[0])
                                                  and "{" in p)


def _json(model) -> dict:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}


def _describe(op: dict, req, ok, streams: bool, err) -> None:
    op["requestBody"] = {"required": True, "content": _json(req)}
    content = _json(ok)
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string", "description": "with stream: true, SSE"}}
    op["responses"] = {"200": {"description": "OK", "content": content},
                       "4XX": {"description": "error, in the API's own shape", "content": _json(err)},
                       "5XX": {"description": "server error or overloaded", "content": _json(err)}}
