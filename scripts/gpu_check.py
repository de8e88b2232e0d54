"""The GPU check: greedy identity and the two-token distribution test (with its negative
control) on a device, e.g. `python scripts/gpu_check.py --device cuda`. Prints one JSON object.
Runs on the CPU too (--device cpu), which is how it is tested where no GPU is lent."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import specdecode.engine.verify as verify_mod  # noqa: E402
from helpers import check_distribution, noisy_copy, two_token_joint  # noqa: E402
from specdecode import SamplingParams, SpeculativeGenerator, load  # noqa: E402
from specdecode.models.init import init_model  # noqa: E402

METHODS = {
    "draft k=4": dict(k=4),
    "draft optimal": dict(k=4, policy="optimal"),
    "draft tree 4,2,1": dict(tree="4,2,1"),
    "ngram": dict(k=4, method="ngram"),
    "early-exit": dict(k=4, method="early-exit", exit_layer=2),
    "medusa": dict(k=4, method="medusa", heads="models/three-kingdoms/medusa"),
    "eagle": dict(k=4, method="eagle", heads="models/three-kingdoms/eagle"),
    "eagle tree 4,2,1": dict(method="eagle", heads="models/three-kingdoms/eagle", tree="4,2,1"),
}


def greedy_identity(device: str) -> dict:
    """Every method's greedy tokens == target-only greedy tokens on the bundled pair, batch 4."""
    target = load("three-kingdoms/target", device=device)
    draft = load("three-kingdoms/draft-64", device=device)
    prompts = ["孔明曰：「", "卻說曹操", "玄德大喜", "關公"]
    params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    want = [r.token_ids for r in SpeculativeGenerator(target).generate(prompts, params)]
    out = {}
    for name, kw in METHODS.items():
        uses_draft = kw.get("method", "draft") == "draft"
        gen = SpeculativeGenerator(target, draft=draft if uses_draft else None, **kw)
        got = gen.generate(prompts, params)
        out[name] = {
            "identical": [r.token_ids for r in got] == want,
            "tokens_per_forward": sum(r.stats.new_tokens for r in got)
            / sum(r.stats.target_forwards for r in got),
        }
    return out


def two_token(device: str, runs: int, biased: bool) -> dict:
    """TV + chi-square of 2-token samples against the target's joint (vocab 16, k = 2, fp32)."""
    root = Path(tempfile.mkdtemp())
    t = init_model(root / "t", vocab=16, layers=2, dim=32, heads=2, seed=5, init_std=0.5)
    d = noisy_copy(t, root / "d", noise=0.15, seed=6)
    target, draft = load(t, device=device), load(d, device=device)
    prompt = [5, 9, 2]
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=0, ignore_eos=True)
    real = verify_mod.verify_chain
    if biased:  # negative control: redraw a rejected position from p, not from the residual

        def resample_from_p(tokens, q, p, u, noise, n=None):
            v = real(tokens, q, p, u, noise, n)
            B = tokens.shape[0]
            at = v.accepted.view(B, 1, 1).expand(B, 1, p.shape[-1])
            redraw = (p.gather(1, at).squeeze(1) / noise).argmax(-1)
            kept = v.tokens.gather(1, v.accepted.view(B, 1)).squeeze(1)
            v.tokens.scatter_(
                1, v.accepted.view(B, 1), torch.where(v.accepted < v.draft_lengths, redraw, kept).view(B, 1)
            )
            return v

        verify_mod.verify_chain = resample_from_p
    try:
        t0 = time.perf_counter()
        res = SpeculativeGenerator(target, draft=draft, k=2).generate(
            [prompt] * runs, [replace(params, seed=i) for i in range(runs)]
        )
        seconds = time.perf_counter() - t0
    finally:
        verify_mod.verify_chain = real
    pairs = np.array([r.token_ids[0] * 16 + r.token_ids[1] for r in res])
    cpu_target = load(t)
    ok, msg = check_distribution(pairs, two_token_joint(cpu_target, prompt))
    return {"consistent_with_target": ok, "detail": msg, "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=60_000)
    args = ap.parse_args()
    out = {
        "device": args.device,
        "name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "greedy_identity": greedy_identity(args.device),
        "two_token": two_token(args.device, args.runs, biased=False),
        "two_token_negative_control": two_token(args.device, args.runs, biased=True),
    }
    ok = (
        all(v["identical"] for v in out["greedy_identity"].values())
        and out["two_token"]["consistent_with_target"]
        and not out["two_token_negative_control"]["consistent_with_target"]
    )
    out["passed"] = ok
    print(json.dumps(out, ensure_ascii=False, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
