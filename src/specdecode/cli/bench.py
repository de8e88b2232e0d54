"""`specdecode bench`: our engine against Hugging Face transformers, and the scaling study."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="benchmark our engine against Hugging Face transformers on the bundled models",
        description="Time transformers' generate, assisted generation (our draft, same k, and its defaults) "
        "and prompt lookup against our target-only decoding and every drafting method and policy, on both "
        "bundled families and their prompt sets (prose or code, plus an edit/repeat set), greedy and T = 1, "
        "batch 1, in one process with interleaved repeats after a warm-up. Reports tokens/s (median, "
        "min-max), ms/token, tokens per target forward, speed-ups over each baseline, Theorem 3.8's "
        "prediction from the measured alpha and c (engine efficiency) and the target's verification cost "
        "T(k+1)/T(1); writes bench.json, bench.md and bench.png to --out. --scaling instead measures "
        "per-token cost against context length and batch size (scaling.json/.md/.png).",
    )
    b.add_argument(
        "--quick", action="store_true", help="fewer configurations, prompts and tokens (< 3 minutes)"
    )
    b.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout")
    b.add_argument("--out", default="benchmarks/latest", help="directory for the JSON, markdown and plot")
    b.add_argument(
        "--family", action="append", help="three-kingdoms or python-code (repeatable; default both)"
    )
    b.add_argument("--k", type=int, help="draft tokens per round for the fixed configurations (default 4)")
    b.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 64, quick 48)")
    b.add_argument("--repeats", type=int, help="interleaved repeats (default 3)")
    b.add_argument(
        "--prompts", type=int, dest="prompts_per_set", help="prompts per set, 1..4 (default 4, quick 2)"
    )
    b.add_argument("--temperature", type=float, action="append", help="repeatable (default 0 and 1)")
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N (models and caches)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "--scaling", action="store_true", help="run the context-length and batch-size study instead"
    )
    b.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from ..bench import BenchConfig, run_bench, save
    from ..models import resolve_device

    progress = not args.no_progress and sys.stderr.isatty()
    if args.scaling:
        from ..bench.scaling import ScalingConfig, run_scaling, save_scaling

        scfg = ScalingConfig.make(
            quick=args.quick,
            families=tuple(args.family) if args.family else None,
            k=args.k,
            seed=args.seed,
            progress=progress,
        )
        results = run_scaling(scfg)
        paths = save_scaling(results, Path(args.out))
    else:
        cfg = BenchConfig.make(
            quick=args.quick,
            families=tuple(args.family) if args.family else None,
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            prompts_per_set=args.prompts_per_set,
            temperatures=tuple(args.temperature) if args.temperature else None,
            transformers=not args.no_transformers,
            seed=args.seed,
            progress=progress,
            device=str(resolve_device(args.device)),
        )
        results = run_bench(cfg)
        paths = save(results, Path(args.out))
    if args.json:
        print(json.dumps(results, ensure_ascii=False, default=float))
    else:
        print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0
