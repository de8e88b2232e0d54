"""Medusa: h heads on the target's last hidden state. Head i is a residual block
x + SiLU(W_i x + b_i) read by the target's own LM head; it predicts the token i + 2 places
after the position whose hidden state it reads (the target's own head predicts 1 place).

The heads see only the target's features of the last committed position, so all draft tokens
of a round come from one hidden state: a chain samples one token from each head, a tree takes
each head's top-ranked tokens at its depth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..errors import SpecDecodeError
from ..models.llama import LlamaModel
from ..sampling import logits_to_probs, sample
from ..tree import TokenTree
from .base import Proposal

if TYPE_CHECKING:
    from ..engine import Batch

KIND = "specdecode-medusa-heads"


class MedusaHeads:
    """Weights [h, d, d] and biases [h, d] of the residual blocks (the LM head is the target's)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, meta: dict | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.meta = meta or {}

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> [..., h, d]: every head's residual block."""
        x = hidden.unsqueeze(-2)  # [..., 1, d]
        return x + F.silu(torch.einsum("...d,hed->...he", hidden, self.weight) + self.bias)

    def save(self, out: Path, meta: dict) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        tensors = {
            "heads.weight": self.weight.to(torch.float16).contiguous(),
            "heads.bias": self.bias.to(torch.float16).contiguous(),
        }
        save_file(tensors, str(out / "heads.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({"kind": KIND, **meta}, indent=1) + "\n")

    @staticmethod
    def load(path: str | Path, dtype: torch.dtype = torch.float32) -> MedusaHeads:
        from safetensors.torch import load_file

        path = Path(path)
        cfg = path / "config.json"
        if not cfg.exists() or json.loads(cfg.read_text()).get("kind") != KIND:
            raise SpecDecodeError(f"{path} holds no Medusa heads; train them with `specdecode train-heads`")
        w = load_file(str(path / "heads.safetensors"))
        return MedusaHeads(
            w["heads.weight"].to(dtype), w["heads.bias"].to(dtype), json.loads(cfg.read_text())
        )


class MedusaDrafter:
    needs_hidden = True
    model = None

    def __init__(self, target, heads: MedusaHeads) -> None:
        if not isinstance(target, LlamaModel):
            raise SpecDecodeError("method medusa needs a Llama target on our lean runtime (--backend lean)")
        if heads.hidden_size != target.cfg.hidden_size:
            raise SpecDecodeError(
                f"Medusa heads of width {heads.hidden_size} do not fit a target of width "
                f"{target.cfg.hidden_size}; train heads for this target"
            )
        self.target = target
        self.heads = MedusaHeads(heads.weight.to(target.dtype), heads.bias.to(target.dtype), heads.meta)
        self.hidden: torch.Tensor | None = None  # [B, d] at the position before the pending token

    def start(self, batch: Batch, target_cache) -> None:
        self.hidden = None

    def observe_features(self, hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> None:
        """hidden [B, T, d]: the target's features of positions start[b] .. start[b] + count[b] - 1;
        the heads read the last of them (the token before the new pending one)."""
        last = (count - 1).clamp(min=0)
        self.hidden = hidden[torch.arange(hidden.shape[0]), last]

    def _logits(self) -> torch.Tensor:
        return F.linear(self.heads.features(self.hidden), self.target.lm_head)  # [B, h, V]

    @torch.inference_mode()
    def propose(self, batch: Batch, k: int, stop_below: float | None = None) -> Proposal:
        if self.hidden is None:  # a one-token prompt: nothing seen yet
            return Proposal.empty(batch.size)
        k = min(k, self.heads.num_heads)
        logits = self._logits()[:, :k]  # [B, k, V]
        if batch.warp.all_greedy:
            return Proposal(logits.argmax(-1))
        q = logits_to_probs(logits, batch.warp)  # [B, k, V]
        tokens = torch.stack([sample(q[:, i], batch.exp_noise(q.shape[-1])) for i in range(k)], 1)
        return Proposal(tokens, q)

    @torch.inference_mode()
    def propose_tree(self, batch: Batch, tree: TokenTree) -> torch.Tensor:
        if tree.depth > self.heads.num_heads:
            raise SpecDecodeError(
                f"a tree of depth {tree.depth} needs {tree.depth} Medusa heads, have {self.heads.num_heads}"
            )
        B = batch.size
        if self.hidden is None:
            return torch.zeros(B, tree.size, dtype=torch.long)
        width = 1 + max(max(c) for c in tree.choices)
        top = self._logits().topk(width, -1).indices  # [B, h, width]
        nodes = torch.zeros(B, tree.size, dtype=torch.long)
        for i, c in enumerate(tree.choices):
            nodes[:, i] = top[:, len(c) - 1, c[-1]]
        return nodes

    def commit(self, lengths: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.hidden is not None:
            self.hidden = self.hidden[rows]
