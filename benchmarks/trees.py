"""Sampled-candidate trees against chains at T = 1: tokens per target forward, same drafter.

    .venv/bin/python benchmarks/trees.py              # both bundled families and smollm2-135m
    .venv/bin/python benchmarks/trees.py --quick      # fewer prompts and tokens

For each target and drafter it runs the same prompts and seeds (T = 1, ignore EOS) with a chain
of k = the tree's depth, a chain of k = the tree's node count (the same node budget), and the
tree with each candidate rule: topk (top-ranked, accepted with p(x)), with-replacement
(SpecInfer) and without-replacement (Sequoia). Tokens per target forward is a count, not a time,
so the table does not depend on what else the machine runs. Writes OUT/trees.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from specdecode import SamplingParams, SpecDecodeError, SpeculativeGenerator, load  # noqa: E402
from specdecode.bench.prompts import CODE, PROSE  # noqa: E402
from specdecode.core.tree import TokenTree  # noqa: E402
from specdecode.engine.stats import GenerationStats  # noqa: E402
from specdecode.opener import method_heads  # noqa: E402

CHAT = [
    "What is speculative decoding?",
    "Write a short poem about the sea.",
    "Give three tips for learning to cook.",
    "Explain what a hash table is.",
]
# target, drafter (a draft model path or a method), prompts, dtype
CASES = [
    ("three-kingdoms/target", "three-kingdoms/draft-64", PROSE, torch.float32),
    ("three-kingdoms/target", "medusa", PROSE, torch.float32),
    ("three-kingdoms/target", "eagle", PROSE, torch.float32),
    ("python-code/target", "python-code/draft", CODE, torch.float32),
    ("python-code/target", "medusa", CODE, torch.float32),
    ("python-code/target", "eagle", CODE, torch.float32),
    ("smollm2-135m", "eagle3", CHAT, torch.bfloat16),
]


def run(gen, prompts, tokens: int, seeds: int) -> dict:
    jobs = [(p, s) for p in prompts for s in range(seeds)]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=s, ignore_eos=True) for _, s in jobs
    ]
    t0 = time.perf_counter()
    results = gen.generate([p for p, _ in jobs], params)
    st = GenerationStats.merge([r.stats for r in results], time.perf_counter() - t0)
    return {
        "tokens_per_forward": st.tokens_per_forward,
        "tokens": st.new_tokens,
        "forwards": st.target_forwards,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default="4,2,1", help="tree shape (default 4,2,1: 20 nodes, depth 3)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "trees"))
    ap.add_argument("--only", help="only cases whose target or drafter contains this")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tree = TokenTree.parse(args.tree)
    n_prompts, tokens, seeds = (2, 32, 2) if args.quick else (4, 64, 3)
    rows = []
    for target_name, drafter, prompts, dtype in CASES:
        if args.only and args.only not in target_name + drafter:
            continue
        target = load(target_name, dtype=dtype)
        prompts = list(prompts[:n_prompts])
        if target_name == "smollm2-135m":
            prompts = [[{"role": "user", "content": p}] for p in prompts]
        if "/" in drafter:
            opts = {"draft": load(drafter, dtype=dtype)}
        else:
            opts = {"method": drafter, "heads": method_heads(target_name, drafter, None)}
        row = {"target": target_name, "drafter": drafter.rsplit("/", 1)[-1], "tree": args.tree}
        variants = [
            (f"chain k={tree.depth}", {"k": tree.depth}),
            (f"chain k={tree.size}", {"k": tree.size}),
            *[
                (f"tree {s}", {"tree": args.tree, "tree_sampling": s})
                for s in ("topk", "with-replacement", "without-replacement")
            ],
        ]
        for name, extra in variants:
            try:
                gen = SpeculativeGenerator(target, **opts, **extra)
                row[name] = run(gen, prompts, tokens, seeds)
            except SpecDecodeError as e:  # Medusa drafts at most one position per head
                print(target_name, drafter, name, "skipped:", e, flush=True)
                row[name] = None
                continue
            print(target_name, drafter, name, f"{row[name]['tokens_per_forward']:.3f}", flush=True)
        rows.append(row)
    (out / "trees.json").write_text(json.dumps(rows, indent=2))
    names = [k for k in rows[0] if k not in ("target", "drafter", "tree")]
    lines = [
        f"# Token trees vs chains at T = 1: tokens per target forward (tree {args.tree}, "
        f"{tree.size} nodes, depth {tree.depth})",
        "",
        f"{n_prompts} prompts x {seeds} seeds x {tokens} tokens per cell, ignore EOS. "
        "Chain k = depth: the same forward depth; chain k = nodes: the same node budget.",
        "",
        "| target | drafter | " + " | ".join(names) + " | best tree / best chain |",
        "|---|---|" + "---|" * len(names) + "---|",
    ]
    for r in rows:
        cells = [("-" if r[n] is None else f"{r[n]['tokens_per_forward']:.2f}") for n in names]
        chain = max(r[n]["tokens_per_forward"] for n in names if n.startswith("chain") and r[n])
        best = max(r[n]["tokens_per_forward"] for n in names if n.startswith("tree") and r[n])
        lines.append(f"| {r['target']} | {r['drafter']} | " + " | ".join(cells) + f" | {best / chain:.2f}x |")
    (out / "trees.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
