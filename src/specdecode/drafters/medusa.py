"""Medusa: h heads on the target's last hidden state. Head i is a residual block
x + SiLU(W_i x + b_i) read by the target's own LM head; it predicts the token i + 2 places
after the position whose hidden state it reads (the target's own head predicts 1 place).

The heads see only the target's features of the last committed position, so all draft tokens
of a round come from one hidden state: a chain samples one token from each head, a tree takes
each head's top-ranked tokens at its depth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..core.proposal import Proposal
from ..core.tree import TokenTree
from ..errors import SpecDecodeError
from ..models.quant import quantized_linear
from .base import DraftChain, DraftContext, Drafter, TreeDraw, require_lean, weights_dtype_of

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
        if self.quantized is not None:  # one weight-only quantized product per head
            flat = hidden.reshape(-1, hidden.shape[-1])
            blocks = torch.stack([head(flat) for head in self.quantized], -2)
            return x + F.silu(blocks.view(*hidden.shape[:-1], self.num_heads, -1))
        return x + F.silu(torch.einsum("...d,hed->...he", hidden, self.weight) + self.bias)

    quantized: list | None = None  # per-head QuantLinears (MedusaDrafter.quantize)

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


@dataclass
class MedusaState:
    hidden: torch.Tensor  # [B, d] the target's features at the position before each pending token
    known: torch.Tensor  # [B] bool: the row has such a feature (a one-token prompt has none yet)


class MedusaDrafter(Drafter):
    name = "medusa"
    lean_only = True
    requires_hidden = True
    supports_tree = True

    def __init__(self, target, heads: MedusaHeads) -> None:
        require_lean(target, self.name)
        if heads.hidden_size != target.cfg.hidden_size:
            raise SpecDecodeError(
                f"Medusa heads of width {heads.hidden_size} do not fit a target of width "
                f"{target.cfg.hidden_size}; train heads for this target"
            )
        self.target = target
        w, b = heads.weight.to(target.device, target.dtype), heads.bias.to(target.device, target.dtype)
        self.heads = MedusaHeads(w, b, heads.meta)

    @classmethod
    def create(cls, target, draft, config) -> MedusaDrafter:
        if config.heads is None:
            raise SpecDecodeError("method 'medusa' needs trained heads (--heads DIR)")
        heads = config.heads
        return cls(target, MedusaHeads.load(heads) if isinstance(heads, (str, Path)) else heads)

    def start(self, ctx: DraftContext, target_cache) -> MedusaState:
        d = self.target.cfg.hidden_size
        hidden = torch.zeros(ctx.size, d, dtype=self.target.dtype, device=ctx.device)
        return MedusaState(hidden, torch.zeros(ctx.size, dtype=torch.bool, device=ctx.device))

    def observe(
        self, state: MedusaState, hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor
    ) -> None:
        """The heads read the last feature given (the token before the new pending one)."""
        last = (count - 1).clamp(min=0)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        state.hidden = torch.where((count > 0).view(-1, 1), hidden[rows, last], state.hidden)
        state.known = state.known | (count > 0)

    @property
    def weights_dtype(self) -> str | None:
        return self.kind or weights_dtype_of(self.target)

    kind: str | None = None
    head = None  # a quantized copy of the target's LM head (quantize())

    def quantize(self, kind: str) -> None:
        """The heads' blocks and the LM head they read (a quantized copy: the target keeps its own)."""
        w, b = self.heads.weight, self.heads.bias
        self.heads.quantized = [quantized_linear([w[i]], b[i], kind) for i in range(self.heads.num_heads)]
        self.head = quantized_linear([self.target.lm_head], None, kind)
        self.kind = kind

    def _logits(self, state: MedusaState) -> torch.Tensor:
        feats = self.heads.features(state.hidden)  # [B, h, d]
        if self.head is not None:
            return self.head(feats.reshape(-1, feats.shape[-1])).view(*feats.shape[:-1], -1)
        return F.linear(feats, self.target.lm_head)  # [B, h, V]

    @torch.inference_mode()
    def propose(
        self, state: MedusaState, ctx: DraftContext, limits: torch.Tensor, stop_below: float | None = None
    ) -> Proposal:
        limits = torch.where(state.known, limits.clamp(max=self.heads.num_heads), 0)
        chain = DraftChain(ctx, limits, stop_below)
        if chain.width == 0:  # one-token prompts: nothing seen yet
            return Proposal.empty(ctx.size, ctx.device)
        logits = self._logits(state)  # [B, h, V]: head i drafts position i, independently
        for i in range(chain.width):
            if chain.draw(logits[:, i])[1]:
                break
        return chain.proposal()

    @torch.inference_mode()
    def propose_tree(self, state: MedusaState, ctx: DraftContext, tree: TokenTree):
        if tree.depth > self.heads.num_heads:
            raise SpecDecodeError(
                f"a tree of depth {tree.depth} needs {tree.depth} Medusa heads, have {self.heads.num_heads}"
            )
        # head d drafts depth d + 1 from the last committed hidden state whatever the parent, so
        # the q after every node at depth d is head d's (still exact: q may be any distribution)
        logits = self._logits(state)  # [B, h, V]
        depths = tree.depths().tolist()
        draw = TreeDraw(ctx, tree)
        for d in range(1, tree.depth + 1):
            draw.level(d, lambda i: logits[:, depths[i]])
        return draw.proposal()  # rows with no feature yet draw from a zero feature (still exact)

    def select_rows(self, state: MedusaState, rows: torch.Tensor) -> None:
        state.hidden, state.known = state.hidden[rows], state.known[rows]

    def add_rows(self, state: MedusaState, new: MedusaState) -> None:
        state.hidden = torch.cat([state.hidden, new.hidden])
        state.known = torch.cat([state.known, new.known])
