"""Token trees: several candidate continuations verified in ONE target forward.

A tree is given by Medusa-style choices: each node is a path of child ranks from the root,
e.g. (0,) = the drafter's best token at depth 1, (1,) its second best, (0, 0) the best token
after (0,). The root is the pending token. The target sees [root, node 1, ..., node N] with
positions root + depth and a mask that lets every node attend to its ancestors only.

How candidates are chosen (TokenTree.sampling):

- "topk": the drafter's top-ranked tokens, so each is a one-hot proposal. The children of the
  current node are tried in rank order: a child with token x is accepted with probability p(x);
  after a rejection x is removed from p and p renormalised (the residual of p against a one-hot
  draft); if every child is rejected, one token is drawn from what is left. Exact, and strong
  for greedy decoding, but at T = 1 a top-ranked token is accepted only with p(x).
- "with-replacement": the children of a node are independent draws from the drafter's
  (warped) distribution q there. SpecInfer's multi-candidate rule: child x is accepted with
  min(1, p(x)/q(x)); a rejection replaces p by norm(max(0, p − q)) and the next child is tried
  against it; if all are rejected, one token is drawn from the last residual.
- "without-replacement": the children are drawn from q without replacement (distinct tokens).
  Sequoia's rule: as above, and after a rejection of x also q(x) ← 0, q renormalised, since the
  next child was drawn from that q.

All three keep the target's distribution exactly (tests/test_tree.py). Greedy rows always use
top-ranked candidates (a sampled candidate can only lose there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from itertools import product

import torch

from ..errors import SpecDecodeError
from .sampling import sample

TREE_SAMPLING = ("topk", "with-replacement", "without-replacement")


@dataclass(frozen=True)
class TokenTree:
    choices: tuple[tuple[int, ...], ...]  # node i + 1 is choices[i]; parents before children
    sampling: str = "topk"  # how candidates are chosen: one of TREE_SAMPLING (module docstring)

    def __post_init__(self) -> None:
        if self.sampling not in TREE_SAMPLING:
            raise SpecDecodeError(
                f"unknown tree sampling {self.sampling!r}; choose one of {', '.join(TREE_SAMPLING)}"
            )
        seen = set()
        for c in self.choices:
            if not c or min(c) < 0:
                raise SpecDecodeError(f"tree choice {list(c)} must be a non-empty path of ranks >= 0")
            if len(c) > 1 and c[:-1] not in seen:
                raise SpecDecodeError(
                    f"tree choice {list(c)} comes before (or without) its parent {list(c[:-1])}"
                )
            if c in seen:
                raise SpecDecodeError(f"tree choice {list(c)} appears twice")
            seen.add(c)

    @staticmethod
    def from_branching(branching: list[int]) -> TokenTree:
        """Every node at depth d has branching[d] children: '3,2,1' -> 3 + 6 + 6 nodes."""
        if not branching or min(branching) < 1:
            raise SpecDecodeError(f"tree branching must be numbers >= 1, got {branching}")
        nodes: list[tuple[int, ...]] = []
        for d in range(1, len(branching) + 1):
            nodes += [tuple(c) for c in product(*[range(b) for b in branching[:d]])]
        return TokenTree(tuple(nodes))

    @staticmethod
    def parse(spec: str) -> TokenTree:
        """'3,2,1' (branching per depth) or a JSON list of choices '[[0], [1], [0, 0]]'."""
        spec = spec.strip()
        try:
            if spec.startswith("["):
                choices = json.loads(spec)
                nodes = sorted((tuple(int(x) for x in c) for c in choices), key=lambda c: (len(c), c))
                return TokenTree(tuple(nodes))
            return TokenTree.from_branching([int(x) for x in spec.split(",")])
        except (ValueError, TypeError):
            raise SpecDecodeError(
                f"--tree {spec!r}: give branching per depth like 3,2,1 or JSON choices like [[0],[1],[0,0]]"
            ) from None

    def with_sampling(self, sampling: str) -> TokenTree:
        return replace(self, sampling=sampling)

    @property
    def sampled(self) -> bool:
        return self.sampling != "topk"

    @property
    def size(self) -> int:
        return len(self.choices)

    @property
    def depth(self) -> int:
        return max(len(c) for c in self.choices)

    def parents(self) -> list[int]:
        """Input index (0 = root) of each node's parent, for nodes 1..N."""
        index = {c: i + 1 for i, c in enumerate(self.choices)}
        return [index[c[:-1]] if len(c) > 1 else 0 for c in self.choices]

    def depths(self) -> torch.Tensor:
        """[N + 1] depth of the root (0) and every node."""
        return torch.tensor([0] + [len(c) for c in self.choices])

    def mask(self) -> torch.Tensor:
        """[N + 1, N + 1] bool: input i may attend to input j (j is i or an ancestor of i)."""
        n = self.size + 1
        m = torch.eye(n, dtype=torch.bool)
        m[:, 0] = True
        for i, parent in enumerate(self.parents(), start=1):
            m[i] |= m[parent]
        return m

    def children(self) -> torch.Tensor:
        """[N + 1, R] input index of each input's children in rank order (-1 where none)."""
        kids: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, parent in enumerate(self.parents(), start=1):
            kids[parent].append(i)
        width = max(len(k) for k in kids)
        table = torch.full((self.size + 1, width), -1, dtype=torch.long)
        for i, k in enumerate(kids):
            ranked = sorted(k, key=lambda j: self.choices[j - 1][-1])
            table[i, : len(ranked)] = torch.tensor(ranked, dtype=torch.long)
        return table


@dataclass
class TreeVerdict:
    """Per row: the accepted path (input indices, root excluded) and the tokens to emit."""

    path: list[list[int]]  # accepted node input indices, root excluded, in depth order
    tokens: list[list[int]]  # emitted: the accepted nodes' tokens and one extra token
    bonus: list[bool]  # the extra token came after a leaf (no children left to try)


def verify_tree(
    tree: TokenTree,
    node_tokens: torch.Tensor,  # [B, N] long: the candidates
    target_probs: torch.Tensor | None,  # [B, N + 1, V] at root and every node (None: greedy)
    target_scores: torch.Tensor,  # [B, N + 1, V] logits or probs; argmax used when greedy
    uniforms: torch.Tensor | None,  # [B, N] U[0, 1) one per node
    exp_noise: torch.Tensor | None,  # [B, V] Exp(1) for the extra token
    draft_probs: torch.Tensor | None = None,  # [B, N + 1, V] q at root and every node (sampled)
    sampled_rows: torch.Tensor | None = None,  # [B] bool: rows whose candidates came from q
    without_replacement: bool = False,
) -> TreeVerdict:
    """Walk the tree from the root; exact multi-candidate rejection sampling (or greedy).

    Rows in sampled_rows drew each node's children from draft_probs at that node (with or
    without replacement, as the tree says); the other rows' candidates are one-hot proposals."""
    B, dev = node_tokens.shape[0], node_tokens.device
    children = tree.children().to(dev)
    greedy = target_probs is None
    best = target_scores.argmax(-1) if greedy else None  # [B, N + 1]
    tokens_in = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), node_tokens], 1)  # [B, N+1]
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # current input index per row
    p_cur = None if greedy else target_probs[:, 0].clone()  # [B, V]
    use_q = not greedy and draft_probs is not None and sampled_rows is not None and bool(sampled_rows.any())
    if use_q:
        sq = sampled_rows.to(dev)
        q_cur = draft_probs[:, 0].to(p_cur.dtype).clone()  # q for the current node's children
    path: list[list[int]] = [[] for _ in range(B)]
    rows = torch.arange(B, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    for _ in range(tree.depth):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        for r in range(children.shape[1]):
            child = children[cur, r]  # [B]
            live = (child >= 0) & ~moved & ~done
            if not bool(live.any()):
                break
            c = child.clamp(min=0)
            x = tokens_in[rows, c]  # [B]
            if greedy:
                ok = live & (x == best[rows, cur])
            else:
                u = uniforms[rows, (c - 1).clamp(min=0)].to(p_cur.dtype)
                qx = torch.where(sq, q_cur[rows, x], 1.0) if use_q else torch.ones_like(u)
                # a sampled candidate q gives no mass (drawn without replacement after q's support
                # ran out) was not drawn from q: skip it, p and q unchanged
                live = live & (qx > 0)
                ok = live & (u * qx < p_cur[rows, x])  # u < p/q, with q(x) = 1 for a one-hot draft
                rej = live & ~ok
                if bool(rej.any()):
                    # the residual norm(max(0, p − q)); a one-hot q removes x from p
                    q_vec = torch.zeros_like(p_cur[rej]).scatter_(1, x[rej].view(-1, 1), 1.0)
                    if use_q:
                        q_vec = torch.where(sq[rej].view(-1, 1), q_cur[rej], q_vec)
                    res = (p_cur[rej] - q_vec).clamp_min(0.0)
                    total = res.sum(-1, keepdim=True)
                    # p == q leaves nothing: a rejection had probability 0, any choice is exact
                    p_cur[rej] = torch.where(total > 0, res / total.clamp_min(1e-300), p_cur[rej])
                    if use_q and without_replacement:  # the next sibling was drawn from q without x
                        wr = rej & sq
                        if bool(wr.any()):
                            q_cur[wr, x[wr]] = 0.0
                            q_cur[wr] = q_cur[wr] / q_cur[wr].sum(-1, keepdim=True).clamp_min(1e-300)
                if bool(ok.any()):
                    p_cur[ok] = target_probs[ok, c[ok]]
                    if use_q:
                        q_cur[ok] = draft_probs[ok, c[ok]].to(q_cur.dtype)
            for b in ok.nonzero().flatten().tolist():
                path[b].append(int(c[b]))
            cur = torch.where(ok, c, cur)
            moved |= ok
        done |= ~moved  # every child of the current node was rejected: the walk ends here
        if bool(done.all()):
            break
    if greedy:
        extra = best[rows, cur]
    else:
        extra = sample(p_cur, exp_noise)
    has_children = (children[cur] >= 0).any(-1)
    tokens = [[int(tokens_in[b, i]) for i in path[b]] + [int(extra[b])] for b in range(B)]
    return TreeVerdict(path, tokens, (~has_children).tolist())
