"""One object for how a generator speculates: method, draft length, policy, tree, options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SpecDecodeError
from ..formats import DRAFT_FORMATS
from .tree import TREE_SAMPLING, TokenTree

POLICIES = ("fixed", "heuristic", "confidence", "prefix", "optimal")
# the confidence policy's threshold on each draft token's probability when none is given
# (transformers' assistant_confidence_threshold), and the prefix policy's where no measured costs
# give one (opener.py: prefix_threshold)
DEFAULT_CONFIDENCE = 0.4
# a drafter's own weights: float as loaded, or quantized at build (models/quant.py; formats.py)
DRAFT_DTYPES = DRAFT_FORMATS


def adaptive_max_k(k: int, max_k: int | None) -> int:
    """The longest draft the heuristic, prefix and optimal policies may choose (default max(2k, 8))."""
    return max_k or max(2 * k, 8)


@dataclass(frozen=True)
class SpecConfig:
    """method: a registered drafter (`specdecode.drafters.DRAFTERS`) or None for target-only
    decoding; k: draft tokens per round (the start for adaptive policies); policy: fixed,
    heuristic, confidence, prefix or optimal; tree: a TokenTree or its spec ('3,2,1' or JSON choices),
    verified in one forward (fixed policy only); tree_sampling: how its candidates are chosen,
    topk (the drafter's top-ranked tokens), with-replacement or without-replacement (drawn from
    the drafter's distribution; exact multi-candidate rules, see specdecode.tree). Method
    options: exit_layer (early-exit), ngram_max / ngram_min (ngram), heads (medusa / eagle /
    eagle3 / auto: a directory or loaded heads), suffix_max (suffix / auto: the longest draft a
    suffix match may make, default 16).
    Policy options: confidence_threshold (confidence: a draft token's probability, default 0.4;
    prefix: the product of a round's, default from the measured costs where open_models has
    them, else 0.4), max_k (heuristic / prefix / optimal), cost_model (optimal: a
    CostModel or a JSON file; default: measured once per generator on its first batch).
    batch_invariant: run the target's batch-invariant forward, so that a token's logits do not
    depend on how many drafts or rows share a forward (greedy speculative output then equals
    target-only token for token in bf16 too; our lean runtime only; off by default: it costs
    about 14% of tokens/s in bf16 on this CPU, see docs/batch-invariance.md).
    rollback: for hybrid targets (linear-attention layers), how a rejected draft's state is
    undone: snapshot (default: the state after every verified position) or recompute (the
    positions' inputs, replayed from the state before the round; models/linear_attention.py).
    load_costs: a LoadCosts (or its JSON file): wrap the policy in LoadAwarePolicy, which caps
    the draft length by the running batch size's measured round costs (the server's default).
    draft_dtype: how the drafter's own weights run (draft model, EAGLE / EAGLE-3 layer, Medusa
    heads): int8, int4 or int4-g128 quantizes them at build (in place: a draft model passed in
    is quantized itself); fp32 / bf16 / fp16 only checks that they were loaded so. A draft's
    precision never changes the output, only its cost and its acceptance.
    draft_vocab (draft model, auto with one): its LM head over only the N most frequent tokens
    (FR-Spec): an int N (the N lowest token ids: a byte-level BPE numbers tokens in merge order,
    roughly by frequency) or a JSON file of ids in frequency order; EOS tokens always kept;
    a shipped list's name (models/draft_vocab.py: SHIPPED, e.g. "qwen2.5-coder"); "full" or None:
    the whole vocabulary.
    draft_vocab_fallback (with draft_vocab): a row drafts with the whole head in a round where a
    quarter or more of its last N tokens (prompt and output) are outside the list (text in a
    language the list's corpus lacked); None: N = 64; 0: the list's head always. Decided from the
    row's own tokens, so exact either way.
    suffix_cache (suffix, auto): a drafters.suffix.SuffixCache of earlier requests to draft from,
    shared on purpose between the generators given it; None (default): the generator's drafter
    keeps its own, empty at the start (SpeculativeGenerator.forget() empties it)."""

    method: str | None = None
    k: int = 4
    policy: str = "fixed"
    tree: TokenTree | str | None = None
    tree_sampling: str | None = None
    rollback: str | None = None
    exit_layer: int | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    heads: str | Path | Any | None = None
    confidence_threshold: float | None = None
    max_k: int | None = None
    cost_model: Any = None
    batch_invariant: bool | None = None
    suffix_max: int = 16
    load_costs: Any = None
    draft_dtype: str | None = None
    draft_vocab: int | str | Path | None = None
    draft_vocab_fallback: int | None = None
    suffix_cache: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.tree, str):
            object.__setattr__(self, "tree", TokenTree.parse(self.tree))
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise SpecDecodeError(f"k must be an integer >= 1, got {self.k!r}")
        if self.policy not in POLICIES:
            raise SpecDecodeError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.confidence_threshold is not None and not 0 < self.confidence_threshold < 1:
            raise SpecDecodeError(f"confidence threshold must be in (0, 1), got {self.confidence_threshold}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpecDecodeError(
                f"n-gram sizes need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        if not isinstance(self.suffix_max, int) or self.suffix_max < 1:
            raise SpecDecodeError(f"suffix_max must be an integer >= 1, got {self.suffix_max!r}")
        if self.draft_dtype is not None:
            if self.draft_dtype not in DRAFT_DTYPES:
                raise SpecDecodeError(
                    f"draft_dtype {self.draft_dtype!r} is not one of {', '.join(DRAFT_DTYPES)}"
                )
            if self.method is None:
                raise SpecDecodeError("draft_dtype needs a drafting method; target-only decoding drafts none")
        if self.draft_vocab not in (None, "full"):  # "full": the whole vocabulary, said explicitly
            v = self.draft_vocab
            if self.method not in ("draft", "auto"):
                raise SpecDecodeError(
                    f"draft_vocab restricts a draft model's head: method draft or auto, not {self.method!r}"
                )
            if isinstance(v, bool) or (isinstance(v, int) and v < 2):
                raise SpecDecodeError(f"draft_vocab must be an integer >= 2 or a JSON file, got {v!r}")
        f = self.draft_vocab_fallback
        if f is not None and (not isinstance(f, int) or isinstance(f, bool) or f < 0):
            raise SpecDecodeError(f"draft_vocab_fallback must be an integer >= 0, got {f!r}")
        if self.max_k is not None and self.max_k < 1:
            raise SpecDecodeError(f"max_k must be >= 1, got {self.max_k}")
        if self.rollback is not None and self.rollback not in ("snapshot", "recompute"):
            raise SpecDecodeError(f"unknown rollback {self.rollback!r}; choose snapshot or recompute")
        if self.tree_sampling is not None:
            if self.tree_sampling not in TREE_SAMPLING:
                raise SpecDecodeError(
                    f"unknown tree sampling {self.tree_sampling!r}; choose one of {', '.join(TREE_SAMPLING)}"
                )
            if self.tree is None:
                raise SpecDecodeError("tree sampling needs a token tree; give --tree too (e.g. --tree 4,2,1)")
            object.__setattr__(self, "tree", self.tree.with_sampling(self.tree_sampling))
        if self.tree is not None:
            if self.policy != "fixed":
                raise SpecDecodeError("a token tree has a fixed shape; use --policy fixed with --tree")
            object.__setattr__(self, "k", self.tree.depth)

    @property
    def max_draft(self) -> int:
        """The most draft tokens one row can propose in a round (a tree: all its nodes)."""
        if self.method is None:
            return 0
        if self.tree is not None:
            return self.tree.size
        adaptive = self.policy in ("heuristic", "prefix", "optimal")
        k = adaptive_max_k(self.k, self.max_k) if adaptive else self.k
        if self.method in ("suffix", "auto"):  # a long suffix match drafts up to suffix_max
            return max(k, self.suffix_max)
        return k
