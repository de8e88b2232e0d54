"""The `specdecode` command. Bad input: one line on stderr and exit code 2, no traceback."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import SpecDecodeError

POLICIES = ("fixed", "heuristic", "confidence", "optimal")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specdecode",
        description="Exact speculative decoding: a drafter proposes k tokens, the target checks "
        "them in one forward pass, and the output keeps the target's distribution.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser(
        "generate",
        help="generate text from a prompt (speculative when --draft or --method is given)",
        description="Generate from TARGET. With --draft (or --method) the drafter proposes --k tokens "
        "per round and TARGET verifies them in one forward; without, plain target-only decoding. "
        "Sampling output follows TARGET's distribution exactly; --temperature 0 gives TARGET's "
        "greedy tokens.",
    )
    g.add_argument("--target", required=True, metavar="MODEL", help="bundled name or Hugging Face model dir")
    g.add_argument("--draft", metavar="MODEL", help="draft model sharing the target's vocabulary")
    g.add_argument(
        "--method", help="drafting method: draft (default with --draft), ngram, early-exit, medusa, eagle"
    )
    g.add_argument(
        "--k", type=int, default=4, help="draft tokens per round (default 4; the start for adaptive policies)"
    )
    g.add_argument(
        "--policy",
        default="fixed",
        help="draft-length policy: fixed (k every round), heuristic (+2 after a fully accepted round, -1 "
        "otherwise), confidence (stop drafting when the draft's probability of its token < "
        "--confidence-threshold), optimal (k from Theorem 3.8 with measured acceptance and cost)",
    )
    g.add_argument(
        "--confidence-threshold", type=float, default=0.4, help="for --policy confidence (default 0.4)"
    )
    g.add_argument(
        "--exit-layer",
        type=int,
        default=None,
        help="early-exit: draft with the first M layers (default half)",
    )
    g.add_argument("--ngram-max", type=int, default=3, help="ngram: longest suffix to look up (default 3)")
    g.add_argument("--ngram-min", type=int, default=1, help="ngram: shortest suffix to look up (default 1)")
    g.add_argument(
        "--heads",
        metavar="DIR",
        help="medusa / eagle: the trained heads or drafter (default: the bundled one next to the target)",
    )
    g.add_argument(
        "--tree",
        metavar="CHOICES",
        help="verify a token tree in one forward: branching per depth (3,2,1) or JSON choices "
        "([[0],[1],[0,0]]); drafted by --draft, each node one of the draft's top-ranked tokens",
    )
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below P x the top probability")
    g.add_argument("--seed", type=int, default=None, help="random seed (default: fresh randomness)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    g.add_argument(
        "--num-return-sequences", type=int, default=1, help="independent samples, run as one batch"
    )
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going after the end-of-text token")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--trace", metavar="FILE.jsonl", help="write one JSON line per row per round")
    g.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "lean", "hf"),
        help="model runtime: our lean Llama runtime, transformers, or auto (default)",
    )

    m = sub.add_parser(
        "init-model",
        help="write a random-initialised Llama checkpoint with a matching tokenizer",
        description="Write a random Llama checkpoint directory (config.json, model.safetensors, "
        "tokenizer files) that transformers and specdecode load offline. For tests and experiments.",
    )
    m.add_argument("out", metavar="OUT", help="output directory")
    m.add_argument(
        "--vocab", type=int, required=True, help="vocabulary size (>= 258 gives a byte-level tokenizer)"
    )
    m.add_argument("--layers", type=int, required=True)
    m.add_argument("--dim", type=int, required=True, help="hidden size")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--heads", type=int, default=None, help="attention heads (default dim // 32, at least 1)")
    m.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default = heads)")
    m.add_argument("--init-std", type=float, default=0.02, help="std of the random weights (default 0.02)")
    t = sub.add_parser(
        "train",
        help="train a model family (tokenizer + target + drafts) on a corpus",
        description="Train a byte-level BPE tokenizer on CORPUS (5%% held out), then every model of the "
        "family on the same token stream for the same number of steps. Each model directory keeps "
        "its lowest held-out loss checkpoint (fp16 safetensors, Hugging Face format).",
    )
    t.add_argument("--corpus", required=True, metavar="FILE|DIR", help="a text file, or a directory of files")
    t.add_argument("--family", required=True, help="three-kingdoms or python-code")
    t.add_argument("--out", required=True, metavar="DIR", help="writes DIR/<model>/ for every model")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (family default)")
    t.add_argument("--seq-len", type=int, default=None, help="tokens per training sequence (family default)")
    t.add_argument("--batch-size", type=int, default=None, help="sequences per step (family default)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (family default)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    t.add_argument("--resume", action="store_true", help="continue the unfinished run in --out")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    t.add_argument("--models", default="", help="comma-separated models of the family to train (default all)")
    t.add_argument(
        "--early-exit-layer",
        type=int,
        default=0,
        help="also train the target to predict from its first M layers (for --method early-exit)",
    )
    t.add_argument("--early-exit-weight", type=float, default=0.5, help="weight of that auxiliary loss")
    c = sub.add_parser(
        "model-card",
        help="write MODEL_CARD.md for every model of a trained family",
        description="Write MODEL_CARD.md into every model directory under DIR from its training.json, "
        "measuring each draft's acceptance against the family's target (k = 4, T = 1 and T = 0) on "
        "prompts from the held-out 5%% of the corpus.",
    )
    c.add_argument("dir", metavar="DIR", help="a family directory written by `specdecode train`")
    c.add_argument(
        "--corpus", default=None, help="the training corpus (default: the path recorded at training)"
    )
    c.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    c.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    d = sub.add_parser(
        "demo",
        help="speculative decoding on the bundled model pairs, coloured, with the measured speed-up",
        description="Run the bundled three-kingdoms and python-code pairs: stream the text with each token "
        "coloured by how it was produced (accepted draft / resampled / bonus), then a table of acceptance, "
        "tokens per target forward, the formula (1 - a^(k+1))/(1 - a), and the wall-clock speed-up over "
        "target-only decoding measured in the same run.",
    )
    d.add_argument("--k", type=int, default=4, help="draft tokens per round (default 4)")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--repeats", type=int, default=3, help="timed runs per decoding mode (default 3)")
    d.add_argument("--json", action="store_true", help="also print the table rows as JSON")
    h = sub.add_parser(
        "train-heads",
        help="train draft heads (Medusa) on a frozen target's features",
        description="Train Medusa heads for TARGET on CORPUS: head i reads the target's final hidden state "
        "and predicts the token i + 2 places ahead through the target's own LM head. The target is frozen. "
        "Writes OUT/config.json and OUT/heads.safetensors (fp16); use them with "
        "generate --method medusa --heads OUT.",
    )
    h.add_argument("--method", default="medusa", help="medusa (default) or eagle")
    h.add_argument("--target", required=True, metavar="MODEL", help="bundled name or model directory")
    h.add_argument("--corpus", required=True, metavar="FILE|DIR", help="the target's training corpus")
    h.add_argument("--out", required=True, metavar="DIR")
    h.add_argument("--heads", type=int, default=4, help="number of heads (default 4)")
    h.add_argument("--steps", type=int, default=400)
    h.add_argument("--batch-size", type=int, default=16)
    h.add_argument("--seq-len", type=int, default=128)
    h.add_argument("--lr", type=float, default=1e-3)
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--no-progress", action="store_true")
    _add_lab(sub)
    _add_plan(sub)
    _add_bench(sub)
    return parser


def _train_heads(args: argparse.Namespace) -> int:
    from .models import resolve

    if args.method not in ("medusa", "eagle"):
        raise SpecDecodeError(f"train-heads --method must be medusa or eagle, got {args.method!r}")
    resolve(args.target)
    if not Path(args.corpus).exists():
        raise SpecDecodeError(f"corpus {args.corpus} not found; pass the target's training text")
    from .train.heads import train_eagle, train_medusa

    common = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        progress=not args.no_progress,
    )
    if args.method == "eagle":
        meta = train_eagle(args.target, args.corpus, args.out, **common)
        done = f"EAGLE drafter, held-out top-1 {meta['heldout_top1']:.3f}"
    else:
        meta = train_medusa(args.target, args.corpus, args.out, num_heads=args.heads, **common)
        accs = " ".join(f"{a:.3f}" for a in meta["heldout_top1_per_head"])
        done = f"{meta['num_heads']} heads, held-out top-1 per head {accs}"
    print(f"wrote {args.out}: {done}, {meta['train_seconds']:.0f} s", file=sys.stderr)
    if resolve(args.target).joinpath("training.json").exists():  # held-out prompts need the family
        from .train.model_card import write_heads_card

        print(f"wrote {write_heads_card(args.out, args.target, args.corpus)}", file=sys.stderr)
    return 0


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
}


def _add_lab(sub) -> None:
    lab = sub.add_parser(
        "lab",
        help="rerun the lessons' experiments on the bundled models (tables, --json, --plot, report)",
        description="Every experiment of the two source lessons, rerun on our models. Defaults: target "
        "three-kingdoms/target, drafts three-kingdoms/draft-64 and draft-128, prompt 孔明曰：「.",
    )
    exps = lab.add_subparsers(dest="experiment", required=True, parser_class=_Parser, metavar="EXPERIMENT")
    for name, text in LAB_HELP.items():
        e = exps.add_parser(name, help=text, description=text)
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


def _add_plan(sub) -> None:
    from .plan import PRESETS

    p = sub.add_parser(
        "plan",
        help="predict speculative decoding speed-ups for big models on GPUs, by roofline simulation",
        description="Simulate speculative decoding for a target and draft on a GPU: per-round time from the "
        "roofline (weights + KV cache bytes vs operations for k + 1 positions x batch), tokens per round "
        "from alpha, and the speed-up over target-only decoding by batch size and k, with the best k per "
        f"batch. Model presets: {', '.join(PRESETS)}; or a config.json / model directory, or a parameter "
        "count such as 8e9.",
    )
    p.add_argument("--target", default="llama-3.1-8b", help="target model (default llama-3.1-8b)")
    p.add_argument("--draft", default="eagle3-llama-3.1-8b", help="draft model (default eagle3-llama-3.1-8b)")
    p.add_argument("--hardware", default="h100-sxm", help="h100-sxm, h200, a100, rtx-4090 or cpu (measured)")
    p.add_argument("--alpha", default="0.8", help="acceptance rate, or comma-separated per-position rates")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each row's KV cache")
    p.add_argument("--batch", default="1,2,4,8,16,32,64,128,256,512", help="comma-separated batch sizes")
    p.add_argument("--max-k", type=int, default=8, help="largest k to consider (default 8)")
    p.add_argument("--dtype", default="bf16", help="weight and KV type (default bf16)")
    p.add_argument("--compute-efficiency", type=float, default=1.0, help="achieved fraction of peak FLOPs")
    p.add_argument("--bandwidth-efficiency", type=float, default=1.0, help="achieved fraction of bandwidth")
    p.add_argument(
        "--verify-tokens",
        type=int,
        default=0,
        help="positions the target checks per row per round, for token trees (default k + 1, a chain)",
    )
    p.add_argument("--json", action="store_true", help="print every figure as one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="save the speed-up vs batch plot")


def _add_bench(sub) -> None:
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
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "--scaling", action="store_true", help="run the context-length and batch-size study instead"
    )


def _bench(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, run_bench, save

    progress = not args.no_progress and sys.stderr.isatty()
    if args.scaling:
        from .bench.scaling import ScalingConfig, run_scaling, save_scaling

        scfg = ScalingConfig.make(quick=args.quick, families=tuple(args.family) if args.family else None,
                                  k=args.k, seed=args.seed, progress=progress)
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
        )
        results = run_bench(cfg)
        paths = save(results, Path(args.out))
    if args.json:
        print(json.dumps(results, ensure_ascii=False, default=float))
    else:
        print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def _numbers(text: str, flag: str, kind=float) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecDecodeError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def _show(result, args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.plot:
        result.save_plot(args.plot)
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False, default=float))
    else:
        result.print(Console() if sys.stdout.isatty() else Console(width=200))
        if args.plot:
            print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .plan import run_plan

    result = run_plan(
        target=args.target,
        draft=args.draft,
        hardware=args.hardware,
        alphas=tuple(_numbers(args.alpha, "--alpha")),
        context=args.context,
        batches=tuple(_numbers(args.batch, "--batch", int)),
        max_k=args.max_k,
        dtype=args.dtype,
        compute_efficiency=args.compute_efficiency,
        bandwidth_efficiency=args.bandwidth_efficiency,
        verify_tokens=args.verify_tokens,
    )
    return _show(result, args)


def _lab(args: argparse.Namespace) -> int:
    from .lab import LabConfig, run_experiment
    from .lab.common import DRAFTS, PROMPTS, TARGET, family_prompts
    from .models import resolve

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
        from .lab.report import write_report

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
    return _show(run_experiment(name, cfg, **options), args)


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .sampling import SamplingParams

    if args.k < 1:
        raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
    if args.repeats < 1:
        raise SpecDecodeError(f"--repeats must be >= 1, got {args.repeats}")
    SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)  # validates
    rows = run_demo(
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        repeats=args.repeats,
    )
    if args.json:
        print(json.dumps(rows))
    return 0


def _model_card(args: argparse.Namespace) -> int:
    from .train.model_card import write_model_cards

    if args.prompts < 1 or args.new_tokens < 1:
        raise SpecDecodeError("--prompts and --new-tokens must be >= 1")
    if not Path(args.dir).is_dir():
        raise SpecDecodeError(
            f"{args.dir} is not a directory; pass a family directory written by `specdecode train`"
        )
    for path in write_model_cards(args.dir, args.corpus, prompts=args.prompts, new_tokens=args.new_tokens):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _train(args: argparse.Namespace) -> int:
    from .train.families import FAMILIES
    from .train.trainer import train_family

    family = FAMILIES.get(args.family)
    if family is None:
        raise SpecDecodeError(f"unknown --family {args.family!r}; choose one of {', '.join(FAMILIES)}")
    result = train_family(
        family,
        args.corpus,
        args.out,
        steps=family.steps if args.steps is None else args.steps,
        seq_len=family.seq_len if args.seq_len is None else args.seq_len,
        batch_size=family.batch_size if args.batch_size is None else args.batch_size,
        lr=family.lr if args.lr is None else args.lr,
        seed=args.seed,
        resume=args.resume,
        eval_every=args.eval_every,
        progress=not args.no_progress,
        early_exit_layer=args.early_exit_layer,
        early_exit_weight=args.early_exit_weight if args.early_exit_layer else 0.0,
        only=tuple(m for m in args.models.split(",") if m),
    )
    from .train.model_card import write_model_cards

    write_model_cards(args.out, args.corpus)
    for m in result["models"]:
        print(
            f"{args.out}/{m['name']}: {m['params']:,} params, best held-out loss {m['best_val_loss']:.4f} "
            f"at step {m['best_step']}, {m['train_seconds']:.0f} s",
            file=sys.stderr,
        )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .sampling import SamplingParams

    # validate everything cheap before loading any model
    if args.prompt == "":
        raise SpecDecodeError("--prompt is empty; give at least one character")
    if args.k < 1:
        raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
    if args.num_return_sequences < 1:
        raise SpecDecodeError(f"--num-return-sequences must be >= 1, got {args.num_return_sequences}")
    if args.policy not in POLICIES:
        raise SpecDecodeError(f"unknown --policy {args.policy!r}; choose one of {', '.join(POLICIES)}")
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    from .engine import SpeculativeGenerator
    from .models import load, resolve
    from .stats import GenerationStats

    resolve(args.target)
    if args.draft:
        resolve(args.draft)
    target = load(args.target, backend=args.backend)
    draft = load(args.draft, backend=args.backend) if args.draft else None
    gen = SpeculativeGenerator(
        target,
        draft=draft,
        k=args.k,
        method=args.method,
        policy=args.policy,
        exit_layer=args.exit_layer,
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
        confidence_threshold=args.confidence_threshold,
        tree=args.tree,
        heads=_heads_dir(args) if args.method in ("medusa", "eagle") else None,
    )
    n = args.num_return_sequences
    trace = None
    if args.trace:
        try:
            trace = open(args.trace, "w", encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise SpecDecodeError(f"cannot write --trace file {args.trace}: {e.strerror}") from None
    # stream as rounds finish (not with stop strings: the stop text must not be shown)
    stream_text = not args.json and n == 1 and target.tokenizer is not None and not args.stop
    shown = ""
    events = gen.stream([args.prompt] * n, [params] * n)
    tokens: list[int] = []
    try:
        for event in events:
            if trace is not None:
                for rec in event.records():
                    trace.write(json.dumps(rec.to_dict(), ensure_ascii=False) + "\n")
            if stream_text and event.emitted:
                tokens.extend(event.emitted[0])
                text = target.tokenizer.decode(tokens)
                if text.startswith(shown) and not text.endswith("\ufffd"):  # only complete characters
                    sys.stdout.write(text[len(shown) :])
                    sys.stdout.flush()
                    shown = text
    finally:
        if trace is not None:
            trace.close()
    results = events.results()
    stats = GenerationStats.merge([r.stats for r in results], results[0].stats.wall_s)
    if args.json:
        out = {"text": results[0].text, "token_ids": results[0].token_ids}
        if n > 1:
            out["samples"] = [{"text": r.text, "token_ids": r.token_ids} for r in results]
        out["stats"] = stats.to_dict()
        print(json.dumps(out, ensure_ascii=False))
        return 0
    if stream_text:
        rest = results[0].text[len(shown) :] if results[0].text.startswith(shown) else ""
        print(rest)
    else:
        for i, r in enumerate(results):
            if n > 1:
                print(f"--- sample {i}")
            print(r.text if target.tokenizer is not None else r.token_ids)
    print(
        f"[{stats.new_tokens} tokens in {stats.wall_s:.2f} s, {stats.tokens_per_s:.1f} tokens/s; "
        f"{stats.rounds} rounds, {stats.tokens_per_forward:.2f} tokens per target forward"
        + (f", acceptance {stats.acceptance_rate:.2f}]" if stats.drafted else "]"),
        file=sys.stderr,
    )
    return 0


def _heads_dir(args: argparse.Namespace) -> Path:
    from .models import resolve

    if args.heads:
        return Path(args.heads)
    bundled = resolve(args.target).parent / args.method
    if not (bundled / "config.json").exists():
        what = "Medusa heads" if args.method == "medusa" else "EAGLE drafter"
        raise SpecDecodeError(f"no {what} for {args.target}; pass --heads DIR (see train-heads)")
    return bundled


def _init_model(args: argparse.Namespace) -> int:
    from .models.init import init_model

    out = init_model(
        args.out,
        vocab=args.vocab,
        layers=args.layers,
        dim=args.dim,
        seed=args.seed,
        heads=args.heads,
        kv_heads=args.kv_heads,
        init_std=args.init_std,
    )
    print(f"wrote a random Llama checkpoint to {Path(out)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "train":
            return _train(args)
        if args.command == "model-card":
            return _model_card(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "lab":
            return _lab(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "train-heads":
            return _train_heads(args)
        if args.command == "bench":
            return _bench(args)
        return _init_model(args)
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
