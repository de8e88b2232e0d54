"""What one forward of the lean runtime does, decided once before its layers: the RoPE tables
for its positions, where its keys and values are written (slices for rows at one length, index
writes for ragged rows and trees), which attention runs (SDPA's causal kernel, SDPA with an
additive mask, or the batch-invariant attention of models/invariant.py) and what the layers
capture. `LlamaModel.forward` is embed -> blocks -> norm -> head reading this plan.

The common case (every row at the same length, a plain causal chain) runs on slices with
Python-int positions: no gathers, no index writes, and no mask at all for T = 1. A cache made
with invariant=True selects the batch-invariant forward: attention from models/invariant.py,
norms reduced in float32, GEMM rows padded where the kernel needs it. A prefill from an empty
cache stays on SDPA's causal kernel (it is the same call for a prompt whatever is decoded after
it; the engine prefills such rows one at a time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..errors import SpecDecodeError
from .base import ForwardMeta
from .cache import KEY_CHUNK, chunked, write_chunked
from .invariant import InvariantAttention, KernelAttention


class PlannedModel(Protocol):
    """What plan_forward reads of a model (our lean runtime's LlamaModel): its config, dtype and
    RoPE tables (grown on demand)."""

    cfg: Any
    dtype: torch.dtype
    _cos: torch.Tensor
    _sin: torch.Tensor

    def _rope_tables(self, need: int) -> None: ...


# scaled_dot_product_attention(enable_gqa=...) arrived in torch 2.5
_SDPA_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclass
class ForwardPlan:
    layers: list  # the layers to run (an early exit runs the first num_layers)
    cos: torch.Tensor  # RoPE tables at the tokens' positions, [1 or B, T, 1, D]
    sin: torch.Tensor
    S: int  # key slots visible to the new tokens
    start: int | None  # the one write slot of every row (aligned rows), else None
    slots: torch.Tensor | None  # [B, T] write slots (ragged rows, trees)
    causal: bool  # SDPA's causal kernel over the new tokens (a prefill from an empty cache)
    mask: torch.Tensor | None  # additive mask for SDPA (None: T = 1 or causal)
    attention: Any  # InvariantAttention, or None
    invariant: bool
    d_eps: float  # hidden * eps: RMSNorm's eps with the √d folded into the weights
    aux_layers: tuple[int, ...]  # the layers whose input stream is captured
    advance: bool  # move the cache lengths past the new tokens
    offset: int
    parents: torch.Tensor | None  # linear-attention layers over a tree: each node's parent
    shape: tuple[int, int, int, int, int]  # B, T, H, Hkv, D

    def write_kv(self, layer_k, layer_v, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values [B, Hkv, T, D] into one layer's cache; return what the
        attention reads (the new ones for invariant attention and causal prefills, whose
        float32 cache holds a copy; else the cache's first S slots)."""
        B, T = self.shape[:2]
        if self.slots is None:
            layer_k.narrow(2, self.start, T).copy_(k)
            if self.invariant:
                write_chunked(layer_v, self.start, v)
            else:
                layer_v.narrow(2, self.start, T).copy_(v)
        else:  # ragged rows or a tree: one index write per layer, the checks done once
            pos, rows = self.slots, torch.arange(B, device=k.device).view(B, 1).expand(B, T)
            layer_k[rows, :, pos] = k.transpose(1, 2).to(layer_k.dtype)
            if self.invariant:  # chunk-major values: slot = (chunk, offset)
                layer_v[pos // KEY_CHUNK, rows, :, pos % KEY_CHUNK] = v.transpose(1, 2).to(layer_v.dtype)
            else:
                layer_v[rows, :, pos] = v.transpose(1, 2)
        if self.invariant:
            return k, v
        return layer_k.narrow(2, 0, self.S), layer_v.narrow(2, 0, self.S)

    def attend(self, q, keys, values, layer_k, layer_v) -> torch.Tensor:
        """Attention of the new queries [B, T, H, D] -> [B * T, H * D]. Grouped-query attention
        without copying K/V: the G query heads of each kv head fold into the query-length axis."""
        B, T, H, Hkv, D = self.shape
        if self.attention is not None:
            return self.attention(q, layer_k, layer_v)
        if self.causal:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, is_causal=True, enable_gqa=H > Hkv
            )
            return out.transpose(1, 2).reshape(B * T, H * D)
        q = q.transpose(1, 2).reshape(B, Hkv, (H // Hkv) * T, D)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask)
        return out.view(B, H, T, D).transpose(1, 2).reshape(B * T, H * D)


def plan_forward(model: PlannedModel, tokens: torch.Tensor, cache, meta: ForwardMeta) -> ForwardPlan:
    """The plan of `model`'s forward over tokens [B, T] into `cache` as `meta` asks."""
    positions, tree_mask, offset = meta.positions, meta.tree_mask, meta.offset
    c = model.cfg
    B, T = tokens.shape
    dev = tokens.device
    D, G = c.head_dim, c.num_heads // c.num_kv_heads
    start = cache.aligned_start()  # the one length of every row, or None
    inv = getattr(cache, "invariant", False)
    kernel = inv and getattr(model, "kernel_attention", False)  # KernelAttention, else InvariantAttention
    allowed = mask = slots = None  # allowed: [B or 1, T, S] the slots each token sees (invariant)
    causal = False
    if start is not None and positions is None and tree_mask is None:
        s = start + offset
        S = s + T
        if S > cache.capacity:
            raise SpecDecodeError(
                f"sequence longer than the cache ({cache.capacity} tokens); lower max_new_tokens"
            )
        model._rope_tables(S)
        cos, sin = model._cos[s:S].view(1, T, 1, D), model._sin[s:S].view(1, T, 1, D)
        # query t sees keys 0..s+t; one causal block over the new tokens (T = 1: no mask).
        # additive (0 / -inf): SDPA would convert a bool mask in every layer. A prefill from an
        # empty cache (s = 0) is SDPA's causal kernel with GQA (900 tokens: 10.6 vs 16.8 ms a layer),
        # except in the batch-invariant forward: SDPA's result for a query depends on how many
        # queries share the call, and a prompt prefilled in chunks, or continued from cached
        # blocks (prefill.py, prefix.py), must get the keys and values a whole prefill writes
        causal = s == 0 and T > 1 and _SDPA_GQA and not inv
        if kernel:
            pass  # KernelAttention.causal below: every row's token t sees slots 0 .. s + t
        elif inv and not causal:
            allowed = torch.arange(S, device=dev).view(1, 1, S) <= torch.arange(s, S, device=dev).view(
                1, T, 1
            )
        elif not (T == 1 or causal):
            mask = torch.full((T, S), float("-inf"), dtype=model.dtype, device=dev).triu_(s + 1)
            if G > 1:
                mask = mask.repeat(G, 1)
    else:
        s = None
        slots = cache.positions(T, offset)  # [B, T] cache slots
        rope_pos = slots if positions is None else positions
        model._rope_tables(int(rope_pos.max()) + 1)
        cos, sin = model._cos[rope_pos].unsqueeze(2), model._sin[rope_pos].unsqueeze(2)  # [B, T, 1, D]
        S = int(slots.max()) + 1
        if tree_mask is None:
            allowed = torch.arange(S, device=dev).view(1, 1, S) <= slots.view(B, T, 1)
        else:
            rel = torch.arange(S, device=dev).view(1, S) - cache.lengths.view(B, 1)  # [B, S]
            W = tree_mask.shape[1]
            block = tree_mask[:, rel.clamp(0, W - 1)].permute(1, 0, 2)  # [B, T, S]
            allowed = (rel < 0).unsqueeze(1) | (block & (rel < W).unsqueeze(1))
        if not inv:
            blocked = torch.zeros(allowed.shape, dtype=model.dtype, device=dev).masked_fill_(
                ~allowed, float("-inf")
            )
            mask = blocked.unsqueeze(1).repeat(1, 1, G, 1)  # [B, 1, G*T, S], additive
    attention = None
    if kernel and s is not None:
        attention = KernelAttention.causal(B, s, T, D, model.dtype, dev)
        attention.slots = torch.arange(s, S, dtype=torch.int32, device=dev).expand(B, T).contiguous()
    elif inv and allowed is not None:
        kind = KernelAttention if kernel else InvariantAttention
        # the kernel's attention reads each token's seen slots in slot order, which for a tree is
        # its logical order (a node's ancestors sit at lower slots: nodes are written level by
        # level), so it needs no order of its own, also for a tree level written past the length
        # (a draft model's tree, offset > 0); InvariantAttention's chunks need the logical order
        tree = {}
        if tree_mask is not None and kind is not KernelAttention:
            if offset:
                raise SpecDecodeError(
                    "a token tree written past the cache length needs the kernel's attention (kq)"
                )
            tree = _tree_order(tree_mask, cache.lengths, positions, S)
        attention = kind(allowed, B, c.num_kv_heads, G, D, model.dtype, **tree)
        if kind is KernelAttention:  # where each token's key and value go (the fused layers)
            write = torch.arange(s, s + T, device=dev).expand(B, T) if slots is None else slots
            attention.slots = write.to(torch.int32).contiguous()
    parents = None
    if tree_mask is not None and c.linear_layers:
        from .linear_attention import tree_parents

        parents = tree_parents(tree_mask)
    return ForwardPlan(
        layers=model.layers if meta.num_layers is None else model.layers[: meta.num_layers],
        cos=cos,
        sin=sin,
        S=S,
        start=s,
        slots=slots,
        causal=causal,
        mask=mask,
        attention=attention,
        invariant=inv,
        d_eps=c.hidden_size * c.rms_norm_eps,
        aux_layers=tuple(meta.aux_layers or ()) if meta.return_hidden else (),
        advance=meta.num_layers is None and meta.advance,
        offset=offset,
        parents=parents,
        shape=(B, T, c.num_heads, c.num_kv_heads, D),
    )


def _tree_order(tree_mask: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, S: int) -> dict:
    """For the invariant attention over a token tree written at slots lengths[b] + node: each
    node's slot of every logical position (committed tokens, then its ancestors by depth), which
    logical positions it sees, and how many leading key chunks are committed in every row."""
    B, T = positions.shape
    dev = lengths.device
    N = chunked(S)
    mask = tree_mask[:, :T].cpu()
    depth = mask.sum(1) - 1  # ancestors (and itself) seen past the row's length
    anc = torch.zeros(T, int(depth.max()) + 1, dtype=torch.long)
    for t in range(T):
        nodes = mask[t].nonzero().flatten()
        anc[t, depth[nodes]] = nodes  # the ancestor at each depth
    anc, depth = anc.to(dev), depth.to(dev)
    j = torch.arange(N, device=dev).view(1, 1, N)
    L = lengths.view(B, 1, 1)
    rel = (j - L).clamp(0, anc.shape[1] - 1).expand(B, T, N)  # depth of logical position j
    ancestor = anc.unsqueeze(0).expand(B, T, -1).gather(2, rel)
    order = torch.where(j < L, j, L + ancestor)
    seen = j <= L + depth.view(1, T, 1)
    return {"order": order, "logical_allowed": seen, "shared_chunks": int(lengths.min()) // KEY_CHUNK}
