"""The drafter contract: a base class every drafting method implements, the narrow view of the
running batch a drafter sees, and the chain of draft tokens autoregressive drafters share.

A drafter object holds only what does not change during a generation (weights, settings).
Everything per batch (caches, features) lives in the state that start() returns; the engine
passes it back to every other call, so one drafter can serve any number of runs at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..core.draft_context import DraftContext
from ..core.proposal import Proposal
from ..core.sampling import logits_to_probs, sample
from ..errors import SpecDecodeError
from ..models.base import chunk_steps
from ..models.draft_vocab import ListedLogits

if TYPE_CHECKING:
    from ..core.config import SpecConfig
    from ..core.tree import TokenTree
    from ..models.base import Cache, CausalLM


@dataclass(frozen=True)
class TargetNeeds:
    """What a drafter needs back from each target forward: the hidden states of every committed
    token (passed to observe()), and which ones: the final-normed states (aux_layers None) or
    the residual streams entering these layers, concatenated (EAGLE-3)."""

    hidden: bool = False
    aux_layers: tuple[int, ...] | None = None


NOTHING = TargetNeeds()


def weights_dtype_of(model) -> str:
    """A lean model's weight format: its quantization, else its float dtype's short name."""
    if getattr(model, "quant", None):
        return model.quant
    names = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return names[model.dtype]


class Drafter:
    """Proposes draft tokens; never decides acceptance.

    Class attributes declare what a method needs: `requires_hidden` (the engine passes the
    target's final hidden states of every committed token to observe(); target_needs() says
    which states, for methods that need more), `supports_tree` (propose_tree is implemented),
    `lean_only` (it reads our runtime's internals: the target must be `lean`). `model` is a
    separate draft model, if the method has one (its position limit is checked by the engine).
    `advice` is a warning for the user when this drafter is unlikely to pay (the CLI prints it
    with the measured acceptance).
    """

    name: ClassVar[str] = ""
    requires_hidden: ClassVar[bool] = False
    supports_tree: ClassVar[bool] = False
    lean_only: ClassVar[bool] = False
    model: CausalLM | None = None
    advice: str | None = None

    def target_needs(self) -> TargetNeeds:
        """What the engine must return from each target forward for observe()."""
        return TargetNeeds(hidden=True) if self.requires_hidden else NOTHING

    @property
    def weights_dtype(self) -> str | None:
        """How this drafter's own weights are stored (fp32, bf16, fp16, int8, int4, int4-g128),
        None when it has none (n-gram, suffix) or shares the target's (early exit)."""
        return None

    def quantize(self, kind: str) -> None:
        """Run this drafter's own weights through `kind` (int8, int4, int4-g128) weight-only
        kernels, in place. A draft's precision never changes the output (the target verifies
        every token), only its cost and how often it is right."""
        raise SpecDecodeError(
            f"method {self.name!r} has no draft weights of its own; a draft dtype applies to "
            "draft, eagle, eagle3, medusa and auto with one of them"
        )

    @classmethod
    def create(cls, target: CausalLM, draft: CausalLM | None, config: SpecConfig) -> Drafter:
        """The drafter for `target` from the run's configuration (SpecDecodeError if it cannot be)."""
        raise NotImplementedError

    def start(self, ctx: DraftContext, target_cache: Cache) -> Any:
        """New rows are admitted (their target cache is being prefilled): return the per-batch
        state (caches, features) the other calls receive. The drafter's own prefill happens in
        prefill() and observe(), chunk by chunk, before the rows' first round."""
        return None

    def prefill(self, state: Any, ctx: DraftContext, lengths: torch.Tensor) -> None:
        """The target cache of row b now holds its first lengths[b] tokens: bring the drafter's
        own per-token state (a draft model's cache) that far. Default: nothing to do."""

    # prefix caching (prefix.py): a drafter with per-token state of its own (features, a draft
    # model's cache) keeps it in the cached blocks, and a prompt is reused only as far as its
    # blocks carry that state
    keeps_prefix: ClassVar[bool] = False
    # prefill() runs a forward of its own (a draft model): the engine may run it in steps of its
    # own between rounds, after the target's chunks (engine/prefill.py)
    prefills_own: ClassVar[bool] = False

    def defer(self, state: Any, rows: list[int]) -> None:
        """A drafter that prefills_own: these rows' prompts were not fed to it (the engine deferred
        its prefill: a server under a load where drafting does not pay); they draft nothing, and
        nothing is fed for them, until warm() has caught them up. Others: never called."""

    def prefilled_rows(self, state: Any) -> list[bool] | None:
        """A drafter that prefills_own: per row, whether its last proposal came from the model
        whose prefill that is (auto: False where a suffix match drafted instead); None: every
        row's did. What a server prices a draft model's prefill with is the acceptance of
        those drafts alone (serve/loop.py, the payback rule)."""
        return None

    def cold_lags(self, state: Any, ctx: DraftContext) -> list[int] | None:
        """Per row: how many committed tokens a deferred (cold) row still lacks, 0 for a row that
        drafts; None when no row is cold."""
        return None

    def warm(self, state: Any, ctx: DraftContext, rows: list[int], budget: int | None = None) -> int:
        """Feed these cold rows up to `budget` more of their committed tokens each (None: all);
        a row drafts again once it has them. Returns the tokens fed."""
        return 0

    def save_prefix(self, state: Any, row: int, start: int) -> Any:
        """A copy of row `row`'s own state for tokens start .. start + prefix.BLOCK - 1 (None if it
        has none yet)."""
        return None

    def load_prefix(self, state: Any, row: int, start: int, saved: Any) -> None:
        """Put state saved by save_prefix() back at row `row`, at tokens start onwards."""

    def propose(
        self, state: Any, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None = None
    ) -> Proposal:
        """Up to limits[b] draft tokens for row b ([B] long) and the draft probs they were drawn
        from. With stop_below, a row stops after a token whose draft probability is below it.
        A row draws random numbers (from ctx.rng) only for the tokens it drafts."""
        raise NotImplementedError

    def propose_tree(self, state: Any, ctx: DraftContext, tree: TokenTree) -> torch.Tensor | Proposal:
        """[B, N] the tree's candidate tokens (node i + 1 = tree.choices[i]), top-ranked; or, for
        a sampled tree, a Proposal whose probs [B, N + 1, V] are the drafter's q at the root and
        every node (TreeDraw does both)."""
        raise SpecDecodeError(f"method {self.name!r} does not draft token trees")

    def observe(self, state: Any, hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> None:
        """hidden [B, T, d]: the target's hidden states (target_needs()) of row b's tokens at
        positions start[b] .. start[b] + count[b] - 1 (called only when they are needed)."""

    def commit(self, state: Any, lengths: torch.Tensor) -> None:
        """The first lengths[b] tokens of row b are now final; forget anything after them."""

    def select_rows(self, state: Any, rows: torch.Tensor) -> None:
        """Keep only these rows (the others finished)."""

    def add_rows(self, state: Any, new: Any) -> None:
        """Append the rows of `new`, a state start() made for rows admitted between rounds."""

    def caches(self, state: Any) -> list[Cache]:
        """The KV caches of the drafter's own in `state` (a draft model's), so the engine can
        prepare their storage for an admission (Cache.reserve_for, tick); none by default."""
        return []

    def forget(self) -> None:
        """Forget what earlier requests taught this drafter (the suffix drafter's cache of their
        prompts and answers); drafters that learn nothing across requests have nothing to do."""

    def take_catch_up_seconds(self) -> float:
        """Seconds its proposals spent since the last call feeding tokens it had fallen behind on
        (a draft model after rounds in which nobody drafted), and reset: a one-off cost that a
        server's learned round costs leave out (serve/loop.py); none by default."""
        return 0.0


class PrefixThreshold(float):
    """A stop threshold (propose's stop_below) on the product of the probabilities the draft gave
    its tokens this round, by the draft's own reckoning the chance that the target accepts all of
    them (the prefix policy); a plain float bounds each token's own probability (confidence)."""


class DraftChain:
    """One round's chain of draft tokens: each drawn from the drafter's logits (warped and
    sampled, or argmax when the batch is greedy), its draft probs kept. Row b draws at most
    limits[b] tokens and stops early on low confidence (stop_below: after a token whose
    probability, or for a PrefixThreshold the product of the round's so far, is below it); a row
    that stopped draws no more random numbers. The shared part of every autoregressive drafter's
    propose(). Either stop reads the draft's probabilities only, so the output stays exact."""

    def __init__(self, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None) -> None:
        self.ctx, self.stop_below = ctx, stop_below
        self.greedy = ctx.warp.all_greedy
        self.limits = limits.tolist()
        self.active = [n > 0 for n in self.limits]
        self.prefix = [1.0] * ctx.size if isinstance(stop_below, PrefixThreshold) else None
        self.counts = [0] * ctx.size
        self.tokens: list[torch.Tensor] = []  # each [B]
        self.probs: list[torch.Tensor] = []  # each [B, V] (empty when greedy)

    @property
    def width(self) -> int:
        return max(self.limits, default=0)

    def draw(self, logits: torch.Tensor | ListedLogits) -> tuple[torch.Tensor, bool]:
        """Draw the next token [B] from logits [B, V] (or a draft vocabulary's ListedLogits);
        also True once every row has stopped."""
        step = len(self.tokens)
        listed = logits if isinstance(logits, ListedLogits) else None
        if listed is not None and not self.greedy:
            logits, listed = listed.full(), None
        if listed is not None:  # greedy over the list: its argmax and softmax are the full row's
            at = listed.values.argmax(-1, keepdim=True)
            tok = listed.ids[at.view(-1)]
        elif self.greedy:
            tok = logits.argmax(-1)
        else:
            q = logits_to_probs(logits.unsqueeze(1), self.ctx.warp).squeeze(1)  # [B, V]
            draw = [a and s for a, s in zip(self.active, self.ctx.warp.sampled)]
            # an invariant row guesses with the noise the verifier will use at this position
            tok = sample(q, self.ctx.rng.exp_noise(q.shape[-1], draw, self.ctx.lengths + step))
            self.probs.append(q)
        self.tokens.append(tok)
        conf = None
        if self.stop_below is not None and listed is not None:
            conf = torch.softmax(listed.values.float(), -1).gather(1, at).squeeze(1).tolist()
        elif self.stop_below is not None:
            conf = confidence(logits, self.probs or None, tok.view(-1, 1)).tolist()
        if conf is not None and self.prefix is not None:  # the product of the round's so far
            for b, active in enumerate(self.active):
                if active:
                    self.prefix[b] *= conf[b]
            conf = self.prefix
        for b, active in enumerate(self.active):
            if active:
                self.counts[b] = step + 1
                self.active[b] = step + 1 < self.limits[b] and (conf is None or conf[b] >= self.stop_below)
        return tok, not any(self.active)

    def proposal(self) -> Proposal:
        if not self.tokens:  # every row's limit was 0 (e.g. auto gave all its rows to suffix)
            return Proposal.empty(self.ctx.size, self.ctx.device)
        probs = None if self.greedy else torch.stack(self.probs, 1)
        lengths = torch.tensor(self.counts, dtype=torch.long, device=self.ctx.device)
        return Proposal(torch.stack(self.tokens, 1), probs, lengths)


class TreeDraw:
    """A token tree's candidates, chosen level by level, shared by every drafter's propose_tree.

    The children of each node are the drafter's top-ranked tokens after it (tree.sampling
    "topk", and always for greedy rows) or, for rows that sample, draws from the drafter's
    warped distribution q after that node: independent draws (with-replacement) or distinct ones
    by the exponential race, top `count` of q / Exp(1) (without-replacement). The q of every
    node whose children were drawn is kept: the verifier's multi-candidate rule needs it.
    Rows under the invariant rule always take the top `count` of q / E_t with the noise E_t the
    verifier reads at the children's position (Gumbel-max list sampling: the target's token is
    among them as often as the coupling allows), whatever tree.sampling says."""

    def __init__(self, ctx: DraftContext, tree: TokenTree) -> None:
        self.ctx, self.tree = ctx, tree
        greedy = ctx.warp.all_greedy or not tree.sampled
        self.rows = [False] * ctx.size if greedy else [bool(s) for s in ctx.warp.streamed]
        self.keyed = [False] * ctx.size if ctx.warp.all_greedy else ctx.warp.invariant
        self.sampled = any(self.rows) or any(self.keyed)
        self.nodes = torch.zeros(ctx.size, tree.size, dtype=torch.long, device=ctx.device)
        self.q: dict[int, torch.Tensor] = {}  # input index -> [B, V] q of its children
        self._parents, self._depths = tree.parents(), tree.depths().tolist()

    def level(self, d: int, logits_of) -> list[int]:
        """Choose the candidates at depth d; logits_of(i) gives the drafter's logits [B, V] after
        input i (0 = the root). Returns the input indices of depth d, in order."""
        idx = [i for i in range(1, self.tree.size + 1) if self._depths[i] == d]
        by_parent: dict[int, list[int]] = {}
        for i in idx:
            by_parent.setdefault(self._parents[i - 1], []).append(i)
        for parent, kids in by_parent.items():
            ranks = [self.tree.choices[i - 1][-1] for i in kids]
            picks = self._children(parent, logits_of(parent), max(ranks) + 1)
            for i, r in zip(kids, ranks):
                self.nodes[:, i - 1] = picks[:, r]
        return idx

    def _children(self, parent: int, logits: torch.Tensor, count: int) -> torch.Tensor:
        top = logits.topk(count, -1).indices  # [B, count]
        if not self.sampled:
            return top
        q = logits_to_probs(logits.unsqueeze(1), self.ctx.warp).squeeze(1)  # [B, V]
        self.q[parent] = q
        V, rng = q.shape[-1], self.ctx.rng
        if any(self.rows):
            if self.tree.sampling == "without-replacement":
                picks = (q.double() / rng.exp_noise(V, self.rows)).topk(count, -1).indices
            else:
                picks = torch.stack([sample(q, rng.exp_noise(V, self.rows)) for _ in range(count)], 1)
            top = torch.where(torch.tensor(self.rows, device=logits.device).view(-1, 1), picks, top)
        if any(self.keyed):  # the children's tokens sit at position lengths + depth(parent)
            at = self.ctx.lengths + self._depths[parent]
            picks = (q.double() / rng.exp_noise(V, self.keyed, at)).topk(count, -1).indices
            top = torch.where(torch.tensor(self.keyed, device=logits.device).view(-1, 1), picks, top)
        return top

    def proposal(self) -> Proposal | torch.Tensor:
        """The candidates [B, N] (top-ranked) or a Proposal with q at root and every node."""
        if not self.sampled:
            return self.nodes
        first = next(iter(self.q.values()))
        probs = first.new_zeros(self.ctx.size, self.tree.size + 1, first.shape[-1])
        for i, q in self.q.items():
            probs[:, i] = q
        return Proposal(self.nodes, probs, tree=self.tree)


def require_lean(target: CausalLM, method: str) -> None:
    """The one-line error of a method that reads our runtime's internals, on another runtime."""
    if not target.lean:
        raise SpecDecodeError(
            f"method {method} needs a Llama-family target on our lean runtime (--backend lean)"
        )


def confidence(logits: torch.Tensor, probs: list[torch.Tensor] | None, tokens: torch.Tensor) -> torch.Tensor:
    """[B] the draft's probability of its chosen tokens [B, 1]: from the warped probs when it
    sampled, from the plain softmax when it decoded greedily."""
    p = probs[-1] if probs is not None else torch.softmax(logits.float(), -1)
    return p.gather(1, tokens).squeeze(1)


def pad_positions(t: torch.Tensor, capacity: int, dim: int = 1) -> torch.Tensor:
    """Zero-pad a per-position tensor along `dim` to `capacity` entries (admission)."""
    extra = capacity - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim)


def catch_up(cache, todo: torch.Tensor, feed) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed each row's todo[b] pending pairs through a drafter layer whose cache is `cache`, in
    the chunks extend() uses (models.base.chunk_steps): feed(j) runs the layer on pair indices
    j [B, M] (row b's first fed ones real, the rest padding, written after its length and
    dropped by the rewind) and returns logits and hidden states [B, M, ...]. Returns the logits
    and hidden state after each row's last fed pair (meaningless for rows that fed nothing)."""
    B, dev = todo.shape[0], todo.device
    rows = torch.arange(B, device=dev)
    out_logits = out_hidden = None
    for done, fed, M in chunk_steps(cache, todo, at_least_once=True):
        logits, hidden = feed(done.view(B, 1) + torch.arange(M, device=dev).view(1, M))
        cache.rewind(done + fed)
        last = (fed - 1).clamp(min=0)
        lg, hd = logits[rows, last], hidden[rows, last]
        if out_logits is None:
            out_logits, out_hidden = lg, hd
        else:
            got = (fed > 0).view(B, 1)
            out_logits, out_hidden = torch.where(got, lg, out_logits), torch.where(got, hd, out_hidden)
    return out_logits, out_hidden
