"""`specdecode bench`: our engine against Hugging Face transformers, and the scaling study."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..formats import WEIGHT_FORMATS
from .options import DTYPE_HELP, add_sampling_rule_flag, add_spec_flags


def register(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="benchmark our engine against transformers (and llama.cpp) on any model or the bundled ones",
        description="With --target MODEL: time our target-only decoding and --method (or --draft) against "
        "transformers' generate, prompt lookup and (with --draft) assisted generation on the same checkpoint "
        "and --dtype, and llama.cpp when llama-cpp-python is installed, per prompt category of --prompts "
        "(spec-bench: Spec-Bench's mt_bench, translation, summarization, qa, math_reasoning, rag), batch 1; "
        "reports tokens/s, tokens per target forward (tau), speed-ups, greedy identity with transformers, "
        "the verification cost T(k+1)/T(1), the memory floor and the fraction of it reached; writes "
        "model-bench.json and model-bench.md to --out. "
        "Without --target: the bundled families. Time transformers' generate, assisted generation "
        "(our draft, same k, and its defaults) "
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
        "--prompts",
        metavar="SOURCE",
        help="with --target: spec-bench (default), humaneval (82 HumanEval tasks; pass@1 of the greedy "
        'completions is reported beside the speed) or a JSONL file of {"turns"|"prompt"|"text", '
        '"category"}; without: prompts per bundled set, 1..4 (default 4, quick 2)',
    )
    t = b.add_argument_group("any model (--target)")
    t.add_argument(
        "--target", metavar="MODEL", help="known name (smollm2-135m), bundled name or model directory"
    )
    t.add_argument("--draft", metavar="MODEL", help="draft model (method draft; adds transformers assisted)")
    add_spec_flags(t, ("method", "heads", "tree", "policy", "ngram_max", "ngram_min", "draft_dtype"))
    t.add_argument(
        "--category", action="append", help="only these categories (repeatable; default all of --prompts)"
    )
    t.add_argument("--limit", type=int, help="prompts per category (default all; --quick 2)")
    t.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    t.add_argument(
        "--dtype", default=None, choices=("auto", *WEIGHT_FORMATS), metavar="FORMAT", help=DTYPE_HELP
    )
    t.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when it is installed")
    t.add_argument(
        "--invariance",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run ours target-only and ours METHOD with --batch-invariant (prompts whose greedy output "
        "differs from target-only, the cost, a batch of 8); default on, off for the known real models",
    )
    b.add_argument("--temperature", type=float, action="append", help="repeatable (default 0 and 1)")
    b.add_argument(
        "--transformers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the transformers baselines (default on; with --target off for the known real models, whose "
        "float copy costs gigabytes and minutes)",
    )
    b.add_argument("--seed", type=int, default=0)
    add_sampling_rule_flag(b)
    b.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N (models and caches)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "--scaling", action="store_true", help="run the context-length and batch-size study instead"
    )
    b.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from ..bench import BenchConfig, run_bench, save
    from ..errors import SpecDecodeError
    from ..models import resolve_device

    progress = not args.no_progress and sys.stderr.isatty()
    if args.target:
        if args.scaling or args.family:
            raise SpecDecodeError("--target benchmarks one model; drop --scaling / --family")
        return _bench_model(args, progress)
    for flag in ("draft", "method", "heads", "tree", "category", "limit", "chat"):
        if getattr(args, flag):
            raise SpecDecodeError(f"--{flag} needs --target MODEL")
    prompts_per_set = None
    if args.prompts is not None:
        try:
            prompts_per_set = int(args.prompts)
        except ValueError:
            raise SpecDecodeError(
                f"--prompts {args.prompts}: without --target it is a number of prompts per set (1..4)"
            ) from None
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
            prompts_per_set=prompts_per_set,
            temperatures=tuple(args.temperature) if args.temperature else None,
            transformers=args.transformers is not False,
            seed=args.seed,
            sampling_rule=args.sampling_rule,
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


def _bench_model(args: argparse.Namespace, progress: bool) -> int:
    from ..bench.model_bench import ModelBenchConfig, markdown, run_model_bench, save_model_bench
    from ..models import resolve_device

    temps = args.temperature or [0.0]
    if len(temps) > 1:
        from ..errors import SpecDecodeError

        raise SpecDecodeError("with --target give one --temperature")
    cfg = ModelBenchConfig.make(
        quick=args.quick,
        target=args.target,
        draft=args.draft,
        method=args.method,
        heads=args.heads,
        tree=args.tree,
        k=args.k,
        policy=args.policy,
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
        prompts=args.prompts or "spec-bench",
        categories=tuple(args.category or ()),
        per_category=args.limit,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=temps[0],
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        device=str(resolve_device(args.device)),
        transformers=args.transformers,
        llama_cpp=not args.no_llama_cpp,
        invariance=args.invariance,
        seed=args.seed,
        sampling_rule=args.sampling_rule,
        progress=progress,
    )
    log = lambda msg: print(msg, file=sys.stderr)
    results = run_model_bench(cfg, log=log)
    paths = save_model_bench(results, Path(args.out))
    if args.json:
        print(json.dumps(results, ensure_ascii=False, default=float))
    else:
        print(markdown(results))
    log("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
