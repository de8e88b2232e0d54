"""Before/after output check for refactors: a fixed set of runs (every method, chains and trees,
policies, greedy and seeded sampling, a batch with a row admitted mid-run) on the bundled models
and smollm2-135m in bf16 with --batch-invariant; the token ids of every row go to a JSON file.

    python benchmarks/parity.py --out before.json          # on the old commit
    python benchmarks/parity.py --compare before.json      # on the new one: 0 differences or exit 1

A refactor that claims "no behaviour change" must give the same greedy tokens and the same
seeded samples. benchmarks/parity-cb38cc3.json holds the rows of commit cb38cc3 (before issue 25)
on this project's 2-core AVX2 machine; bf16 rows may differ on a CPU with other kernels (AVX-512
BF16), so write a fresh baseline there from the old commit."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import replace

import torch

from specdecode import SamplingParams, SpeculativeGenerator, load
from specdecode.drafters.early_exit import UntrainedExitWarning

warnings.simplefilter("ignore", UntrainedExitWarning)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, seed=3, ignore_eos=True)

CODE = ["def fibonacci(n):\n", "import os\n\nclass Path", "    for i in range(len(items)):\n"]
STORY = ["孔明曰：「", "却说曹操", "玄德大喜"]
CHAT = ["Write a haiku about the sea.", "List three prime numbers.", "one two three four five six"]

# (target, draft, dtype, options) runs; each runs greedy and seeded-sampled on its prompts
CASES: list[tuple[str, str | None, str, dict]] = [
    ("python-code/target", None, "fp32", {}),
    ("python-code/target", "python-code/draft", "fp32", {"method": "draft"}),
    ("python-code/target", "python-code/draft", "fp32", {"method": "draft", "tree": "3,2,1"}),
    (
        "python-code/target",
        "python-code/draft",
        "fp32",
        {"method": "draft", "tree": "2,2,1", "tree_sampling": "with-replacement"},
    ),
    (
        "python-code/target",
        "python-code/draft",
        "fp32",
        {"method": "draft", "tree": "2,2,1", "tree_sampling": "without-replacement"},
    ),
    ("python-code/target", "python-code/draft", "fp32", {"method": "draft", "policy": "heuristic"}),
    ("python-code/target", "python-code/draft", "fp32", {"method": "draft", "policy": "confidence"}),
    ("python-code/target", None, "fp32", {"method": "ngram"}),
    ("python-code/target", None, "fp32", {"method": "suffix"}),
    ("python-code/target", None, "fp32", {"method": "early-exit", "exit_layer": 3}),
    ("python-code/target", None, "fp32", {"method": "medusa", "heads": "models/python-code/medusa"}),
    (
        "python-code/target",
        None,
        "fp32",
        {"method": "medusa", "heads": "models/python-code/medusa", "tree": "2,2"},
    ),
    ("python-code/target", None, "fp32", {"method": "eagle", "heads": "models/python-code/eagle"}),
    (
        "python-code/target",
        None,
        "fp32",
        {"method": "eagle", "heads": "models/python-code/eagle", "tree": "3,2,1"},
    ),
    ("python-code/target", "python-code/draft", "fp32", {"method": "auto"}),
    ("three-kingdoms/target", "three-kingdoms/draft-64", "fp32", {"method": "draft", "k": 3}),
    ("three-kingdoms/target", None, "fp32", {"method": "eagle", "heads": "models/three-kingdoms/eagle"}),
    ("three-kingdoms/hybrid", "three-kingdoms/draft-64", "fp32", {"method": "draft"}),
    (
        "three-kingdoms/hybrid",
        "three-kingdoms/draft-64",
        "fp32",
        {"method": "draft", "rollback": "recompute"},
    ),
    ("smollm2-135m", None, "bf16", {"batch_invariant": True}),
    (
        "smollm2-135m",
        None,
        "bf16",
        {"method": "eagle3", "heads": "models/smollm2-135m/eagle3", "k": 3, "batch_invariant": True},
    ),
    (
        "smollm2-135m",
        None,
        "bf16",
        {"method": "eagle3", "heads": "models/smollm2-135m/eagle3", "tree": "2,2,1", "batch_invariant": True},
    ),
    (
        "smollm2-135m",
        None,
        "bf16",
        {"method": "auto", "heads": "models/smollm2-135m/eagle3", "batch_invariant": True},
    ),
    ("smollm2-135m", None, "bf16", {"method": "ngram", "batch_invariant": True}),
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prompts_for(target: str) -> list[str]:
    return CODE if "python" in target else STORY if "kingdoms" in target else CHAT


def run_all() -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    models: dict[tuple[str, str], object] = {}

    def get(name: str, dtype: str):
        if (name, dtype) not in models:
            models[name, dtype] = load(name, dtype=DTYPES[dtype])
        return models[name, dtype]

    for target, draft, dtype, options in CASES:
        t = get(target, dtype)
        d = get(draft, dtype) if draft else None
        for label, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
            key = f"{target} | {draft} | {dtype} | {json.dumps(options, sort_keys=True)} | {label}"
            gen = SpeculativeGenerator(t, draft=d, **options)
            prompts = prompts_for(target)
            # a batch of two, then the third admitted after two rounds
            plist = [replace(params, seed=None if params.seed is None else params.seed + i) for i in range(3)]
            run = gen.stream(prompts[:2], plist[:2])
            for _ in range(2):
                next(run, None)
            run.add(prompts[2], plist[2])
            rows = [r.token_ids for r in run.results()]
            # and the same prompts alone in one batch
            rows += [r.token_ids for r in gen.generate(prompts, plist)]
            out[key] = rows
            print(f"{key}: {sum(len(r) for r in rows)} tokens", file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the token ids here")
    ap.add_argument("--compare", help="compare with a file written by --out; exit 1 on any difference")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    got = run_all()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(got, f)
    if args.compare:
        with open(args.compare) as f:
            want = json.load(f)
        diffs = [k for k in want if got.get(k) != want[k]]
        missing = [k for k in want if k not in got]
        runs = sum(len(v) for v in want.values())
        print(
            f"{len(want)} configurations, {runs} rows compared: {len(diffs)} differ, {len(missing)} missing"
        )
        for k in diffs:
            print("  differs:", k)
        return 1 if diffs or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
