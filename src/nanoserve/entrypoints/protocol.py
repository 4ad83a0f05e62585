"""OpenAI API request bodies as pydantic models (the responses: ``responses.py``).

Requests are parsed in strict mode so that wrong JSON types ("0.5" for a float, 1.0 for an
int) are refused rather than coerced; range checks are left to SamplingParams, which names
the offending field. Unknown fields are ignored, as OpenAI-compatible tools often send extras.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.entrypoints.errors import APIError
from nanoserve.entrypoints.constraints import tool_choice_schema
from nanoserve.entrypoints.tool_calls import ForcedToolCalls
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions; None means the default."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    use_beam_search: bool | None = False  # vLLM's extra fields: n beams, scored with
    length_penalty: float | None = 1.0  # length_penalty (nanoserve.beam_search)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top ones
    # Constrained output (entrypoints.constraints): OpenAI's field, then vLLM's.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self, config: EngineConfig) -> None:
        """Refuse what the server does not do, or more than ``config`` allows a request."""
        for name, option in self._limited_fields():
            value, limit = getattr(self, name), getattr(config, option)
            if value is not None and value > limit:
                flag = "--" + option.replace("_", "-")
                raise APIError(f"{name} must be <= {limit} (the server's {flag}), got {value}",
                               param=name)
        if self.use_beam_search and self.stream:
            raise APIError("use_beam_search answers once the search ends; it cannot stream",
                           param="stream")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("prompt_logprobs come with the full response; they cannot stream",
                           param="prompt_logprobs")
        if self.n is not None and self.n < 1:
            raise APIError(f"n must be >= 1, got {self.n}", param="n")

    def _limited_fields(self) -> list[tuple[str, str]]:
        """(field, the EngineConfig option bounding it) pairs."""
        return [("n", "max_n"), ("prompt_logprobs", "max_logprobs")]

    def top_logprobs_wanted(self) -> int | None:
        """How many top logprobs each generated token reports; None: no logprobs at all."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        """How many top logprobs each prompt token reports; None: none."""
        return self.prompt_logprobs

    def samples_per_prompt(self) -> int:
        """Engine requests per prompt: n, or best_of where a request ranks samples."""
        return self.n or 1

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this request; a bad value raises a 400 APIError naming it."""
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        given.update(logprobs=self.top_logprobs_wanted(), structured_outputs=constraint,
                     prompt_logprobs=self.prompt_logprobs_wanted(),
                     logit_bias=None if self.logit_bias is None else _token_keys(self.logit_bias))
        kwargs = {k: v for k, v in given.items() if v is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, **kwargs)
        except ValueError as exc:
            raise value_error_to_api(exc) from None


# Request fields passed to SamplingParams as they are.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "min_tokens", "include_stop_str_in_output",
                    "skip_special_tokens", "n", "allowed_token_ids", "truncate_prompt_tokens")


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise APIError(f"logit_bias must map token ids to biases, got the keys "
                       f"{list(bias)[:5]}", param="logit_bias") from None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        # Echoed logprobs list the prompt's tokens too, with as many alternatives.
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def samples_per_prompt(self) -> int:
        return self.best_of or super().samples_per_prompt()

    def _limited_fields(self) -> list[tuple[str, str]]:
        return super()._limited_fields() + [("best_of", "max_n"), ("logprobs", "max_logprobs")]

    def check_supported(self, config: EngineConfig) -> None:
        super().check_supported(config)
        if self.echo and self.use_beam_search:
            raise APIError("echo is not supported with use_beam_search", param="echo")
        if self.best_of is not None:
            if self.best_of < (self.n or 1):
                raise APIError(f"best_of must be >= n ({self.n}), got {self.best_of}",
                               param="best_of")
            if self.best_of != (self.n or 1) and (self.stream or self.use_beam_search):
                raise APIError("best_of ranks finished samples: it works without stream and "
                               "use_beam_search", param="best_of")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # tool_calls etc. reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message for a chat template, content parts joined; an assistant's null content
        is "": templates such as Qwen3's search the content for a thinking block."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        elif self.content is None and self.role == "assistant":
            message["content"] = ""
        return message


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, shown to the model as given


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM's: extra variables for the chat template, e.g. Qwen3's {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    def _limited_fields(self) -> list[tuple[str, str]]:
        return super()._limited_fields() + [("top_logprobs", "max_logprobs")]

    def check_supported(self, config: EngineConfig) -> None:
        super().check_supported(config)
        check_template_kwargs(self.chat_template_kwargs)
        if self.tool_choice is not None and not self.tools:
            raise APIError("tool_choice needs tools", param="tool_choice")
        if self.tools and self.tool_choice not in (None, "auto", "none", "required"):
            choice = self.tool_choice
            function = choice.get("function") if isinstance(choice, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or choice.get("type") != "function":
                raise APIError("tool_choice must be 'none', 'auto', 'required' or "
                               '{"type": "function", "function": {"name": ...}}',
                               param="tool_choice")
            if name not in {tool.function.name for tool in self.tools}:
                raise APIError(f"tool_choice names the function {name!r}, which is not among "
                               "the tools", param="tool_choice")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
            if self.top_logprobs < 0:
                raise APIError(f"top_logprobs must be >= 0, got {self.top_logprobs}",
                               param="top_logprobs")

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def offers_tools(self) -> bool:
        """Whether tools go to the template and answers are parsed for calls (not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tool_calls(self) -> ForcedToolCalls | None:
        """How the answer becomes calls when tool_choice forces them ('required' or named)."""
        if not self.tools or self.tool_choice in (None, "auto", "none"):
            return None
        return ForcedToolCalls(None if self.tool_choice == "required"
                               else self.tool_choice["function"]["name"])

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced tool_choice holds the answer to (None: not forced)."""
        forced = self.forced_tool_calls()
        return None if forced is None else tool_choice_schema(self.tools_offered(), forced.name)

    def tools_offered(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (None unless ``offers_tools``)."""
        if not self.offers_tools():
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def max_new_tokens(self) -> int | None:
        # max_completion_tokens replaced max_tokens in OpenAI's API; either is accepted.
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def value_error_to_api(exc: ValueError, prompt_field: str = "prompt") -> APIError:
    """A 400 for a ValueError from SamplingParams or the engine, whose messages start with
    the field at fault; ``prompt_field`` renames "prompt" for chat, where it is "messages"."""
    message = str(exc)
    field = message.split(" ", 1)[0]
    field = prompt_field if field == "prompt" else field
    known = CompletionRequest.model_fields.keys() | ChatCompletionRequest.model_fields.keys()
    return APIError(message, param=field if field in known else None)


# Variables the server itself sets when it renders a conversation.
RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "tokenize",
                            "add_generation_prompt", "chat_template", "documents"}


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    taken = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or {}))
    if taken:
        raise APIError(f"chat_template_kwargs may not set {', '.join(taken)}: the request's "
                       "own fields do", param="chat_template_kwargs")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
