"""Decide once, then run: build(target, draft, config) checks every capability and returns a
frozen Speculation, the only thing a running batch (engine.Generation) reads: the drafter, the
token tree and its layout, the width of a round, what the drafter needs back from the target,
the cache options and the position limits. Also the prompt inputs (encode, prepare), which
the front (SpeculativeGenerator) and a running batch's add() share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.config import SpecConfig
from ..core.proposal import Proposal
from ..core.sampling import SamplingParams
from ..core.tree import TokenTree
from ..drafters import Drafter, make_drafter
from ..drafters.base import NOTHING, TargetNeeds
from ..errors import SpecDecodeError
from ..models.base import PLAIN, CausalLM, ForwardMeta
from ..models.quant import QUANT_KINDS
from ..models.tokenizer import is_messages

# text, token ids, or a chat: [{"role": "user", "content": ...}, ...] rendered by the target's template
Prompt = str | Sequence[int] | Sequence[dict]


@dataclass(frozen=True)
class Speculation:
    """How one generator speculates, decided by build() and never changed afterwards."""

    target: CausalLM
    config: SpecConfig
    drafter: Drafter | None
    tree: TokenTree | None
    tree_layout: tuple[torch.Tensor, torch.Tensor] | None  # node depths [N + 1], mask [N + 1, N + 1]
    width: int  # the most draft tokens a row proposes in one round
    needs: TargetNeeds  # what each target forward returns for the drafter
    invariant: bool  # the target's batch-invariant forward (and caches)
    rollback: str | None  # hybrid targets: how a rejected draft's recurrent state is undone
    limited: tuple[CausalLM, ...]  # the models whose max_positions bound a row's length

    @property
    def method(self) -> str | None:
        return self.config.method if self.drafter is not None else None

    def new_cache(self, batch_size: int, capacity: int):
        """The target's cache for a batch, with this speculation's options."""
        if self.invariant:
            return self.target.new_cache(batch_size, capacity, invariant=True)
        if self.rollback is not None:
            return self.target.new_cache(batch_size, capacity, rollback=self.rollback)
        return self.target.new_cache(batch_size, capacity)

    def check_capacity(self, capacity: int) -> None:
        """SpecDecodeError when rows of `capacity` tokens do not fit a model's positions."""
        for model in self.limited:
            if capacity > model.max_positions:
                raise SpecDecodeError(
                    f"{model.name or model.path}: prompt + max_new_tokens + k + 1 = {capacity} tokens "
                    f"exceeds its {model.max_positions} positions; shorten the prompt or lower max_new_tokens"
                )

    def verify_meta(self, proposal: Proposal, lengths: torch.Tensor) -> ForwardMeta:
        """The verification forward's meta over [pending token, drafts] at cache `lengths`."""
        hidden, aux = self.needs.hidden, self.needs.aux_layers
        if proposal.tree is None:
            return ForwardMeta(return_hidden=True, aux_layers=aux) if hidden else PLAIN
        depths, mask = self.tree_layout
        positions = lengths.view(-1, 1) + depths.view(1, -1)
        return ForwardMeta(positions=positions, tree_mask=mask, return_hidden=hidden, aux_layers=aux)


def _set_draft_dtype(drafter: Drafter, dtype: str) -> None:
    """Quantize the drafter's own weights, or check that they were loaded in a float `dtype`."""
    have = drafter.weights_dtype
    if have == dtype:
        return
    if dtype in QUANT_KINDS:
        drafter.quantize(dtype)
    elif have is None:
        drafter.quantize(dtype)  # the one-line "no draft weights of its own" error
    else:
        raise SpecDecodeError(
            f"the {drafter.name} drafter's weights are {have}, not {dtype}: load the draft model in {dtype} "
            "(heads run in the target's dtype), or quantize it (int8, int4)"
        )


def build(target: CausalLM, draft: CausalLM | None, config: SpecConfig) -> Speculation:
    """Every check, once, with its one-line error; the frozen Speculation to run."""
    drafter = make_drafter(target, draft, config)
    if drafter is not None and config.draft_dtype is not None:
        _set_draft_dtype(drafter, config.draft_dtype)
    tree = config.tree if drafter is not None else None
    layout = None
    if tree is not None:
        if not all(m.lean for m in (target, draft) if m is not None):
            raise SpecDecodeError("token trees need Llama checkpoints on our lean runtime (--backend lean)")
        layout = (tree.depths().to(target.device), tree.mask().to(target.device))
    if config.batch_invariant and not target.lean:
        raise SpecDecodeError(
            "batch invariance needs a Llama checkpoint on our lean runtime (--backend lean); "
            "transformers' kernels do not give it"
        )
    if config.rollback is not None and not target.hybrid:
        raise SpecDecodeError(
            "--rollback applies to hybrid targets (linear-attention layers); this target has none"
        )
    models = (target, drafter.model if drafter is not None else None)
    return Speculation(
        target=target,
        config=config,
        drafter=drafter,
        tree=tree,
        tree_layout=layout,
        width=config.max_draft if drafter is not None else 0,
        needs=drafter.target_needs() if drafter is not None else NOTHING,
        invariant=target.lean and bool(config.batch_invariant),
        rollback=config.rollback,
        limited=tuple(m for m in models if getattr(m, "max_positions", None) is not None),
    )


def encode(target: CausalLM, prompt: Prompt) -> list[int]:
    """A prompt's token ids (chat messages through the target's template); SpecDecodeError with
    a one-line reason when it cannot be encoded."""
    if isinstance(prompt, str):
        if prompt == "":
            raise SpecDecodeError("the prompt is empty; give at least one character")
        if target.tokenizer is None:
            raise SpecDecodeError(f"{target.path} has no tokenizer; pass token ids instead of text")
        ids = target.tokenizer.encode(prompt)
    elif is_messages(prompt):
        if target.tokenizer is None:
            raise SpecDecodeError(f"{target.path} has no tokenizer; chat messages need one")
        ids = target.tokenizer.encode_chat(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise SpecDecodeError("the prompt is empty; give at least one token")
    V = target.vocab_size
    if min(ids) < 0 or max(ids) >= V:
        raise SpecDecodeError(f"prompt token ids must be in [0, {V}); got {min(ids)}..{max(ids)}")
    return ids


def prepare(
    target: CausalLM,
    prompts: Sequence[Prompt] | Prompt,
    params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[list[list[int]], list[SamplingParams]]:
    """One prompt or many, and one SamplingParams or one per prompt -> (token ids, params)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) or is_messages(prompts):
        prompts = [prompts]  # type: ignore[list-item]
    if not prompts:
        raise SpecDecodeError("no prompts given")
    ids = [encode(target, p) for p in prompts]
    params = params if params is not None else SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * len(ids)
    if len(params) != len(ids):
        raise SpecDecodeError(f"got {len(ids)} prompts but {len(params)} SamplingParams")
    return ids, list(params)
