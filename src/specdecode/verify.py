"""Acceptance rules: pure, batched functions with no model inside.

Chain rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): draft token x_i, drawn
from draft_probs q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection one token is drawn from the residual norm(max(0, p_i - q_i)); if all k pass, a
bonus token is drawn from p_{k}. The emitted tokens then follow the target exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample


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

    @staticmethod
    def plain(token: torch.Tensor) -> Verdict:
        """A round with no drafts: one target token [B] per row."""
        B = token.shape[0]
        none = torch.zeros(B, 0)
        zeros = torch.zeros(B, dtype=torch.long)
        return Verdict(zeros, token.view(B, 1), none, none, none, None, none.bool(), zeros)

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.accepted + 1

    @property
    def tested(self) -> torch.Tensor:
        """[B, k] bool: position i was reached (every drafted position up to the first rejection)."""
        k = self.accepted_mask.shape[1]
        i = torch.arange(k).view(1, k)
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
    n = torch.full((B,), k, dtype=torch.long) if draft_lengths is None else draft_lengths
    V = target_probs.shape[-1]
    target_prob = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        draft_prob = torch.ones_like(target_prob)
    else:
        draft_prob = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    # accept iff u < p/q, written u*q < p so q = 0 or p = 0 need no special case
    ok = uniforms.to(target_prob.dtype) * draft_prob < target_prob
    accept_prob = torch.where(
        draft_prob > 0,
        (target_prob / draft_prob.clamp_min(1e-300)).clamp(max=1.0),
        (target_prob > 0).to(target_prob.dtype),
    )
    accepted = _leading_run(ok & (torch.arange(k).view(1, k) < n.view(B, 1)))
    accepted_mask = torch.arange(k).view(1, k) < accepted.view(B, 1)

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

    tokens = torch.cat([draft_tokens, torch.zeros(B, 1, dtype=torch.long)], dim=1)
    tokens.scatter_(1, accepted.view(B, 1), extra.view(B, 1))
    return Verdict(accepted, tokens, draft_prob, target_prob, accept_prob, uniforms, accepted_mask, n)


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, k] long
    target_scores: torch.Tensor,  # [B, k+1, V] logits or probs (only the argmax is used)
    draft_lengths: torch.Tensor | None = None,  # [B] long: row b drafted only its first n_b tokens
) -> Verdict:
    """Accept while the draft token equals the target's argmax; then emit the argmax."""
    B, k = draft_tokens.shape
    n = torch.full((B,), k, dtype=torch.long) if draft_lengths is None else draft_lengths
    best = target_scores.argmax(-1)  # [B, k+1]
    match = (draft_tokens == best[:, :k]) & (torch.arange(k).view(1, k) < n.view(B, 1))
    accepted = _leading_run(match)
    accepted_mask = torch.arange(k).view(1, k) < accepted.view(B, 1)
    tokens = torch.cat([draft_tokens, torch.zeros(B, 1, dtype=torch.long)], dim=1)
    tokens.scatter_(1, accepted.view(B, 1), best.gather(1, accepted.view(B, 1)))
    as_prob = match.to(torch.float32)
    return Verdict(accepted, tokens, torch.ones(B, k), as_prob, as_prob, None, accepted_mask, n)
