"""What the batch-invariant forward costs, per model we ship: target-only greedy decoding with the
invariant forward and with the plain one, on specdecode's kernel ("new": float32 products and the
fused layers, the kernel's RoPE + attention) and on the torch path ("old": torch's products,
InvariantAttention), the four interleaved in one process (fastest of --reps), plus a 128-token
invariant prefill on each. Never needed by CI.

    .venv/bin/python benchmarks/invariance.py                                   # every shipped model
    .venv/bin/python benchmarks/invariance.py --models smollm2-135m:bf16 --reps 6

Prints one line per model: tokens/s of the four, new invariant / new plain (the price: >= 0.95
is the issue's target), new invariant / old plain, old invariant / old plain, the prefills, and
whether the invariant runs gave the same tokens.
"""

from __future__ import annotations

import argparse
import os
import time

MODELS = (
    "smollm2-135m:fp32",
    "smollm2-135m:bf16",
    "three-kingdoms/target:fp32",
    "python-code/target:fp32",
    "qwen2.5-coder-1.5b:kq",
)
PROMPTS = {
    "three-kingdoms/target": "孔明曰：「",
    "python-code/target": "def",
}
CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def measure(name: str, dtype: str, reps: int, tokens: int) -> str:
    import torch

    import specdecode
    import specdecode.models.linear as linear
    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.models.llama import LlamaModel

    class TorchPath(LlamaModel):  # the same model with the kernel's attention (and fused layers) off
        kernel_attention = property(lambda self: False)

    new = specdecode.open(name, dtype=dtype, log=lambda line: None).target
    old = None
    if dtype != "kq":  # a kq model has no torch path: its products are the kernel
        linear.float_kernel.cache_clear()
        os.environ["SPECDECODE_LINEAR"] = "packed"
        try:
            old = specdecode.open(name, dtype=dtype, log=lambda line: None).target
        finally:
            os.environ.pop("SPECDECODE_LINEAR")
            linear.float_kernel.cache_clear()
        old.__class__ = TorchPath
    gens = {"new inv": SpeculativeGenerator(new, batch_invariant=True)}
    gens["new plain"] = SpeculativeGenerator(new, batch_invariant=False)
    if old is not None:
        gens["old inv"] = SpeculativeGenerator(old, batch_invariant=True)
        gens["old plain"] = SpeculativeGenerator(old, batch_invariant=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    prompt = [PROMPTS.get(name, CODE)]
    for g in gens.values():
        g.generate(prompt, params)
    speed: dict[str, float] = {k: 0.0 for k in gens}
    out: dict[str, list[int]] = {}
    for _ in range(reps):
        for k, g in gens.items():
            t0 = time.perf_counter()
            got = g.generate(prompt, params)[0].token_ids
            speed[k] = max(speed[k], len(got) / (time.perf_counter() - t0))
            out[k] = got
    ids = torch.randint(0, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
    prefill = {}
    for k, m in (("new", new), ("old", old)):
        if m is None:
            continue
        best = min(_timed_prefill(m, ids) for _ in range(3))
        prefill[k] = 128 / best
    line = f"{name} ({dtype}): " + ", ".join(f"{k} {v:.1f}" for k, v in speed.items()) + " tok/s"
    line += f" | price: new inv / new plain {speed['new inv'] / speed['new plain']:.3f}"
    if old is not None:
        line += f", new inv / old plain {speed['new inv'] / speed['old plain']:.3f}"
        line += f", old inv / old plain {speed['old inv'] / speed['old plain']:.3f}"
        line += f" | invariant prefill, 128 tokens: new {prefill['new']:.0f} tok/s, old {prefill['old']:.0f}"
        line += f" | invariant runs gave the same tokens: {out['new inv'] == out['old inv']}"
    return line


def _timed_prefill(model, ids) -> float:
    cache = model.new_cache(1, ids.shape[1] + 8, invariant=True)
    t0 = time.perf_counter()
    model.forward(ids, cache)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="NAME:FORMAT (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repeats; the fastest is kept")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens a run")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    for spec in args.models:
        name, _, dtype = spec.partition(":")
        print(measure(name, dtype or "fp32", args.reps, args.tokens), flush=True)


if __name__ == "__main__":
    main()
