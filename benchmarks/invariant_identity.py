"""A seed fixes the text on a real model: SmolLM2-135M-Instruct in bf16 with the batch-invariant
forward, seeded T = 1 samples under the invariant rule, each drafter's text against seeded
target-only decoding's, token for token: alone and 8 to a batch.

    .venv/bin/python benchmarks/invariant_identity.py --per-category 16 --max-new-tokens 64

(96 Spec-Bench chat prompts, 16 from each of the 6 categories; about 40 minutes on this 2-core
AVX2 CPU, where bf16 has no native support.)
Writes benchmarks/sampling-rules/identity-smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdecode import SamplingParams, SpeculativeGenerator, load  # noqa: E402
from specdecode.bench.model_bench import read_prompts  # noqa: E402
from specdecode.progress import bar  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-category", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "sampling-rules" / "identity-smollm2.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    by_cat = defaultdict(list)
    for p in read_prompts("spec-bench"):
        if len(by_cat[p["category"]]) < args.per_category:
            by_cat[p["category"]].append(p["text"])
    chats = [[{"role": "user", "content": t}] for ts in by_cat.values() for t in ts]
    target = load("smollm2-135m", dtype=torch.bfloat16)
    heads = ROOT / "models" / "smollm2-135m" / "eagle3"
    params = [
        SamplingParams(
            temperature=1.0,
            seed=1000 + i,
            max_new_tokens=args.max_new_tokens,
            ignore_eos=True,
            sampling_rule="invariant",
        )
        for i in range(len(chats))
    ]
    t0 = time.perf_counter()
    base = SpeculativeGenerator(target, batch_invariant=True)
    want = [base.generate([c], p)[0].token_ids for c, p in bar(list(zip(chats, params)), "target-only")]
    report = {"prompts": len(chats), "max_new_tokens": args.max_new_tokens, "runs": {}}
    configs = {
        "eagle3 k=4": dict(method="eagle3", heads=heads, k=4),
    }
    for name, kw in configs.items():
        gen = SpeculativeGenerator(target, batch_invariant=True, **kw)
        alone = [gen.generate([c], p)[0] for c, p in bar(list(zip(chats, params)), f"{name} alone")]
        diffs = [i for i, r in enumerate(alone) if r.token_ids != want[i]]
        batched = []
        for s in bar(range(0, len(chats), 8), f"{name} 8 to a batch"):
            batched += [r.token_ids for r in gen.generate(chats[s : s + 8], params[s : s + 8])]
        bdiffs = [i for i, ids in enumerate(batched) if ids != want[i]]
        report["runs"][name] = {
            "alone_differences": len(diffs),
            "batch8_differences": len(bdiffs),
            "accepted": sum(r.stats.accepted for r in alone),
            "tested": sum(r.stats.tested for r in alone),
            "tau": sum(len(r.token_ids) for r in alone) / sum(r.stats.target_forwards for r in alone),
        }
        print(name, report["runs"][name], file=sys.stderr)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
