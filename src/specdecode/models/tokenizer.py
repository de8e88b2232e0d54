"""Text <-> token ids, from a model directory's tokenizer files.

tokenizer.json is read with the `tokenizers` library directly (no transformers import on
the hot path); directories with only slow-tokenizer files fall back to AutoTokenizer.
"""

from __future__ import annotations

from pathlib import Path


class TextTokenizer:
    def __init__(self, encode_fn, decode_fn, vocab_size: int) -> None:
        self._encode = encode_fn
        self._decode = decode_fn
        self.vocab_size = vocab_size

    @staticmethod
    def from_dir(path: Path) -> TextTokenizer | None:
        """The tokenizer stored in a model directory, or None when it has none."""
        tj = path / "tokenizer.json"
        if tj.exists():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tj))
            return TextTokenizer(
                lambda text: tok.encode(text).ids,
                lambda ids: tok.decode(ids, skip_special_tokens=True),
                tok.get_vocab_size(),
            )
        if any((path / f).exists() for f in ("vocab.json", "tokenizer.model", "tokenizer_config.json")):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            return TextTokenizer(
                lambda text: tok.encode(text),
                lambda ids: tok.decode(ids, skip_special_tokens=True),
                len(tok),
            )
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(list(ids))
