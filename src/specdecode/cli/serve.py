"""`specdecode serve`: the OpenAI-compatible server (see docs/serving.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SpecDecodeError
from .options import add_format_flags, add_sampling_rule_flag, add_spec_flags, open_from_flags, spec_config


def register(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with continuous batching and exact speculative decoding",
        description="Serve TARGET over HTTP: POST /v1/completions and /v1/chat/completions (OpenAI's "
        "schema, streamed or not), GET /v1/models, /health and /metrics (Prometheus). One engine loop runs "
        "every active request as one batch, admitting new ones between rounds. Each response carries "
        "`usage` and a `speculative` object (drafted, accepted, tokens per forward, per-position "
        "acceptance). By default the draft length is capped by load, from round costs measured at start.",
    )
    s.add_argument(
        "--target",
        default="smollm2-135m",
        metavar="MODEL",
        help="bundled name or model dir (default smollm2-135m)",
    )
    s.add_argument(
        "--draft",
        metavar="MODEL",
        help="draft model sharing the target's vocabulary (bundled or zoo name, or a model dir), "
        "e.g. qwen2.5-coder-0.5b under --target qwen2.5-coder-1.5b",
    )
    s.add_argument(
        "--method",
        help="drafting method: draft (default with --draft), ngram, early-exit, medusa, eagle, eagle3, "
        "suffix, auto (suffix when a long match exists, else the draft model or the bundled EAGLE-3 "
        "drafter); 'none' for target-only. Default: auto for smollm2-135m, draft with --draft, else none",
    )
    spec = ("heads", "k", "policy", "tree", "tree_sampling")
    spec += ("draft_dtype", "draft_vocab", "draft_vocab_fallback")
    add_spec_flags(s, spec, k=None)
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument(
        "--max-batch", type=int, default=32, help="rows (choices) decoded together at most (default 32)"
    )
    s.add_argument(
        "--max-queue", type=int, default=256, help="requests waiting at most; more get HTTP 429 (default 256)"
    )
    s.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + max_tokens limit (default: the model's max_position_embeddings, else 2048)",
    )
    s.add_argument(
        "--max-tokens", type=int, default=256, help="max_tokens when a chat request gives none (default 256)"
    )
    s.add_argument("--served-model-name", metavar="NAME", help="the model id clients use (default: --target)")
    add_format_flags(
        s,
        invariant_help="a request's tokens do not depend on what else runs beside it: greedy and seeded "
        "requests give the same answer under any load (default on for our lean runtime on CPU; "
        "--no-batch-invariant: the plain forward, faster, about 14%% in bf16 here)",
    )
    add_sampling_rule_flag(
        s,
        default="auto",
        extra="the rule of requests that name none (the request field sampling_rule wins; default auto)",
    )
    s.add_argument(
        "--no-load-aware",
        action="store_true",
        help="draft the policy's k at any load (default: cap k each round by the measured cost at the "
        "running batch size, down to no drafting, so speculation never slows the server)",
    )
    s.add_argument(
        "--load-costs",
        metavar="FILE.json",
        help="read the load-aware round costs from FILE if it exists, else measure them and write FILE",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=_batched_tokens,
        default="auto",
        metavar="N|auto|0",
        help="chunked prefill: the tokens one engine iteration feeds the target at most, the decoding rows' "
        "and admitted prompts' together, so a long prompt is prefilled in chunks between the running rows' "
        "rounds instead of stalling them (vLLM's flag). auto (default): chunks sized from measured times to "
        "cost about 3/4 of a round, so a running stream's inter-token latency stays under 2x while a prompt "
        "is admitted; 0: prefill each prompt whole",
    )
    s.add_argument(
        "--carry-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a prefill chunk rides the running rows' round, one pass over the target's weights for "
        "both, as vLLM batches prefill and decode tokens (1.1-1.2x at c = 4 on the 1.5B pair; where the "
        "forward is batch-invariant, our runtime's default). Default on; --no-carry-prefill runs each "
        "chunk as a forward of its own",
    )
    s.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn automatic prefix caching off (default on: the keys and values of earlier prompts and "
        "answers are kept in 64-token blocks and reused by requests that start with the same tokens, "
        "e.g. a shared system prompt or a chat's earlier turns; exact, it needs the batch-invariant forward)",
    )
    s.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=1024,
        metavar="MB",
        help="memory the prefix cache may hold; the least recently used blocks go first (default 1024)",
    )
    s.add_argument(
        "--no-online-costs",
        action="store_true",
        help="keep the round costs measured at start (default: correct them from the rounds the server "
        "runs, so drafting turns itself off where it does not pay in service, and back on)",
    )
    s.set_defaults(func=_serve)


def _batched_tokens(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a token count >= 0 (0: off) or auto, got {value!r}")
    return n


def check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise SpecDecodeError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_batch", "max_queue", "max_tokens"):
        if getattr(args, flag) < 1:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise SpecDecodeError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    spec_config(args)  # k, policy, tree: SpecConfig's one-line errors before any model loads
    if args.load_costs and args.no_load_aware:
        raise SpecDecodeError("--load-costs is read by the load-aware policy; drop --no-load-aware")
    if args.prefix_cache_mb < 0:
        raise SpecDecodeError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    from ..opener import check_draft_dtype

    check_draft_dtype(args.draft_dtype, args.draft, args.method or "auto")


def build(args: argparse.Namespace):
    """The generator and server for these arguments (calibrated when load-aware)."""

    from ..engine import SpeculativeGenerator
    from ..engine.policy import LoadCosts, OnlineCosts
    from ..opener import default_method

    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        print(line.replace("specdecode:", "specdecode serve:", 1), file=sys.stderr)

    method = default_method(args.target, args.draft, args.method)
    loaded = open_from_flags(args, args.target, args.draft, method, say)
    if not said:  # nothing measured: still say which formats run, as every start does
        say(loaded.choice.line())
    target, draft, config = loaded.target, loaded.draft, loaded.config
    gen = SpeculativeGenerator(target, draft=draft, config=config)
    gen.choice = loaded.choice
    from ..serve import Server, batch_sizes

    warm_up(gen)
    if gen.drafter is not None and not args.no_load_aware:
        if args.load_costs and Path(args.load_costs).exists():
            table = LoadCosts.load(args.load_costs)
        else:
            table = calibrate(gen, batch_sizes(args.max_batch))
            if args.load_costs:
                table.save(args.load_costs)
        gen.load_costs = table if args.no_online_costs else OnlineCosts(table)
    if not args.no_prefix_cache and args.prefix_cache_mb > 0:
        try:
            gen.enable_prefix_cache(args.prefix_cache_mb << 20)
        except SpecDecodeError as e:
            print(f"specdecode serve: prefix cache off: {e}", file=sys.stderr)
    server = Server(
        gen,
        args.served_model_name or args.target,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_model_len=args.max_model_len,
        default_max_tokens=args.max_tokens,
        sampling_rule=args.sampling_rule,
        max_num_batched_tokens=args.max_num_batched_tokens or None,
        carry_prefill=args.carry_prefill,
    )
    return gen, server


def warm_up(gen) -> None:
    """One short greedy answer before serving, so first-use costs (the batch-invariant forward
    probes each weight format's row padding once, 1.1 s for the pair's int4 draft) are not paid
    by the first request that drafts: with round costs read from --load-costs nothing else runs
    the draft before then."""
    from ..core.sampling import SamplingParams

    prompt = [t % gen.target.vocab_size for t in range(1, 9)]
    gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))


def memory_line(gen, args: argparse.Namespace) -> str:
    """What the server holds in memory at start: each model's weights, the prefix cache's budget
    and the process's resident set."""
    import resource

    def gb(n: float) -> str:
        return f"{n / 1e9:.2f} GB"

    from ..models.quant import int8_kernels_summary

    parts = []
    weights = getattr(gen.target, "weight_bytes", None)
    if weights is not None:
        linears = getattr(gen.target, "linears", None)
        kernels = int8_kernels_summary([lin for _, lin in linears()]) if linears else None
        parts.append(f"target weights {gb(weights())}" + (f" ({kernels})" if kernels else ""))
    drafter = gen.drafter if hasattr(gen.drafter, "model") else getattr(gen.drafter, "inner", None)
    model = getattr(drafter, "model", None)
    if model is not None and getattr(model, "weight_bytes", None) is not None:
        parts.append(f"draft weights {gb(model.weight_bytes())}")
        twin = getattr(drafter, "prefill_model", None)  # the drafter's, also under a reduced head
        if twin is not None:
            parts.append(f"its prefill copy {gb(twin.weight_bytes())}")
    if gen.prefix_cache is not None:
        parts.append(f"prefix cache up to {gb(gen.prefix_cache.budget)}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    parts.append(f"process peak RSS {gb(rss)}")
    return "specdecode serve: memory: " + ", ".join(parts)


def calibrate(gen, sizes: list[int]):
    """Measure round costs at each batch size, with a progress line on stderr."""
    print(
        f"specdecode serve: measuring round costs at batch sizes {sizes} for load-aware drafting ...",
        file=sys.stderr,
    )
    done = []

    def progress(i: int, n: int) -> None:
        done.append(i)
        if sys.stderr.isatty():
            print(f"\r  {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)

    return gen.measure_load_costs(sizes, progress=progress)


def _serve(args: argparse.Namespace) -> int:
    check_args(args)
    gen, server = build(args)
    what = f"{gen.method}, k = {gen.k}" if gen.method else "no speculation"
    inv = "batch-invariant" if gen.batch_invariant else "plain forward"
    engine = server.engine
    if engine.max_batched_tokens is None:
        prefill = "prompts prefilled whole"
    else:
        ride = "riding the rounds" if engine._rides() else "each its own forward"
        n = engine.max_batched_tokens
        size = "sized to 3/4 of a round" if n == "auto" else f"of up to {n} tokens"
        prefill = f"prompts in chunks {size}, {ride}"
    print(memory_line(gen, args), file=sys.stderr)
    print(
        f"specdecode serve: {args.served_model_name or args.target} ({what}; {inv}; {prefill}; "
        f"max batch {args.max_batch}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    server.run(args.host, args.port)
    return 0
