"""`specdecode generate`: one prompt through the engine, streamed, --json, --trace."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from ..config import POLICIES
from ..errors import SpecDecodeError

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch dtype names


def register(sub) -> None:
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
        "--method",
        help="drafting method: draft (default with --draft), ngram, early-exit, medusa, eagle, eagle3, "
        "suffix (SuffixDecoding: continue the longest suffix match in this and earlier requests), auto "
        "(suffix when a long match exists, the trained EAGLE-3 drafter otherwise; decided per round)",
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
        help="medusa / eagle / eagle3 / auto: the trained heads or drafter (default: the bundled one for "
        "the target, e.g. models/smollm2-135m/eagle3)",
    )
    g.add_argument(
        "--tree",
        metavar="CHOICES",
        help="verify a token tree in one forward: branching per depth (3,2,1) or JSON choices "
        "([[0],[1],[0,0]]); drafted by --draft, each node one of the draft's top-ranked tokens",
    )
    g.add_argument(
        "--rollback",
        choices=("snapshot", "recompute"),
        default=None,
        help="hybrid targets (linear-attention layers): undo a rejected draft's recurrent state from "
        "a snapshot per verified position (default) or by replaying the kept positions' inputs "
        "from the state before the round (less memory, a replay per round)",
    )
    g.add_argument(
        "--tree-sampling",
        choices=("topk", "with-replacement", "without-replacement"),
        default=None,
        help="how --tree's candidates are chosen: topk (default: the drafter's top-ranked tokens, "
        "best for greedy), with-replacement or without-replacement (drawn from the drafter's "
        "distribution and verified with SpecInfer's / Sequoia's exact multi-candidate rule: better "
        "at temperature > 0)",
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
    g.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user's message)")
    g.add_argument(
        "--chat",
        action="store_true",
        help="wrap --prompt as a user message in the model's own chat template (from its tokenizer "
        "files) and stop at the template's end-of-turn token",
    )
    g.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user's")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--trace", metavar="FILE.jsonl", help="write one JSON line per row per round")
    g.add_argument(
        "--cost-model",
        metavar="FILE.json",
        help="optimal policy: read the costs from FILE if it exists, else measure them on this run and "
        "write FILE (so the next run with the same --seed picks the same k)",
    )
    g.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    g.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="weight type (default fp32)")
    g.add_argument(
        "--draft-dtype",
        choices=tuple(DTYPES),
        help="the draft model's weight type (default --dtype): its precision never changes the output "
        "(the target verifies every token), only its cost",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a token's logits do not depend on how many drafts or rows share the target's forward: "
        "greedy speculative output equals target-only token for token in bf16 too (lean runtime, CPU; "
        "costs about 14%% of tokens/s in bf16 here, see docs/batch-invariance.md)",
    )
    g.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "lean", "hf"),
        help="model runtime: our lean Llama runtime, transformers, or auto (default)",
    )
    g.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from ..sampling import SamplingParams

    # validate everything cheap before loading any model
    if args.prompt == "":
        raise SpecDecodeError("--prompt is empty; give at least one character")
    if args.k < 1:
        raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
    if args.num_return_sequences < 1:
        raise SpecDecodeError(f"--num-return-sequences must be >= 1, got {args.num_return_sequences}")
    if args.policy not in POLICIES:
        raise SpecDecodeError(f"unknown --policy {args.policy!r}; choose one of {', '.join(POLICIES)}")
    if args.cost_model and args.policy != "optimal":
        raise SpecDecodeError("--cost-model is read by --policy optimal only")
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
    from ..engine import SpeculativeGenerator
    from ..models import load, resolve, resolve_device
    from ..policy import CostModel
    from ..stats import GenerationStats

    if args.system is not None and not args.chat:
        raise SpecDecodeError("--system needs --chat")
    import warnings

    import torch

    from ..drafters.early_exit import UntrainedExitWarning

    warnings.simplefilter("ignore", UntrainedExitWarning)  # printed below, with the measured acceptance
    device, dtype = resolve_device(args.device), getattr(torch, DTYPES[args.dtype])
    draft_dtype = getattr(torch, DTYPES[args.draft_dtype]) if args.draft_dtype else dtype
    if args.draft_dtype and not args.draft:
        raise SpecDecodeError("--draft-dtype needs --draft MODEL")
    resolve(args.target, dtype)
    if args.draft:
        resolve(args.draft, draft_dtype)
    cost_model = None
    if args.cost_model and Path(args.cost_model).exists():
        cost_model = CostModel.load(args.cost_model)
    target = load(args.target, backend=args.backend, dtype=dtype, device=device)
    draft = load(args.draft, backend=args.backend, dtype=draft_dtype, device=device) if args.draft else None
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
        tree_sampling=args.tree_sampling,
        rollback=args.rollback,
        heads=method_heads(args.target, args.method, args.heads, draft=args.draft),
        cost_model=cost_model,
        batch_invariant=args.batch_invariant or None,
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
    # sample i is seeded seed + i: a seed fixes a row's samples, so one seed for all would repeat one
    seeds = [None if args.seed is None else args.seed + i for i in range(n)]
    prompt = args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            prompt.insert(0, {"role": "system", "content": args.system})
    events = gen.stream([prompt] * n, [replace(params, seed=s) for s in seeds])
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
    if args.cost_model and cost_model is None and gen.cost_model is not None:
        gen.cost_model.save(args.cost_model)  # measured on this run: the next one reads it
    stats = GenerationStats.merge([r.stats for r in results], max(r.stats.wall_s for r in results))
    advice = gen.drafter.advice if gen.drafter is not None else None
    if advice:
        measured = (
            f"acceptance on this run {stats.acceptance_rate:.3f}" if stats.drafted else "nothing drafted"
        )
        print(f"specdecode: warning: {advice} ({measured})", file=sys.stderr)
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


def method_heads(target: str, method: str | None, heads: str | None, draft: str | None = None) -> Path | None:
    """The trained drafter a method reads: required for medusa, eagle and eagle3; for auto the
    bundled (or given) EAGLE-3 drafter when there is one and no draft model is given."""
    if method in ("medusa", "eagle", "eagle3"):
        return heads_dir(target, method, heads)
    if method == "auto" and draft and not heads:
        return None  # auto's model drafter is the draft model
    if method == "auto":
        try:
            return heads_dir(target, "eagle3", heads)
        except SpecDecodeError:
            return None
    if heads:
        raise SpecDecodeError(f"--heads is read by methods medusa, eagle, eagle3 and auto, not {method!r}")
    return None


def heads_dir(target: str, method: str, heads: str | None) -> Path:
    """--heads, or the drafter bundled for the target (models/<family>/<method>, or
    models/<name>/<method> for a known name such as smollm2-135m)."""
    from ..models import ZOO, models_dir, resolve

    if heads:
        return Path(heads)
    bundled = (models_dir() / target if target in ZOO else resolve(target).parent) / method
    if not (bundled / "config.json").exists():
        what = {"medusa": "Medusa heads", "eagle3": "EAGLE-3 drafter"}.get(method, "EAGLE drafter")
        raise SpecDecodeError(f"no {what} for {target}; pass --heads DIR (see train-heads)")
    return bundled
