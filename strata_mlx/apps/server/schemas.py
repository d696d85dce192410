"""The server's request bodies (pydantic models: unknown fields refused, types strict) and
its errors: APIError, the OpenAI-style error body every 4xx and 500 answers with.
Never: touches the model or the engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ...config import (
    MAX_SEED,
)

# ---- request models ------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: no "5" -> 5 or true -> 1 coercion; unknown fields are ignored, as OpenAI's
    # clients send some (user, metadata, ...) that do not change the output.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, for the template
    tool_call_id: str | None = None  # a tool's answer: to which call


class SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    # mlx-lm's server's fields beyond OpenAI's; ranges are checked by strata_mlx.config
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20

    def unsupported(self) -> list[tuple[str, bool]]:
        """(parameter, set to something this server does not do)."""
        return [("n", self.n != 1)]


class ResponseFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    tools: list[dict] | None = None
    tool_choice: Literal["auto", "none"] | None = None  # "required" / a named one: not done
    response_format: ResponseFormat | None = None  # only "text": no constrained decoding
    # variables of the chat template (enable_thinking=false for Qwen3), as mlx-lm's and
    # vLLM's servers take them
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _functions(cls, tools):
        """OpenAI's shape, which the chat template renders: a function with a name, its
        parameters a JSON Schema object."""
        for i, t in enumerate(tools or []):
            fn = t.get("function")
            if t.get("type") != "function" or not isinstance(fn, dict):
                raise ValueError(f"tools.{i}: expected {{'type': 'function', 'function': {{...}}}}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools.{i}.function.name: a non-empty string")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise ValueError(f"tools.{i}.function.parameters: a JSON Schema object")
        return tools

    def unsupported(self):
        constrained = self.response_format is not None and self.response_format.type != "text"
        return super().unsupported() + [
            ("logprobs", self.logprobs),
            ("response_format", constrained),
        ]


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self):
        return super().unsupported() + [
            ("echo", self.echo),
            ("logprobs", bool(self.logprobs)),
            ("suffix", bool(self.suffix)),
        ]


# ---- errors --------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        message = " ".join(message.splitlines())  # one line, whatever a request echoes in it
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = (
            message,
            status,
            param,
            code,
            type,
        )
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        """The error as Anthropic's API shapes it."""
        kind = {
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            413: "request_too_large",
            429: "rate_limit_error",
            503: "overloaded_error",
        }.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error's response to a request for `path`: Anthropic's body on its routes,
        whatever raised it (a guard before the route, the route itself), OpenAI's elsewhere."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_ROUTES) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


ANTHROPIC_ROUTES = "/v1/messages"  # (and /v1/messages/count_tokens)


def one_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def generation_error(e: Exception) -> APIError:
    """A failure inside generation: a ValueError is the request's (an option out of range),
    anything else the server's."""
    if isinstance(e, ValueError):
        return APIError(one_line(e))
    return APIError(one_line(e), 500, type="server_error")


def chat_request(body: dict, names: dict[str, str] | None = None) -> ChatCompletionRequest:
    """The chat-completions request another API's request (Anthropic's messages, a response)
    asks for, validated as the chat route validates its own body: what it refuses is the
    client's (a tool named "", a parameters schema that is not an object), a 400 naming the
    parameter as chat completions names it, or as `names` maps its first part to the other
    API's ({"messages": "input"}), the rest dropped where an index follows (the other API's
    list may not line up with the chat request's: a system message added first)."""

    def rename(loc: list[str]) -> list[str]:
        if not names or not loc or loc[0] not in names:
            return loc
        return [names[loc[0]]] + ([] if len(loc) < 2 or loc[1].isdigit() else loc[1:])

    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e, rename) from None


def validation_error(
    exc: RequestValidationError | ValidationError,
    rename: Callable[[list[str]], list[str]] | None = None,
) -> APIError:
    """The first of `exc`'s errors as a 400 naming its parameter (its location, through
    `rename` where given: another API's name for it)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return APIError(f"request body is not valid JSON: {e.get('msg')}", code="invalid_json")
    param = ".".join(rename(loc) if rename else loc) or None
    msg = e.get("msg", "invalid value")
    if e.get("type") == "value_error" and "error" in e.get("ctx", {}):  # (ours: no "Value
        msg = str(e["ctx"]["error"])  # error, " before it)
    if e.get("type") == "missing":
        if param is None:
            return APIError("the request has no body: expected a JSON object", code="missing")
        return APIError(f"missing required parameter: {param}", param=param, code="missing")
    return APIError(f"{param}: {msg}" if param else msg, param=param, code="invalid_value")
