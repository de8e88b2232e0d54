"""`specdecode lab EXPERIMENT`: the lessons' experiments rerun on our models."""

from __future__ import annotations

import argparse
import sys

from ..errors import SpecDecodeError
from .common import Parser, show

LAB_HELP = {
    "roofline": "compute vs weight-read lower bounds per forward on GPUs and this CPU",
    "rules": "three acceptance rules drawn 200,000 times against the target's distribution",
    "greedy": "speculative greedy output == target greedy output (4 prompts x 2 drafts x k in {2,4})",
    "replay": "one sampled run, round by round (draft/target probs, uniforms, verdicts)",
    "formula": "measured tokens per forward vs (1 - a^(k+1))/(1 - a); per-position acceptance",
    "speedup": "speed-up vs k: Theorem 3.8 with measured alpha and c, next to wall clock",
    "lesson2": "lesson 001's toy pattern experiments, and its two errors measured",
    "methods": "every drafting method and policy: tokens per forward and speed-up, greedy and T = 1",
    "report": "run every experiment; write report.html (plots embedded) and report.json",
    "serve": "the interactive web lab at http://HOST:PORT/lab, on the live engine and models",
}


def register(sub) -> None:
    lab = sub.add_parser(
        "lab",
        help="rerun the lessons' experiments on the bundled models (tables, --json, --plot, report)",
        description="Every experiment of the two source lessons, rerun on our models. Defaults: target "
        "three-kingdoms/target, drafts three-kingdoms/draft-64 and draft-128, prompt 孔明曰：「.",
    )
    lab.set_defaults(func=_lab)
    exps = lab.add_subparsers(dest="experiment", required=True, parser_class=Parser, metavar="EXPERIMENT")
    for name, text in LAB_HELP.items():
        e = exps.add_parser(name, help=text, description=text)
        if name == "serve":
            e.description = (
                "The five interactive widgets (roofline, acceptance rules, replay, formula vs measured, "
                "live generation) in the browser at http://HOST:PORT/lab, backed by the real engine and the "
                "bundled models. `specdecode serve` serves the same page beside its API."
            )
            e.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
            e.add_argument("--port", type=int, default=8000, help="port (default 8000)")
            continue
        e.add_argument(
            "--target", default=None, metavar="MODEL", help="target model (default three-kingdoms/target)"
        )
        e.add_argument(
            "--draft",
            action="append",
            default=None,
            metavar="MODEL",
            help="draft model, repeatable (default three-kingdoms/draft-64 and draft-128)",
        )
        e.add_argument("--prompt", default=None, help="the prompt (default 孔明曰：「)")
        e.add_argument("--seed", type=int, default=0)
        e.add_argument("--quick", action="store_true", help="fewer draws and runs, for a fast look")
        e.add_argument("--no-progress", action="store_true", help="no progress bars")
        if name == "report":
            e.add_argument(
                "--out", required=True, metavar="DIR", help="writes DIR/report.html and DIR/report.json"
            )
            continue
        e.add_argument("--json", action="store_true", help="print every figure as one JSON object")
        e.add_argument("--plot", metavar="FILE.png", help="save the experiment's plot")
        if name == "roofline":
            e.add_argument(
                "--model", metavar="MODEL", help="a model directory or bundled name (its config.json)"
            )
            e.add_argument(
                "--params",
                type=float,
                help="parameter count instead of --model (default 25.63e9, the lesson's anchor)",
            )
            e.add_argument("--dtype", default="bf16", help="weight type: fp32, bf16, fp16, fp8, int8, int4")
            e.add_argument("--k", type=int, default=4, help="draft tokens: compare 1 and k + 1 positions")
        if name == "rules":
            e.add_argument("--draws", type=int, default=None, help="draws per rule (default 200,000)")
        if name == "replay":
            e.add_argument("--trace", metavar="FILE.jsonl", help="replay a `generate --trace` file instead")
            e.add_argument("--k", type=int, default=4)
            e.add_argument("--max-new-tokens", type=int, default=32)
        if name == "formula":
            e.add_argument("--k", type=int, default=4)


def _lab(args: argparse.Namespace) -> int:
    if args.experiment == "serve":
        return _serve(args)
    from ..lab import LabConfig, run_experiment
    from ..lab.common import DRAFTS, PROMPTS, TARGET, family_prompts
    from ..models import resolve

    target = args.target or TARGET
    drafts = tuple(args.draft) if args.draft else DRAFTS
    for m in (target, *drafts):
        resolve(m)
    if args.prompt == "":
        raise SpecDecodeError("--prompt is empty; give at least one character")
    known = family_prompts(resolve(target)) or PROMPTS
    prompt = args.prompt or known[0]
    prompts = (prompt, *[p for p in known if p != prompt])[:4]
    cfg = LabConfig(target, drafts, prompt, prompts, args.seed, args.quick, progress=not args.no_progress)
    name = args.experiment
    if name == "report":
        from ..lab.report import write_report

        html, js, results = write_report(cfg, args.out)
        failed = [f"{r.name}:{c}" for r in results.values() for c, ok in r.checks.items() if not ok]
        print(
            f"wrote {html} and {js}" + (f"; checks failing: {', '.join(failed)}" if failed else ""),
            file=sys.stderr,
        )
        return 0
    options = {}
    if name == "roofline":
        if args.k < 1:
            raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
        options = {"model": args.model, "params": args.params, "dtype": args.dtype, "k": args.k}
    elif name == "rules" and args.draws is not None:
        if args.draws < 100:
            raise SpecDecodeError(f"--draws must be >= 100, got {args.draws}")
        options = {"draws": args.draws}
    elif name == "replay":
        if args.k < 1 or args.max_new_tokens < 1:
            raise SpecDecodeError("--k and --max-new-tokens must be >= 1")
        options = {"trace": args.trace, "k": args.k, "new_tokens": args.max_new_tokens}
    elif name == "formula":
        if args.k < 1:
            raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
        options = {"k": args.k}
    return show(run_experiment(name, cfg, **options), args)


def _serve(args: argparse.Namespace) -> int:
    import socket

    if not 0 <= args.port <= 65535:
        raise SpecDecodeError(f"--port must be in 0..65535, got {args.port}")
    try:
        import uvicorn

        from ..lab.web import create_lab_app
    except ImportError as e:
        raise SpecDecodeError(
            f"the web lab needs the serve and lab extras ({e.name} is missing): "
            "pip install 'specdecode[serve,lab]'"
        ) from None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise SpecDecodeError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    host, port = sock.getsockname()[:2]
    print(f"specdecode lab: open http://{host}:{port}/lab (Ctrl-C stops)", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(create_lab_app(), log_level="warning"))
    server.run(sockets=[sock])
    return 0
