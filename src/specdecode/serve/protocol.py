"""The OpenAI request and error shapes the server accepts and returns (pydantic), and the
translation of a request into the engine's SamplingParams."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

from ..core.sampling import SamplingParams


def _json_int(v):
    """JSON Schema's integer: an int or an integral float (9.0), never a bool or a string."""
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and not v.is_integer())
    ):
        raise ValueError("Input should be an integer")
    return int(v)


def _json_number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("Input should be a number")
    return v


def _json_bool(v):
    if not isinstance(v, bool):
        raise ValueError("Input should be a boolean")
    return v


Int = Annotated[int, BeforeValidator(_json_int)]
Float = Annotated[float, BeforeValidator(_json_number)]
NonEmpty = Annotated[str, Field(min_length=1)]
Stop = NonEmpty | Annotated[list[NonEmpty], Field(max_length=16)] | None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorBody


class APIError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {
            400: "invalid_request_error",
            404: "not_found_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(status, "server_error")

    def body(self) -> dict:
        code = {404: "model_not_found", 429: "queue_full"}.get(self.status)
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields both endpoints share. Extensions beyond OpenAI: top_k, min_p, ignore_eos."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    n: Int = Field(1, ge=1, le=16)
    seed: Int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: Stop = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    top_k: Int = Field(
        0, ge=-1, lt=2**31, description="extension: keep the k most likely tokens (0 or -1: off)"
    )
    min_p: Float = Field(0.0, ge=0, lt=1, description="extension: drop tokens below min_p x the top one")
    ignore_eos: StrictBool = Field(False, description="extension: keep going after the end-of-text token")
    sampling_rule: Literal["standard", "invariant"] | None = Field(
        None,
        description="extension: standard (rejection sampling) or invariant (noise keyed by seed and "
        "position: a seed gives the same text whatever the drafter, the batch or the load); default: "
        "the server's --sampling-rule (auto: invariant when seed is set)",
    )
    # accepted only as no-ops: penalties and logit bias would change the model's distribution
    presence_penalty: Float | None = Field(None, ge=0, le=0, description="only 0 (not supported)")
    frequency_penalty: Float | None = Field(None, ge=0, le=0, description="only 0 (not supported)")
    logit_bias: dict[str, Float] | None = Field(None, max_length=0, description="only {} (not supported)")
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(s == "" for s in stops):
            raise APIError(400, "stop strings must be non-empty", "stop")
        return stops

    def params(
        self, max_tokens: int, logprobs: int | None, default_rule: str = "auto"
    ) -> list[SamplingParams]:
        """One SamplingParams per choice; choice i is seeded seed + i (one seed for all would
        make every choice the same sample). The sampling rule: the request's, else the server's
        (auto: invariant for a seeded request, so its seed fixes the text under any load)."""
        rule = self.sampling_rule or default_rule  # "auto": SamplingParams resolves it
        base = dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            max_new_tokens=max_tokens,
            stop=self.stops(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            sampling_rule=rule,
        )
        seeds = [None if self.seed is None else (self.seed + i) % 2**63 for i in range(self.n)]
        return [SamplingParams(seed=s, **base) for s in seeds]


class CompletionRequest(_Sampling):
    prompt: (
        NonEmpty
        | Annotated[list[Int], Field(min_length=1)]
        | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]
    ) = Field(description="text, token ids, or a list of one text (batches: one request per prompt)")
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=5)
    echo: Annotated[Literal[False], BeforeValidator(_json_bool)] = Field(
        False, description="only false (not supported)"
    )
    best_of: Literal[1] | None = Field(None, description="only 1 (every sample is returned; use n)")
    suffix: Literal[""] | None = Field(None, description="not supported")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
