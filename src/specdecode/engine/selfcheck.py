"""The cache self-check (SPECDECODE_CHECK_KV=1): a debugging aid for exactness under load.

Greedy decoding under load gives speculation-off's tokens only if every row's cached keys and
values are the ones a whole prefill of its tokens writes, however its prompt was fed (in chunks,
riding other rows' rounds, continued from prefix-cache blocks) and whatever it was decoded
beside. With the check on, a Generation compares each row with such a prefill when the row joins
the batch and when it leaves it, and says on stderr where they differ (the layer, keys or values,
the first slot, how many and the largest difference): an ulp or two is rounding, a whole key's
worth another token or position. Only batch-invariant caches can be checked (elsewhere the bits of a
chunked prefill legitimately differ). It costs one prefill per admission and per finished row,
so it is for finding a bug, not for serving."""

from __future__ import annotations

import os
import sys

import torch

from ..models.cache import KVCache

ENABLED = os.environ.get("SPECDECODE_CHECK_KV") == "1"


def _slots(cache: KVCache, layer: int, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b's keys and values of one layer at slots 0 .. n - 1, each [kv_heads, n, head_dim]
    (values read back from the invariant cache's chunk-major layout)."""
    k = cache.k[layer, b, :, :n]
    v = cache.v[layer, :, b] if cache.invariant else cache.v[layer, b]
    if cache.invariant:  # [chunks, kv_heads, 64, D] -> [kv_heads, chunks * 64, D]
        v = v.permute(1, 0, 2, 3).reshape(cache.kv_heads, -1, cache.head_dim)
    return k, v[:, :n]


@torch.inference_mode()
def mismatches(spec, tokens: torch.Tensor, cache, b: int) -> list[tuple[int, str, int, int, float]]:
    """Where row b of `cache` (holding tokens [1, n], n = its length) differs from a whole
    prefill of those tokens in a fresh cache: (layer, "keys" or "values", first slot, slots,
    largest difference)."""
    if not (isinstance(cache, KVCache) and cache.invariant):
        return []
    target = spec.target
    n = int(cache.lengths[b])
    if n == 0:
        return []
    riders = getattr(target, "riders", None)
    if riders is not None:  # prompt chunks waiting for the next round must not ride this forward
        target.riders = []
    try:
        fresh = spec.new_cache(1, n + 1)
        target.forward(tokens[:, :n], fresh)
    finally:
        if riders is not None:
            target.riders = riders
    out = []
    for layer in range(len(cache.layer_k)):
        pairs = zip(("keys", "values"), _slots(cache, layer, b, n), _slots(fresh, layer, 0, n))
        for name, got, want in pairs:
            if not torch.equal(got, want):
                bad = (got != want).any(-1).any(0).nonzero().flatten()
                out.append((layer, name, int(bad[0]), len(bad), float((got - want).abs().max())))
    return out


def check_row(spec, rows, cache, b: int, when: str) -> bool:
    """Check row b of a batch (rows, its cache); say on stderr if it differs. True if it does not."""
    bad = mismatches(spec, rows.tokens[b : b + 1], cache, b)
    if bad:
        layer, name, first, count, largest = bad[0]
        total = 2 * len(cache.layer_k)
        print(
            f"specdecode: KV self-check: row {rows.ids[b]} ({int(cache.lengths[b])} tokens, {when}) differs "
            f"from a whole prefill: layer {layer}'s {name} at {count} slot(s) from slot {first} first "
            f"(by up to {largest:.3g}), {len(bad)} of {total} layer keys/values in all",
            file=sys.stderr,
            flush=True,
        )
    return not bad
