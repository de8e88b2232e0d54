"""Any transformers.AutoModelForCausalLM (GPT-2, Qwen2, ...) behind the same interface.

transformers keeps one common length for all rows, so ragged rows are kept with holes: each
row has a mask of live cache slots; rewinding a row marks its later slots dead, and the
tail that no row uses any more is cropped. Every forward passes that mask as the attention
mask and explicit position ids, so a dead slot is never attended to. Correct for any model
that honours attention_mask and position_ids; slower than our own runtime.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from .base import PLAIN, ForwardMeta
from .tokenizer import TextTokenizer


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No transformers progress bars while loading or saving weights (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class HFCache:
    """A transformers DynamicCache plus the live-slot mask that gives each row its own length."""

    def __init__(self, batch_size: int, capacity: int, device: torch.device) -> None:
        from transformers import DynamicCache

        self.past = DynamicCache()
        self.live = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, S]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] live tokens per row
        self.capacity = capacity

    def rewind(self, lengths: torch.Tensor) -> None:
        """Keep the first lengths[b] live tokens of each row; crop the tail no row uses."""
        lengths = lengths.to(torch.long)
        if bool((lengths > self.lengths).any()) or bool((lengths < 0).any()):
            raise ValueError("rewind can only shorten rows")
        self.live = self.live & (self.live.cumsum(1) <= lengths.view(-1, 1))
        used = self.live.any(0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else 0
        drop = self.live.shape[1] - keep
        if drop > 0:
            self.live = self.live[:, :keep]
            self.past.crop(-drop)  # a negative count removes that many (old and new transformers)
        self.lengths = lengths.clone()

    def select_rows(self, rows: torch.Tensor) -> None:
        self.past.batch_select_indices(rows)
        self.live = self.live[rows]
        self.lengths = self.lengths[rows].clone()

    def reserve_for(self, other) -> None:  # joins copy the rows (nothing to prepare)
        pass

    def tick(self) -> None:
        pass

    def add_rows(self, other: HFCache) -> None:
        """Admission between rounds: transformers' caches keep one length for all rows, which
        this adapter does not re-pad; run admitted requests on our lean runtime instead."""
        raise SpecDecodeError(
            "run.add needs a model on our lean runtime (Llama checkpoints); the transformers "
            "adapter runs a batch from start to end"
        )


class HFModel:
    """A transformers causal LM: forward(tokens [B, T], cache, meta) -> (logits [B, T, V], hidden)."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        # transformers 5.x renamed past_key_values to cache; accept both
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.dtype = dtype
        self.vocab_size = int(model.config.vocab_size)
        # learned absolute positions (GPT-2 family) cap the sequence length; RoPE models don't
        self.max_positions: int | None = getattr(model.config, "n_positions", None)
        self.name = ""
        self.path = Path()
        self.tokenizer: TextTokenizer | None = None
        self.eos_token_ids: tuple[int, ...] = ()

    # capabilities: transformers' forward takes plain causal chains only
    lean = False
    supports_invariant = False
    hybrid = False

    @staticmethod
    def from_dir(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> HFModel:
        from transformers import AutoModelForCausalLM

        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        return HFModel(model.to(device), dtype)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def new_cache(self, batch_size: int, capacity: int) -> HFCache:
        return HFCache(batch_size, capacity, self.device)

    @torch.no_grad()
    def forward(
        self, tokens: torch.Tensor, cache: HFCache, meta: ForwardMeta = PLAIN
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Plain causal forwards only (trees, early exits and feature drafters need our runtime);
        the hidden states returned are the model's last layer output."""
        special = (meta.tree_mask, meta.positions, meta.num_layers, meta.inputs_embeds)
        if any(x is not None for x in special) or meta.offset or not meta.advance:
            raise SpecDecodeError("token trees, early exit and EAGLE need a Llama model on our lean runtime")
        B, T = tokens.shape
        pos = cache.lengths.view(B, 1) + torch.arange(T, device=tokens.device).view(1, T)
        live = torch.cat([cache.live, torch.ones(B, T, dtype=torch.bool, device=tokens.device)], dim=1)
        out = self.model(
            input_ids=tokens,
            attention_mask=live.long(),
            position_ids=pos,
            use_cache=True,
            output_hidden_states=meta.return_hidden,
            **{self._cache_arg: cache.past},
        )
        cache.past = getattr(out, "cache", None) or out.past_key_values
        cache.live = live
        cache.lengths = cache.lengths + T
        hidden = out.hidden_states[-1].to(self.dtype) if meta.return_hidden else None
        return out.logits.to(self.dtype), hidden
