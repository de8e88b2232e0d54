"""Build a frequency-ranked draft vocabulary (FR-Spec) from a target's own answers.

A draft model's LM head over the whole 151,936-token Qwen2 vocabulary is 28% of the 0.5B's
weights, read at every draft step. Restricting it to the tokens the target actually emits cuts
that read; what it costs is acceptance at the positions where the target's token is not in the
list. The list is ranked by how often each token appears in the target's greedy answers to a
prompt set (plus any text files given, tokenized with the target's tokenizer), so it fits what
the drafter will be asked to guess.

The output is a JSON list of token ids, most frequent first (what `draft_vocab=FILE` reads:
models/draft_vocab.py keeps its first N). Build it from prompts that are not the ones you
benchmark on (the shipped list for the Qwen2.5-Coder pair comes from data/distill-prompts.jsonl
only; Spec-Bench and HumanEval stay held out).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import SpecDecodeError


def read_prompts(path: str | Path, limit: int | None = None) -> list:
    """The first `limit` prompts of a JSONL file (distill-data's format: {"prompt": text},
    {"messages": [...]}, ...)."""
    from .distill import read_prompts as read_all

    return read_all(path)[:limit]


def answer_counts(
    gen,
    prompts: list,
    *,
    chat: bool,
    max_new_tokens: int,
    batch_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> Counter:
    """Token counts of `gen`'s greedy answers to `prompts`, batch_size prompts at a time."""
    from ..core.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    counts: Counter = Counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        if chat:
            batch = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in batch]
        for result in gen.generate(batch, params):
            counts.update(result.token_ids)
        if progress is not None:
            progress(min(start + batch_size, len(prompts)), len(prompts))
    return counts


def text_counts(tokenizer, files: Iterable[Path]) -> Counter:
    """Token counts of text files, tokenized with the target's tokenizer."""
    counts: Counter = Counter()
    for f in files:
        try:
            text = Path(f).read_text(errors="replace")
        except OSError as e:
            raise SpecDecodeError(f"cannot read {f}: {e.strerror}") from None
        counts.update(tokenizer.encode(text))
    return counts


TEXT_WEIGHT = 0.25  # a text token's share counts a quarter of an answer token's share


def ranked(answers: Counter, texts: Counter | None = None, size: int | None = None) -> list[int]:
    """Token ids by frequency, most frequent first: each token's share of the answers' tokens plus
    TEXT_WEIGHT times its share of the texts' (answers rank first; texts order what the answers
    never showed); ties by id, so the order is reproducible."""
    texts = texts or Counter()
    a, t = max(sum(answers.values()), 1), max(sum(texts.values()), 1)
    score = {i: answers[i] / a + TEXT_WEIGHT * texts[i] / t for i in set(answers) | set(texts)}
    ids = sorted(score, key=lambda i: (-score[i], i))
    return ids if size is None else ids[:size]


def build(
    target: str,
    prompts: str | Path,
    out: str | Path,
    *,
    chat: bool = True,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    limit: int | None = None,
    texts: Iterable[Path] = (),
    size: int | None = None,
    dtype: str | None = None,
    log: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Answer `prompts` with `target` (greedy, target-only), count the answers' tokens (and the
    texts'), write the `size` most frequent ids (default: every one seen) to `out` in frequency
    order; return a summary with the list's coverage of the answers."""
    from ..opener import open as sd_open

    rows = read_prompts(prompts, limit)
    if not rows:
        raise SpecDecodeError(f"{prompts}: no prompts")
    # rows need not be batch-invariant here (only counts are kept): the fastest batched forward
    gen = sd_open(target, dtype=dtype, batch_invariant=False, log=log)
    t0 = time.perf_counter()
    counts = answer_counts(
        gen, rows, chat=chat, max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress
    )
    extra = text_counts(gen.target.tokenizer, texts)
    ids = ranked(counts, extra, size)
    Path(out).write_text(json.dumps(ids, separators=(",", ":")) + "\n")
    kept = set(ids)
    return {
        "prompts": len(rows),
        "answer_tokens": sum(counts.values()),
        "text_tokens": sum(extra.values()),
        "ids": len(ids),
        "answer_coverage": sum(n for i, n in counts.items() if i in kept) / max(sum(counts.values()), 1),
        "seconds": time.perf_counter() - t0,
    }
