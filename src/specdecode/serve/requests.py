"""Request checks, before anything is queued: the model name, the prompt's encoding, and the
token budget within the server's context (--max-model-len). Each failure is an APIError (400 or
404 in OpenAI's error shape) that names the field."""

from __future__ import annotations

from ..core.sampling import SamplingParams
from ..errors import SpecDecodeError
from .protocol import APIError, ChatRequest, CompletionRequest


class Admission:
    """Turns a validated request body into (prompt ids, one SamplingParams per choice)."""

    def __init__(
        self, gen, model_id: str, max_model_len: int, default_max_tokens: int, sampling_rule: str = "auto"
    ) -> None:
        self.gen, self.model_id = gen, model_id
        self.max_model_len, self.default_max_tokens = max_model_len, default_max_tokens
        self.sampling_rule = sampling_rule  # a request without sampling_rule gets this one

    def completion(self, body: CompletionRequest) -> tuple[list[int], list[SamplingParams]]:
        self.check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = self.encode(prompt)
        return ids, body.params(self.budget(ids, body.max_tokens), body.logprobs, self.sampling_rule)

    def chat(self, body: ChatRequest) -> tuple[list[int], list[SamplingParams]]:
        self.check_model(body.model)
        tok = self.gen.target.tokenizer
        if tok is None or tok.chat_template is None:
            raise APIError(400, f"{self.model_id} has no chat template; use /v1/completions", "messages")
        ids = self.encode([{"role": m.role, "content": m.text()} for m in body.messages])
        if body.max_tokens is not None:  # checked even when max_completion_tokens wins
            self.budget(ids, body.max_tokens)
        max_tokens = self.budget(ids, body.max_completion_tokens or body.max_tokens)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return ids, body.params(max_tokens, logprobs, self.sampling_rule)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_id, ""):
            raise APIError(
                404, f"model {name!r} is not served here; GET /v1/models lists {self.model_id!r}", "model"
            )

    def encode(self, prompt) -> list[int]:
        try:
            return self.gen.encode(prompt)
        except SpecDecodeError as e:
            raise APIError(400, str(e), "prompt") from None

    @property
    def max_tokens(self) -> int:
        """The most new tokens any request may ask for (a one-token prompt)."""
        return self.max_model_len - self.gen.width - 2

    def budget(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """max_tokens, or the default within the room left: the prompt, max_tokens and one
        round's drafts must fit --max-model-len (the server's own bound on the capacity the
        engine checks with check_request)."""
        n, limit = len(prompt_ids), self.max_model_len
        room = limit - n - self.gen.width - 1
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {n} tokens; this server's context is {limit} (--max-model-len), with "
                "room for at least one new token",
                "prompt",
            )
        if max_tokens is None:
            return min(self.default_max_tokens, room)
        if max_tokens > room:
            raise APIError(
                400,
                f"max_tokens = {max_tokens} with a {n}-token prompt exceeds this server's context of "
                f"{limit} tokens (--max-model-len); ask for at most {room}",
                "max_tokens",
            )
        return max_tokens
