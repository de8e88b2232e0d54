"""The Spec-Bench prompts that `bench --limit 15` leaves out (the 16th on of each category):
greedy ngram against target-only, both with batch_invariant=True, batch 1; and ngram 8 to a
batch against batch 1. SmolLM2-135M-Instruct, bf16, chat template, 128 tokens.

    python benchmarks/smollm2/invariance/rest_of_spec_bench.py 15 > rest-of-spec-bench.json
"""

import json
import sys
import time

import torch

from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.bench.model_bench import _encode, _first_difference, read_prompts

skip = int(sys.argv[1])
target = load("smollm2-135m", dtype=torch.bfloat16)
prompts = read_prompts("spec-bench")
cats = {}
for p in prompts:
    cats.setdefault(p["category"], []).append(p)
base = SpeculativeGenerator(target, batch_invariant=True)
ng = SpeculativeGenerator(target, method="ngram", k=4, batch_invariant=True)
out = {}
t0 = time.time()
for c, ps in cats.items():
    ids = [_encode(target, p["text"], True) for p in ps[skip:]]
    params = [
        SamplingParams(temperature=0, max_new_tokens=128, seed=i, ignore_eos=True) for i in range(len(ids))
    ]
    want = [base.generate([x], [q])[0].token_ids for x, q in zip(ids, params)]
    got = [ng.generate([x], [q])[0].token_ids for x, q in zip(ids, params)]
    b8 = []
    for i in range(0, len(ids), 8):
        b8 += [r.token_ids for r in ng.generate(ids[i : i + 8], params[i : i + 8])]
    out[c] = {
        "prompts": len(ids),
        "ngram_vs_target_only_differ": sum(a != b for a, b in zip(got, want)),
        "batch8_vs_batch1_differ": sum(a != b for a, b in zip(b8, got)),
        "first_differences": [_first_difference(a, b) for a, b in zip(got, want) if a != b],
    }
    print(c, out[c], round(time.time() - t0), file=sys.stderr, flush=True)
result = {"skipped_per_category": skip, "max_new_tokens": 128, "dtype": "bf16", "categories": out}
json.dump(result, sys.stdout, indent=1)
