"""Text <-> token ids, and chat messages -> text, from a model directory's tokenizer files.

tokenizer.json is read with the `tokenizers` library directly (no transformers import on
the hot path); directories with only slow-tokenizer files fall back to AutoTokenizer. The
chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja) is rendered
with jinja2 in a sandbox, with the variables and helpers Hugging Face templates expect.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..errors import SpecDecodeError

# end-of-turn markers of common chat formats (ChatML, Llama 3, Gemma, Phi-3): when the template
# writes one and the vocabulary has it, generation stops there
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
Messages = Sequence[dict]


def is_messages(prompt) -> bool:
    """A chat (a list of {"role", "content"} dicts) rather than text or token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)


class TextTokenizer:
    def __init__(
        self,
        encode_fn,
        decode_fn,
        vocab_size: int,
        token_to_id=None,
        chat_template: str | None = None,
        special: dict[str, str] | None = None,
    ) -> None:
        self._encode = encode_fn
        self._decode = decode_fn
        self.vocab_size = vocab_size
        self._token_to_id = token_to_id or (lambda _t: None)
        self.chat_template = chat_template
        self.special = special or {}  # bos_token, eos_token, ... as strings
        self._template = None

    @staticmethod
    def from_dir(path: Path) -> TextTokenizer | None:
        """The tokenizer stored in a model directory, or None when it has none."""
        config: dict = {}
        if (path / "tokenizer_config.json").exists():
            try:
                config = json.loads((path / "tokenizer_config.json").read_text())
            except json.JSONDecodeError as e:
                raise SpecDecodeError(f"{path}/tokenizer_config.json is not valid JSON ({e})") from None
        template = config.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        special = {k: _token_text(v) for k, v in config.items() if k.endswith("_token") and v is not None}
        tj = path / "tokenizer.json"
        if tj.exists():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tj))
            return TextTokenizer(
                lambda text, special=True: tok.encode(text, add_special_tokens=special).ids,
                lambda ids: tok.decode(ids, skip_special_tokens=True),
                tok.get_vocab_size(),
                tok.token_to_id,
                template,
                special,
            )
        if any((path / f).exists() for f in ("vocab.json", "tokenizer.model", "tokenizer_config.json")):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            return TextTokenizer(
                lambda text, special=True: tok.encode(text, add_special_tokens=special),
                lambda ids: tok.decode(ids, skip_special_tokens=True),
                len(tok),
                lambda t: tok.convert_tokens_to_ids(t) if t in tok.get_vocab() else None,
                template,
                special,
            )
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._encode(text, add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self._decode(list(ids))

    def token_id(self, token: str) -> int | None:
        return self._token_to_id(token)

    # -- chat -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered by the model's own chat template."""
        if not self.chat_template:
            raise SpecDecodeError(
                "this model's tokenizer has no chat template; pass plain text (drop --chat)"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise SpecDecodeError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if self._template is None:
            self._template = _compile(self.chat_template)
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special
            )
        except TemplateError as e:
            raise SpecDecodeError(f"the chat template rejected these messages: {e}") from None

    def encode_chat(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a rendered conversation. The template writes any BOS itself, so no special
        tokens are added (as transformers' apply_chat_template(tokenize=True) does)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn in this template (beyond the model's EOS)."""
        found = []
        markers = [t for t in END_OF_TURN if self.chat_template and t in self.chat_template]
        names = [self.special.get("eos_token"), *markers]
        for name in names:
            tid = self.token_id(name) if name else None
            if tid is not None and tid not in found:
                found.append(tid)
        return tuple(found)


class TemplateError(Exception):
    """raise_exception() called inside a chat template, or a jinja2 error."""


def _token_text(v) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    return v.get("content") if isinstance(v, dict) else v if isinstance(v, str) else None


def _compile(source: str):
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise SpecDecodeError("chat templates need jinja2: pip install jinja2") from None

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as e:
        raise SpecDecodeError(f"the model's chat template does not parse: {e}") from None

    class _Safe:
        def render(self, **kw):
            try:
                return template.render(**kw)
            except jinja2.TemplateError as e:
                raise TemplateError(str(e)) from None

    return _Safe()
