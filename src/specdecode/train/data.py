"""Corpus -> documents -> train / held-out split -> byte-level BPE tokenizer -> token streams."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SpecDecodeError

EOS = "<|endoftext|>"
HOLDOUT_EVERY = 20  # every 20th chunk is held out: 5% of the text
BLOCK_CHARS = 2000  # a single-file corpus is cut into blocks of about this many characters


@dataclass
class Corpus:
    train: list[str]
    valid: list[str]
    files: int
    chars: int
    source: str


def _blocks(text: str) -> list[str]:
    """Cut text at line ends into blocks of about BLOCK_CHARS characters."""
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= BLOCK_CHARS:
            out.append("".join(cur))
            cur, n = [], 0
    if cur:
        out.append("".join(cur))
    return out


def read_corpus(path: str | Path, file_glob: str = "*.txt") -> Corpus:
    """A file is cut into blocks; a directory gives one document per matching file (sorted,
    skipping site-packages and __pycache__). Every HOLDOUT_EVERY-th chunk is held out."""
    path = Path(path).expanduser()
    if path.is_file():
        chunks = _blocks(path.read_text(encoding="utf-8", errors="replace"))
        files = 1
        joiner_is_doc = False
    elif path.is_dir():
        paths = sorted(
            p
            for p in path.rglob(file_glob)
            if p.is_file() and not {"site-packages", "__pycache__"} & set(p.relative_to(path).parts)
        )
        chunks = []
        for p in paths:
            try:
                chunks.append(p.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
        files = len(chunks)
        joiner_is_doc = True
    else:
        raise SpecDecodeError(f"corpus {path} does not exist; pass a text file or a directory")
    chunks = [c for c in chunks if c.strip()]
    if len(chunks) < 2:
        raise SpecDecodeError(f"corpus {path} has too little text ({sum(map(len, chunks))} characters)")
    valid = [c for i, c in enumerate(chunks) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    train = [c for i, c in enumerate(chunks) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    if not valid:  # tiny corpora: hold out the last chunk
        valid, train = chunks[-1:], chunks[:-1]
    if not joiner_is_doc:  # blocks of one text are one document each side
        train, valid = ["".join(train)], ["".join(valid)]
    return Corpus(train, valid, files, sum(map(len, chunks)), str(path))


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (every byte is a token: nothing is unknown) with EOS as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, docs: list[str]) -> np.ndarray:
    """All documents as one uint16 token stream, each followed by EOS."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def batch_at(stream: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int) -> np.ndarray:
    """The batch of step `step`: random windows of seq_len + 1 tokens, a function of
    (seed, step) only, so runs are deterministic and resumable."""
    rng = np.random.default_rng([seed, step])
    hi = len(stream) - seq_len - 1
    if hi <= 0:
        raise SpecDecodeError(f"corpus too short: {len(stream)} tokens for --seq-len {seq_len}")
    starts = rng.integers(0, hi, size=batch_size)
    return np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Fixed, evenly spaced held-out windows (the same for every model and every eval)."""
    n = len(stream) - seq_len - 1
    if n <= 0:
        raise SpecDecodeError(f"held-out text too short: {len(stream)} tokens for --seq-len {seq_len}")
    count = min(max_windows, max(1, n // seq_len))
    starts = np.linspace(0, n, count).astype(np.int64)
    return np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)
