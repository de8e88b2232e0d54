"""A draft model whose LM head covers only the N most frequent tokens (FR-Spec's frequency-
ranked draft vocabulary): for a 151,936-token vocabulary the head is a quarter of a 0.5B
draft's bytes, and a draft rarely proposes a rare token anyway.

The draft's probabilities are its softmax over the N tokens (every other token has probability
0), which the exact rules accept like any other q: the output is still the target's. What it
costs is acceptance where the target's token is outside the N.

Frequency: either a JSON list of token ids in frequency order (from any corpus; its first N
are kept), or, by default, the token ids themselves: a byte-level BPE vocabulary (Qwen2,
Llama 3, SmolLM2) numbers its tokens in merge order, and a merge made early is a frequent pair
in the tokenizer's training corpus, so the N lowest ids approximate the N most frequent tokens
without any data. The model's special tokens (EOS, end of turn) are always kept.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from .base import ForwardMeta
from .linear import Linear
from .quant import QUANT_KINDS, linear_nbytes, quantized_linear

VOCAB_DIR = Path(__file__).parent / "vocab"
# shipped frequency-ranked lists, usable by name (`--draft-vocab qwen2.5-coder`): built by
# `specdecode draft-vocab` from the 1.5B's greedy answers to 640 prompts of
# data/distill-prompts.jsonl (none of the benchmark sets). Not a default: on the machines
# measured it changed the pair's speed by -5% to +4% (benchmarks/NOTES.md, issue 35)
SHIPPED = ("qwen2.5-coder",)
FULL = "full"  # draft_vocab value: the whole vocabulary (the default)


def vocab_path(value: str | Path) -> Path:
    """A draft_vocab file: a shipped list's name or a path."""
    if str(value) in SHIPPED:
        return VOCAB_DIR / f"{value}.json"
    return Path(value)


def vocab_size(value: int | str | Path, vocab: int) -> int:
    """How many tokens a draft_vocab value keeps (a file: its ids; EOS ids aside)."""
    if isinstance(value, int):
        return min(value, vocab)
    return len(_read_ids(vocab_path(value)))


def _read_ids(path: Path) -> list[int]:
    try:
        return [int(i) for i in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError) as e:
        raise SpecDecodeError(
            f"draft vocabulary {path}: not a JSON list of token ids ({e}); "
            f"shipped lists: {', '.join(SHIPPED)}"
        ) from None


def frequent_ids(model, size: int | str | Path) -> torch.Tensor:
    """Sorted token ids of the draft vocabulary: the first `size` of a JSON file's ids, or the
    `size` lowest ids; plus the model's EOS / end-of-turn ids."""
    V = model.vocab_size
    if isinstance(size, (str, Path)):
        ids = _read_ids(vocab_path(size))
    else:
        if not isinstance(size, int) or size < 2:
            raise SpecDecodeError(f"draft_vocab must be an integer >= 2 or a JSON file, got {size!r}")
        ids = list(range(min(size, V)))
    keep = set(ids) | set(getattr(model, "eos_token_ids", ()))
    bad = [i for i in keep if not 0 <= i < V]
    if bad:
        raise SpecDecodeError(f"draft vocabulary: token id {bad[0]} is outside the model's {V} tokens")
    return torch.tensor(sorted(keep), dtype=torch.long, device=model.device)


class ReducedHeadModel:
    """A lean draft model seen through a head over `ids` only: forward() returns logits over
    the full vocabulary with -inf outside `ids`. Everything else is the model's own."""

    def __init__(self, model, ids: torch.Tensor) -> None:
        if not model.lean:
            raise SpecDecodeError("a draft vocabulary needs our lean runtime for the draft model")
        self.inner, self.ids = model, ids
        kind = model.quant if model.quant in QUANT_KINDS else ("int8" if model.quant else None)
        head = getattr(model, "_head", None)
        if hasattr(head, "rows"):  # kq: the head's own blocks for these ids, as they are
            self._head = head.rows(ids)
            return
        rows = model.lm_head.index_select(0, ids)
        # the head in the draft's own format (a GGUF-quantized draft's: int8)
        self._head = Linear(rows.clone()) if kind is None else quantized_linear([rows.float()], None, kind)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def draft_vocab_size(self) -> int:
        return len(self.ids)

    def quantize(self, kind: str):
        self.inner.quantize(kind)
        self._head = quantized_linear([self.inner.lm_head.index_select(0, self.ids).float()], None, kind)
        return self

    def weight_bytes(self) -> int:
        full = linear_nbytes(self.inner._head)
        return self.inner.weight_bytes() - full + linear_nbytes(self._head)

    def forward(self, tokens: torch.Tensor, cache, meta: ForwardMeta | None = None):
        meta = meta or ForwardMeta()
        if not meta.need_logits or meta.aux_layers:
            return self.inner.forward(tokens, cache, meta)
        _, hidden = self.inner.forward(tokens, cache, replace(meta, return_hidden=True, need_logits=False))
        B, T = tokens.shape
        h = hidden
        if meta.logits_at is not None and T > 1:
            h = hidden[torch.arange(B, device=hidden.device), meta.logits_at].unsqueeze(1)
        small = self._head(h.reshape(-1, h.shape[-1]), invariant=getattr(cache, "invariant", False))
        full = small.new_full((small.shape[0], self.inner.vocab_size), float("-inf"))
        full.index_copy_(1, self.ids, small)
        return full.view(B, h.shape[1], -1), (hidden if meta.return_hidden else None)
