"""Acceptance rules: pure, batched functions with no model inside.

Chain rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): draft token x_i, drawn
from draft_probs q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection one token is drawn from the residual norm(max(0, p_i - q_i)); if all k pass, a
bonus token is drawn from p_{k}. The emitted tokens then follow the target exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.proposal import Proposal
from ..core.sampling import RowRandom, Warp, logits_to_probs, sample
from ..core.tree import TreeVerdict, verify_tree


@dataclass
class Verdict:
    """What one round of verification decided, per row. Shapes: B rows, k draft positions."""

    accepted: torch.Tensor  # [B] long: number of draft tokens accepted (leading run)
    tokens: torch.Tensor  # [B, k+1] long: the first accepted[b] + 1 entries are emitted
    draft_prob: torch.Tensor  # [B, k] q_i(x_i) (1.0 for deterministic drafts)
    target_prob: torch.Tensor  # [B, k] p_i(x_i)
    accept_prob: torch.Tensor  # [B, k] min(1, p_i(x_i) / q_i(x_i))
    uniforms: torch.Tensor | None  # [B, k] the uniforms drawn (None on the greedy path)
    accepted_mask: torch.Tensor  # [B, k] bool: position i accepted (False after the first rejection)
    draft_lengths: torch.Tensor  # [B] long: draft tokens of each row (positions beyond are padding)
    path: list[list[int]] | None = None  # token trees: accepted node input indices per row (root excluded)

    @staticmethod
    def plain(token: torch.Tensor) -> Verdict:
        """A round with no drafts: one target token [B] per row."""
        B = token.shape[0]
        none = torch.zeros(B, 0, device=token.device)
        zeros = torch.zeros(B, dtype=torch.long, device=token.device)
        return Verdict(zeros, token.view(B, 1), none, none, none, None, none.bool(), zeros)

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.accepted + 1

    @property
    def tested(self) -> torch.Tensor:
        """[B, k] bool: position i was reached (every drafted position up to the first rejection)."""
        k = self.accepted_mask.shape[1]
        i = torch.arange(k, device=self.accepted.device).view(1, k)
        return (i <= self.accepted.view(-1, 1)) & (i < self.draft_lengths.view(-1, 1))

    @property
    def bonus(self) -> torch.Tensor:
        """[B] bool: the last emitted token is a bonus token (all of the row's drafts accepted)."""
        return self.accepted == self.draft_lengths


def _leading_run(mask: torch.Tensor) -> torch.Tensor:
    # [B, k] bool -> [B] length of the leading run of True
    return mask.long().cumprod(-1).sum(-1)


def verify_chain(
    draft_tokens: torch.Tensor,  # [B, k] long
    draft_probs: torch.Tensor | None,  # [B, k, V] or None for deterministic (one-hot) drafts
    target_probs: torch.Tensor,  # [B, k+1, V]
    uniforms: torch.Tensor,  # [B, k] U[0, 1)
    exp_noise: torch.Tensor,  # [B, V] Exp(1), for the one resampled or bonus token per row
    draft_lengths: torch.Tensor | None = None,  # [B] long: row b drafted only its first n_b tokens
) -> Verdict:
    """Exact speculative sampling: the emitted tokens are distributed as target_probs. A row
    with draft_lengths n_b < k is verified as if it had drafted n_b tokens (bonus from p_{n_b})."""
    B, k = draft_tokens.shape
    dev = draft_tokens.device
    n = torch.full((B,), k, dtype=torch.long, device=dev) if draft_lengths is None else draft_lengths
    V = target_probs.shape[-1]
    # the acceptance test runs in float64 whatever the model's dtype: a uniform is never rounded
    target_prob = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).double()
    if draft_probs is None:
        draft_prob = torch.ones_like(target_prob)
    else:
        draft_prob = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).double()
    # accept iff u < p/q, written u*q < p so q = 0 or p = 0 need no special case
    ok = uniforms.double() * draft_prob < target_prob
    accept_prob = torch.where(
        draft_prob > 0,
        (target_prob / draft_prob.clamp_min(1e-300)).clamp(max=1.0),
        (target_prob > 0).to(target_prob.dtype),
    )
    pos_k = torch.arange(k, device=dev).view(1, k)
    accepted = _leading_run(ok & (pos_k < n.view(B, 1)))
    accepted_mask = pos_k < accepted.view(B, 1)

    # the distribution of the one extra token: residual at the first rejection, else p_k (bonus)
    p_next = target_probs.gather(1, accepted.view(B, 1, 1).expand(B, 1, V)).squeeze(1)  # [B, V]
    if k > 0:
        pos = accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens.gather(1, pos.view(B, 1)), 1.0)
        else:
            q_next = draft_probs.gather(1, pos.view(B, 1, 1).expand(B, 1, V)).squeeze(1).to(p_next.dtype)
        residual = (p_next - q_next).clamp_min(0.0)
        # p == q leaves an empty residual; a rejection then has probability 0, so any
        # choice is exact; p keeps the output a valid token of the target.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
        rejected = (accepted < n).view(B, 1)
        p_next = torch.where(rejected, residual, p_next)
    extra = sample(p_next, exp_noise)

    tokens = torch.cat([draft_tokens, torch.zeros(B, 1, dtype=torch.long, device=dev)], dim=1)
    tokens.scatter_(1, accepted.view(B, 1), extra.view(B, 1))
    return Verdict(accepted, tokens, draft_prob, target_prob, accept_prob, uniforms, accepted_mask, n)


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, k] long
    target_scores: torch.Tensor,  # [B, k+1, V] logits or probs (only the argmax is used)
    draft_lengths: torch.Tensor | None = None,  # [B] long: row b drafted only its first n_b tokens
) -> Verdict:
    """Accept while the draft token equals the target's argmax; then emit the argmax."""
    B, k = draft_tokens.shape
    dev = draft_tokens.device
    n = torch.full((B,), k, dtype=torch.long, device=dev) if draft_lengths is None else draft_lengths
    best = target_scores.argmax(-1)  # [B, k+1]
    pos_k = torch.arange(k, device=dev).view(1, k)
    match = (draft_tokens == best[:, :k]) & (pos_k < n.view(B, 1))
    accepted = _leading_run(match)
    accepted_mask = pos_k < accepted.view(B, 1)
    tokens = torch.cat([draft_tokens, torch.zeros(B, 1, dtype=torch.long, device=dev)], dim=1)
    tokens.scatter_(1, accepted.view(B, 1), best.gather(1, accepted.view(B, 1)))
    as_prob = match.to(torch.float64)
    return Verdict(accepted, tokens, torch.ones(B, k, device=dev), as_prob, as_prob, None, accepted_mask, n)


def verify_invariant(
    draft_tokens: torch.Tensor,  # [B, k] long
    target_probs: torch.Tensor,  # [B, k+1, V] warped
    noise: torch.Tensor,  # [B, k+1, V] Exp(1): E_t of each position, keyed by (seed, t)
    draft_lengths: torch.Tensor | None = None,  # [B] long
    draft_probs: torch.Tensor | None = None,  # [B, k, V] (only reported)
) -> Verdict:
    """The invariant rule (sampling.py): the target's token at each position is
    y_t = argmax p_t / E_t, an exact sample from p_t; drafts are kept while they equal y_t and
    the first y_t that differs (or the one after the last draft) is emitted. That is the greedy
    rule on the perturbed scores p / E, so the emitted tokens are a function of p and E alone."""
    v = verify_greedy(draft_tokens, target_probs / noise, draft_lengths)
    k = draft_tokens.shape[1]
    v.target_prob = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).double()
    if draft_probs is not None:
        v.draft_prob = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).double()
    return v


def _merge(mask: torch.Tensor, a: Verdict, b: Verdict) -> Verdict:
    """Row r from a where mask[r], else from b (a batch mixing the two sampling rules)."""

    def pick(x, y):
        if x is None or y is None:
            return x if y is None else y
        m = mask.view(-1, *([1] * (x.dim() - 1)))
        return torch.where(m, x, y.to(x.dtype))

    return Verdict(
        pick(a.accepted, b.accepted),
        pick(a.tokens, b.tokens),
        pick(a.draft_prob, b.draft_prob),
        pick(a.target_prob, b.target_prob),
        pick(a.accept_prob, b.accept_prob),
        b.uniforms if b.uniforms is not None else a.uniforms,
        pick(a.accepted_mask, b.accepted_mask),
        pick(a.draft_lengths, b.draft_lengths),
    )


def verify_proposal(
    proposal: Proposal,
    logits: torch.Tensor,
    warp: Warp,
    rng: RowRandom,
    positions: torch.Tensor | None = None,
) -> Verdict:
    """The one verifier of a round: logits [B, 1 + width, V] of the target at the pending token
    and every draft (or tree node) -> the Verdict. Greedy batches compare argmaxes; sampled rows
    use the exact rules, drawing from their own generators only what their drafts need; rows
    under the invariant rule read the noise of positions[b] + j ([B] long: the absolute position
    of the first token this round emits; needed only when such rows exist)."""
    if warp.any_invariant and positions is None:
        raise ValueError("rows under the invariant rule need the round's positions")
    if proposal.tree is not None:
        return _verify_tree_round(proposal, logits, warp, rng, positions)
    B, k = proposal.tokens.shape
    V = logits.shape[-1]
    if k == 0:  # nothing drafted: one target token per row, none of the chain machinery
        if warp.all_greedy:
            return Verdict.plain(logits[:, 0].argmax(-1))
        probs = logits_to_probs(logits[:, :1], warp)[:, 0]
        return Verdict.plain(sample(probs, rng.exp_noise(V, warp.sampled, positions)))
    n = proposal.draft_lengths()
    if warp.all_greedy:
        return verify_greedy(proposal.tokens, logits, n)
    probs = logits_to_probs(logits, warp)
    keyed = None
    if warp.any_invariant:
        at = positions.view(B, 1) + torch.arange(k + 1, device=positions.device).view(1, k + 1)
        noise = rng.keyed_noise(V, at, warp.invariant).to(probs.dtype)
        keyed = verify_invariant(proposal.tokens, probs, noise, n, proposal.probs)
        if all(warp.invariant):
            return keyed
    counts = [nb if s else 0 for nb, s in zip(n.tolist(), warp.streamed)]
    standard = verify_chain(
        proposal.tokens,
        proposal.probs,
        probs,
        rng.uniforms(counts, k),
        rng.exp_noise(V, [not i for i in warp.invariant]),
        n,
    )
    return standard if keyed is None else _merge(warp.keyed, keyed, standard)


def _verify_tree_round(
    proposal: Proposal, logits: torch.Tensor, warp: Warp, rng: RowRandom, positions: torch.Tensor | None
) -> Verdict:
    """A token tree's verdict, reported like a chain whose drafts are the accepted path (plus
    the level where every candidate was rejected); Verdict.path says which nodes to keep. Rows
    under the invariant rule walk the tree greedily on p / E, E keyed by each node's position."""
    tree, nodes = proposal.tree, proposal.tokens
    B, D, dev = nodes.shape[0], tree.depth, nodes.device
    greedy = warp.all_greedy
    probs = None if greedy else logits_to_probs(logits, warp)
    V = logits.shape[-1]
    tv = keyed = None
    if warp.any_invariant and not greedy:
        at = positions.view(B, 1) + tree.depths().to(dev).view(1, -1)  # input i predicts position + depth(i)
        noise = rng.keyed_noise(V, at, warp.invariant).to(probs.dtype)
        keyed = verify_tree(tree, nodes, None, probs / noise, None, None)
    if not all(warp.invariant) or greedy:
        sampled_rows = None
        if proposal.probs is not None and not greedy and tree.sampled:  # candidates drawn from q
            sampled_rows = torch.tensor(warp.streamed, device=dev)
        tv = verify_tree(
            tree,
            nodes,
            probs,
            logits,
            None if greedy else rng.uniforms([tree.size if s else 0 for s in warp.streamed], tree.size),
            None if greedy else rng.exp_noise(V, warp.streamed),
            proposal.probs,
            sampled_rows,
            tree.sampling == "without-replacement",
        )
    if keyed is not None:
        tv = keyed if tv is None else _merge_tree(warp.invariant, keyed, tv)
    accepted = torch.tensor([len(p) for p in tv.path], device=dev)
    tokens = torch.tensor([t + [0] * (D + 1 - len(t)) for t in tv.tokens], dtype=torch.long, device=dev)
    # p of each accepted node's token at its parent (the root, then the path's nodes)
    parents = torch.tensor([([0] + p + [0] * D)[:D] for p in tv.path], device=dev)
    src = probs if probs is not None else torch.softmax(logits.double(), -1)
    at = src[torch.arange(B, device=dev).view(B, 1), parents, tokens[:, :D]].to(torch.float64)
    kept = torch.arange(D, device=dev).view(1, D) < accepted.view(B, 1)
    target_prob = torch.where(kept, at, torch.ones_like(at))
    n_drafts = (accepted + (~torch.tensor(tv.bonus, device=dev)).long()).clamp(max=D)
    mask = torch.arange(D, device=dev).view(1, D) < accepted.view(B, 1)
    ones = torch.ones(B, D, dtype=torch.float64, device=dev)
    return Verdict(accepted, tokens, ones, target_prob, target_prob, None, mask, n_drafts, tv.path)


def _merge_tree(mask: list[bool], a: TreeVerdict, b: TreeVerdict) -> TreeVerdict:
    pick = [
        x if m else y for m, x, y in zip(mask, zip(a.path, a.tokens, a.bonus), zip(b.path, b.tokens, b.bonus))
    ]
    return TreeVerdict([p[0] for p in pick], [p[1] for p in pick], [p[2] for p in pick])
