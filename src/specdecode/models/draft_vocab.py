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

Per row, the whole head where the list does not fit: a row whose last `fallback` tokens (prompt
and output) are a quarter or more outside the list (the special tokens and what the chat
template writes itself do not count) drafts that round with the model's whole head (the list's
head can never propose what the target is writing there: a language the list's corpus lacked).
The choice is a function of the row's own committed tokens, made before the round, so each draft
is still drawn from the q it reports and a row's drafts do not depend on its batch: exact either
way, and the same bits as the whole head's where a row falls back (the list's head is the whole
head's own rows).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from .base import ForwardMeta
from .linear import Linear
from .quant import QUANT_KINDS, linear_nbytes, part_kind, quantized_linear

VOCAB_DIR = Path(__file__).parent / "vocab"
# shipped frequency-ranked lists, usable by name (`--draft-vocab qwen2.5-coder`): built by
# `specdecode draft-vocab` from the 1.5B's greedy answers to 640 prompts of
# data/distill-prompts.jsonl (none of the benchmark sets). The zoo's Qwen2.5-Coder 0.5B drafts
# over it by default (models/zoo.py draft_vocab, opener.default_draft_vocab): with the fallback
# below, +10-12% on code and HumanEval on a Zen 5 EPYC (benchmarks/NOTES.md, issue 53; -5% to +4%
# on a Zen 4 before the kernel made verification cheap, issue 35)
SHIPPED = ("qwen2.5-coder",)
FULL = "full"  # draft_vocab value: the whole vocabulary (the default for other draft models)
FALLBACK = 64  # tokens of a row's context that decide its head (0: the list's head always)
# A quarter or more of them outside the list: the whole head. Outside the shipped list, measured
# (benchmarks/NOTES.md, issue 53): Python 3%, English prose 11%, German 32%, Chinese 71% of the
# tokens. On Spec-Bench's English the list's head lost 11% of tau and saved 27% of the draft's
# time a round, a net gain; prose the list cannot write falls back.
FALLBACK_SHARE = 4


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


class ListedLogits:
    """A step's logits over a draft vocabulary only: values [B, N] for the token ids `ids` [N]
    (ascending), every other token -inf. A greedy chain draws from it without building the
    [B, V] row (ReducedHeadModel.step): the argmax over the values is the full row's argmax (the
    first maximum in id order either way) and their softmax its softmax."""

    def __init__(self, values: torch.Tensor, ids: torch.Tensor, vocab: int) -> None:
        self.values, self.ids, self.vocab = values, ids, vocab

    def full(self) -> torch.Tensor:
        """The [B, V] logits forward() gives."""
        out = self.values.new_full((self.values.shape[0], self.vocab), float("-inf"))
        return out.index_copy_(1, self.ids, self.values)


def _template_ids(model) -> list[int]:
    """The special tokens and the ids of an empty chat turn as the model's template writes it."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return []
    found = [tok.token_id(v) for v in getattr(tok, "special", {}).values() if isinstance(v, str)]
    try:
        found += tok.encode_chat([{"role": "user", "content": ""}])
    except SpecDecodeError:  # no chat template
        pass
    return [i for i in found if i is not None]


class ReducedHeadModel:
    """A lean draft model seen through a head over `ids` only: forward() returns logits over
    the full vocabulary with -inf outside `ids`. Everything else is the model's own."""

    def __init__(self, model, ids: torch.Tensor, fallback: int = FALLBACK) -> None:
        if not model.lean:
            raise SpecDecodeError("a draft vocabulary needs our lean runtime for the draft model")
        if not isinstance(fallback, int) or isinstance(fallback, bool) or fallback < 0:
            raise SpecDecodeError(f"draft_vocab_fallback must be an integer >= 0, got {fallback!r}")
        ids = torch.unique(ids)  # ascending (ListedLogits' argmax is the full row's)
        self.inner, self.ids, self.fallback = model, ids, fallback
        # tokens that do not count against the list: its own, the special tokens and what the chat
        # template writes itself (role markers, a default system prompt): every chat prompt ends
        # in some, and they say nothing about the language of the answer
        self.listed = torch.zeros(model.vocab_size, dtype=torch.bool, device=ids.device)
        self.listed[ids] = True
        self.listed[[i for i in _template_ids(model) if 0 <= i < model.vocab_size]] = True
        self.whole_rows: torch.Tensor | None = None  # [B] bool: rows on the whole head this round
        kind = model.quant if model.quant in QUANT_KINDS else ("int8" if model.quant else None)
        head = getattr(model, "_head", None)
        if hasattr(head, "rows"):  # kq: the head's own blocks for these ids, as they are
            self._head = head.rows(ids)
            return
        rows = model.lm_head.index_select(0, ids)
        # the head in the draft's own format (a GGUF-quantized draft's: int8)
        kind = part_kind(kind, "head")
        self._head = Linear(rows.clone()) if kind is None else quantized_linear([rows.float()], None, kind)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def draft_vocab_size(self) -> int:
        return len(self.ids)

    def quantize(self, kind: str):
        self.inner.quantize(kind)
        head = part_kind(kind, "head")
        self._head = quantized_linear([self.inner.lm_head.index_select(0, self.ids).float()], None, head)
        return self

    def choose_heads(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """Per row of tokens [B, L] (lengths [B] of them its own): True where a quarter or more of
        the row's last `fallback` tokens are outside the list (that row drafts with the whole head
        until this is asked again); None with fallback 0."""
        if not self.fallback:
            self.whole_rows = None
            return None
        back = torch.arange(1, self.fallback + 1, device=tokens.device)
        at = lengths.to(tokens.device).view(-1, 1) - back  # the last `fallback` positions
        seen = tokens.gather(1, at.clamp(min=0))
        outside = ~self.listed[seen] & (at >= 0)
        self.whole_rows = outside.sum(1) >= -(-self.fallback // FALLBACK_SHARE)
        return self.whole_rows

    def weight_bytes(self) -> int:
        full = linear_nbytes(self.inner._head)
        return self.inner.weight_bytes() - full + linear_nbytes(self._head)

    def step(self, tokens: torch.Tensor, cache) -> torch.Tensor | ListedLogits:
        """One token a row [B, 1] appended: its next-token logits, as ListedLogits when every row
        drafts on the list's head this round (no [B, V] row built), else forward()'s [B, V]."""
        whole = self.whole_rows
        if whole is not None and bool(whole.any()):
            return self.forward(tokens, cache)[0][:, -1]
        _, hidden = self.inner.forward(tokens, cache, ForwardMeta(return_hidden=True, need_logits=False))
        h = hidden[:, -1]
        values = self._head(h, invariant=getattr(cache, "invariant", False))
        return ListedLogits(values, self.ids, self.inner.vocab_size)

    def forward(self, tokens: torch.Tensor, cache, meta: ForwardMeta | None = None):
        meta = meta or ForwardMeta()
        if not meta.need_logits or meta.aux_layers:
            return self.inner.forward(tokens, cache, meta)
        _, hidden = self.inner.forward(tokens, cache, replace(meta, return_hidden=True, need_logits=False))
        B, T = tokens.shape
        h = hidden
        if meta.logits_at is not None and T > 1:
            h = hidden[torch.arange(B, device=hidden.device), meta.logits_at].unsqueeze(1)
        inv = getattr(cache, "invariant", False)
        whole = self.whole_rows
        if whole is not None and whole.shape[0] != B:
            raise SpecDecodeError(f"choose_heads saw {whole.shape[0]} rows, the forward has {B}")
        V, n, width = self.inner.vocab_size, h.shape[1], h.shape[-1]
        listed = None if whole is None else ~whole
        small = whole_logits = None
        if listed is None or bool(listed.any()):
            small = self._head((h if listed is None else h[listed]).reshape(-1, width), invariant=inv)
        if whole is not None and bool(whole.any()):  # the model's own head: the same bits as without a list
            whole_logits = self.inner._head(h[whole].reshape(-1, width), invariant=inv)
        dtype = (small if small is not None else whole_logits).dtype
        logits = h.new_full((B, n, V), float("-inf"), dtype=dtype)
        if small is not None:
            part = small.new_full((small.shape[0], V), float("-inf")).index_copy_(1, self.ids, small)
            if listed is None:
                logits = part.view(B, n, V)
            else:
                logits[listed] = part.view(-1, n, V).to(dtype)
        if whole_logits is not None:
            logits[whole] = whole_logits.view(-1, n, V).to(dtype)
        return logits, (hidden if meta.return_hidden else None)
