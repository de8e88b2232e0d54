"""Sampling parameters and the one function that turns logits into a sampling distribution.

The same warp is applied to the target's and the drafter's logits; the target's warped
distribution is the one the output must follow. Temperature 0 means greedy: the
distribution is one-hot on the argmax (first index on ties), so the general acceptance
rule and the greedy rule agree.

Two sampling rules keep that distribution exactly (`SamplingParams.sampling_rule`):

- "standard": each row draws from its own generator, in the order its rounds need numbers
  (rejection sampling, Leviathan et al.); a seed fixes the text of one configuration, but
  another drafter, k or batch draws other numbers and gives another (equally exact) sample.
- "invariant": drafter-invariant speculative sampling (Daliri, Musco, Suresh 2024). The token at
  absolute position t is y_t = argmax_x p_t(x) / E_t(x), E_t(x) ~ Exp(1) i.i.d. (an exponential
  race: an exact sample from p_t), with E_t a function of (row seed, t) only, read from a
  counter-based generator (`position_noise`). The drafter guesses with the same noise,
  argmax_x q_t(x) / E_t(x), and a guess is kept while it equals y_t; so the text depends on the
  seed and the target alone, and the drafter only changes how many tokens a round keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property

import numpy as np
import torch

from ..errors import SpecDecodeError

SAMPLING_RULES = ("standard", "invariant")
# what a caller may ask for: a rule, or "auto" (invariant when seeded, else standard), resolved
# by SamplingParams itself, the one place
RULE_CHOICES = ("auto", *SAMPLING_RULES)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one sequence. top_k=0, top_p=1 and min_p=0 switch a filter off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # None: no logprobs; n >= 0: each emitted token's log-probability under the target's own
    # (unwarped) distribution, plus the n most likely alternatives
    logprobs: int | None = None
    # "standard" (rejection sampling from the row's generator) or "invariant" (noise keyed by
    # (seed, position): the same text for any drafter, k, tree or batch); see the module doc.
    # "auto" is resolved here: invariant for a seeded row (its seed then fixes the text whatever
    # runs beside it), standard otherwise
    sampling_rule: str = "standard"

    def __post_init__(self) -> None:
        if self.sampling_rule == "auto":
            object.__setattr__(self, "sampling_rule", "standard" if self.seed is None else "invariant")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise SpecDecodeError naming the first bad field and its allowed range."""
        if not self.temperature >= 0:
            raise SpecDecodeError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 <= self.top_k < 2**31:
            raise SpecDecodeError(f"top-k must be >= 0 (0 = off) and below 2**31, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecDecodeError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise SpecDecodeError(f"min-p must be in [0, 1), got {self.min_p}")
        if self.max_new_tokens < 1:
            raise SpecDecodeError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if any(s == "" for s in self.stop):
            raise SpecDecodeError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SpecDecodeError(f"logprobs must be in [0, 20] alternatives, got {self.logprobs}")
        if self.sampling_rule not in SAMPLING_RULES:
            raise SpecDecodeError(
                f"sampling rule must be one of {', '.join(RULE_CHOICES)}, got {self.sampling_rule!r}"
            )

    @property
    def keyed(self) -> bool:
        """It samples with noise keyed by (seed, position): the invariant rule at temperature > 0
        (a greedy row is the same under both rules)."""
        return self.sampling_rule == "invariant" and self.temperature > 0

    @property
    def drafts_decide(self) -> bool:
        """Seeded and sampled by the standard rule: its draft lengths and draft probabilities
        decide which uniforms it draws, so its text depends on them (nothing that depends on the
        load may change them: the load-aware cap, a deferred draft prefill)."""
        return self.seed is not None and self.temperature > 0 and not self.keyed


@dataclass(frozen=True)
class Warp:
    """Per-row sampling parameters as tensors, so one call warps a whole ragged batch."""

    temperature: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    keyed: torch.Tensor  # [B] bool: samples by the invariant rule (SamplingParams.keyed)

    @staticmethod
    def from_params(params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> Warp:
        return Warp(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float64, device=device),
            keyed=torch.tensor([p.keyed for p in params], dtype=torch.bool, device=device),
        )

    @staticmethod
    def greedy(batch_size: int, device: torch.device | str = "cpu") -> Warp:
        return Warp.from_params([SamplingParams(temperature=0)] * batch_size, device)

    @cached_property
    def all_greedy(self) -> bool:  # asked every round: computed once per batch composition
        return bool((self.temperature == 0).all())

    @cached_property
    def sampled(self) -> list[bool]:
        """Per row: it samples (temperature > 0), so it draws random numbers."""
        return (self.temperature > 0).tolist()

    @cached_property
    def invariant(self) -> list[bool]:
        """Per row: it samples by the invariant rule (noise keyed by seed and position)."""
        return self.keyed.tolist()

    @cached_property
    def streamed(self) -> list[bool]:
        """Per row: it samples by the standard rule (numbers drawn from its generator's stream)."""
        return [s and not k for s, k in zip(self.sampled, self.invariant)]

    @cached_property
    def any_invariant(self) -> bool:
        return any(self.invariant)

    def select(self, rows: torch.Tensor) -> Warp:
        return Warp(*(getattr(self, f.name)[rows] for f in fields(Warp)))

    def extend(self, other: Warp) -> Warp:
        """These rows, then other's (admission)."""
        return Warp(*(torch.cat([getattr(self, f.name), getattr(other, f.name)]) for f in fields(Warp)))


def logits_to_probs(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    """Warp logits [B, T, V] into probabilities [B, T, V]: temperature, top-k, top-p, min-p.

    Rows with temperature 0 get a one-hot distribution on the argmax. Filters are applied in
    that order (as transformers does); each keeps at least the most likely token.
    """
    # compute in at least fp32; float64 models stay float64
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    B, _, V = logits.shape
    temp = warp.temperature.to(dtype).view(B, 1, 1)
    greedy = temp == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)
    probs = torch.softmax(scaled, dim=-1)

    if bool((warp.top_k > 0).any()) or bool((warp.top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=logits.device).view(1, 1, V)
        k = torch.where(warp.top_k > 0, warp.top_k, torch.full_like(warp.top_k, V)).view(B, 1, 1)
        # top-p: keep the smallest prefix whose mass reaches top_p (mass before a token < top_p)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = (rank >= k) | (mass_before >= warp.top_p.to(dtype).view(B, 1, 1))
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool((warp.min_p > 0).any()):
        top = probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < warp.min_p.to(dtype).view(B, 1, 1) * top, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)

    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def sample(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per distribution: argmax(probs / E) with E ~ Exp(1) is an exact sample.

    probs [..., V], exp_noise [..., V] -> tokens [...]. No host sync.
    """
    return (probs / exp_noise).argmax(-1)


_MASK64 = 2**64 - 1


def position_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """[vocab] float64 Exp(1) noise of absolute position `position` under `seed`: Philox4x64
    (numpy's counter-based generator) keyed by the pair (seed mod 2**64, position), so the same
    pair gives the same noise whoever asks and whenever, and two different pairs independent
    streams. The invariant rule's E_t."""
    key = (seed & _MASK64) | (position << 64)
    return torch.from_numpy(np.random.Generator(np.random.Philox(key=key)).standard_exponential(vocab))


class RowRandom:
    """Each row's randomness. A seeded row under the standard rule has one torch.Generator,
    seeded from its SamplingParams.seed; every draw it makes comes from that generator, and a row
    draws only what its own round needs, so a seeded row gives the same samples alone or in any
    batch (of the same drafter and k). Unseeded rows share torch's default generator and draw
    together, one tensor per call for all of them (as vLLM does): independent uniforms and noise
    per row, fresh each process, reproducible under torch.manual_seed, and no Python loop over
    thousands of rows. A row under the invariant rule (`keyed[b]`) has a key instead, its seed
    (or one drawn once, now, when it has none), and reads the noise of each position it samples
    from position_noise: nothing depends on how many numbers anyone drew before."""

    def __init__(
        self,
        seeds: Sequence[int | None],
        device: torch.device | str = "cpu",
        keyed: Sequence[bool] | None = None,
    ) -> None:
        self.device = torch.device(device)
        keyed = [False] * len(seeds) if keyed is None else list(keyed)
        # a generator per seeded row (None: the row draws with the others from torch's default)
        self.generators: list[torch.Generator | None] = [
            self._generator(s) if s is not None or k else None for s, k in zip(seeds, keyed)
        ]
        self.keys: list[int | None] = [
            (g.initial_seed() if s is None else s) if k else None
            for g, s, k in zip(self.generators, seeds, keyed)
        ]
        # per keyed row, the noise of the positions this round reads (drafter, then verifier)
        self._cache: list[dict[int, torch.Tensor]] = [{} for _ in seeds]

    def _generator(self, seed: int | None) -> torch.Generator:
        g = torch.Generator(device=self.device)
        if seed is None:
            g.seed()
        else:
            g.manual_seed(seed)
        return g

    def _shared(self, rows: Sequence[int]) -> torch.Tensor:
        """The indices of these rows that draw from torch's default generator."""
        return torch.tensor([b for b in rows if self.generators[b] is None], dtype=torch.long)

    def uniforms(self, counts: Sequence[int], width: int) -> torch.Tensor:
        """[B, width] float64: row b's first counts[b] entries are U[0, 1) from its generator
        (unseeded rows: one draw for all of them), the rest 0 (never used: they lie past the row's
        drafts)."""
        out = torch.zeros(len(self.generators), width, dtype=torch.float64, device=self.device)
        for b, (g, n) in enumerate(zip(self.generators, counts)):
            if n and g is not None:
                out[b, :n] = torch.rand(n, dtype=torch.float64, device=self.device, generator=g)
        shared = self._shared([b for b, n in enumerate(counts) if n])
        if len(shared):
            draws = torch.rand(len(shared), width, dtype=torch.float64, device=self.device)
            n = torch.as_tensor(counts, device=self.device)[shared]
            keep = torch.arange(width, device=self.device).view(1, width) < n.view(-1, 1)
            out[shared.to(self.device)] = draws * keep
        return out

    def exp_noise(
        self, vocab: int, draw: Sequence[bool] | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, V] float64 Exp(1) noise for sampling argmax(probs / noise). Rows with draw[b] False
        get ones (their argmax is the most likely token) and leave their generator alone; a keyed
        row reads the noise of its position positions[b] ([B] long), a seeded row draws from its
        generator, the unseeded rows draw one [n, V] tensor together."""
        gens = self.generators
        if len(gens) == 1 and (draw is None or draw[0]) and self.keys[0] is None:
            return torch.empty(1, vocab, dtype=torch.float64, device=self.device).exponential_(
                generator=gens[0]
            )
        out = torch.ones(len(gens), vocab, dtype=torch.float64, device=self.device)
        for b, g in enumerate(gens):
            if (draw is None or draw[b]) and g is not None:
                if self.keys[b] is None:
                    out[b].exponential_(generator=g)
                else:
                    if positions is None:
                        raise ValueError("a keyed row's noise needs its position")
                    out[b] = self._keyed(b, int(positions[b]), vocab)
        shared = self._shared([b for b in range(len(gens)) if draw is None or draw[b]])
        if len(shared):
            noise = torch.empty(len(shared), vocab, dtype=torch.float64, device=self.device).exponential_()
            out[shared.to(self.device)] = noise
        return out

    def keyed_noise(self, vocab: int, positions: torch.Tensor, rows: Sequence[bool]) -> torch.Tensor:
        """[B, W, V] float64: for each keyed row b with rows[b], the noise of positions[b, j]
        ([B, W] long); ones elsewhere."""
        B, W = positions.shape
        out = torch.ones(B, W, vocab, dtype=torch.float64, device=self.device)
        pos = positions.tolist()
        for b in range(B):
            if rows[b] and self.keys[b] is not None:
                for j in range(W):
                    out[b, j] = self._keyed(b, pos[b][j], vocab)
        return out

    def _keyed(self, b: int, position: int, vocab: int) -> torch.Tensor:
        """Row b's noise at a position, drawn once: the drafter reads a round's positions, then
        the verifier the same ones and one more (forget_before drops the committed ones)."""
        cache = self._cache[b]
        noise = cache.get(position)
        if noise is None or noise.shape[0] != vocab:
            noise = cache[position] = position_noise(self.keys[b], position, vocab).to(self.device)
        return noise

    def forget_before(self, lengths: torch.Tensor) -> None:
        """Row b's tokens before lengths[b] are final: their noise is never read again."""
        for cache, n in zip(self._cache, lengths.tolist()):
            for old in [p for p in cache if p < n]:
                del cache[old]

    def select(self, rows: Sequence[int]) -> None:
        self.generators = [self.generators[i] for i in rows]
        self.keys = [self.keys[i] for i in rows]
        self._cache = [self._cache[i] for i in rows]

    def extend(self, other: RowRandom) -> None:
        self.generators += other.generators
        self.keys += other.keys
        self._cache += other._cache
