"""`specdecode serve`: the OpenAI-compatible server (see docs/serving.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SpecDecodeError
from ..options import DTYPES, SAMPLING_RULE_HELP, add_spec_flags, method_heads, spec_config, torch_dtype
from ..sampling import SAMPLING_RULES


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
    s.add_argument("--draft", metavar="MODEL", help="draft model sharing the target's vocabulary")
    s.add_argument(
        "--method",
        help="drafting method: draft (default with --draft), ngram, early-exit, medusa, eagle, eagle3, "
        "suffix, auto; 'none' for target-only. Default: auto for smollm2-135m (its bundled EAGLE-3 "
        "drafter + suffix matches), none otherwise",
    )
    add_spec_flags(s, ("heads", "k", "policy", "tree", "tree_sampling"), k=None)
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
    s.add_argument(
        "--dtype",
        default=None,
        choices=tuple(DTYPES),
        help="weights (default bf16 for smollm2-135m, else fp32)",
    )
    s.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    s.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="use the plain forward (faster, about 14%% in bf16 here) at the price of a request's output "
        "depending on its batch mates; by default a greedy or seeded request gives the same tokens whatever "
        "else is running",
    )
    s.add_argument(
        "--sampling-rule",
        default="auto",
        choices=("auto", *SAMPLING_RULES),
        help="the sampling rule of requests that name none (the request field sampling_rule wins): "
        "auto (default: invariant for a seeded request, so its seed gives the same answer whatever "
        "the load, the cache or the drafter; standard otherwise), standard, invariant. " + SAMPLING_RULE_HELP,
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
        "--backend", default="auto", choices=("auto", "lean", "hf"), help="model runtime (default auto)"
    )
    s.set_defaults(func=_serve)


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


def build(args: argparse.Namespace):
    """The generator and server for these arguments (calibrated when load-aware)."""

    from ..engine import SpeculativeGenerator
    from ..models import ZOO, load, resolve, resolve_device
    from ..policy import LoadCosts

    zoo = args.target in ZOO
    method = args.method if args.method is not None else ("auto" if zoo and not args.draft else None)
    if method == "none":
        method = None
    if method is None and args.draft:
        method = "draft"
    k = args.k or (2 if zoo else 4)
    dtype_name = args.dtype or ("bf16" if zoo else "fp32")
    device, dtype = resolve_device(args.device), torch_dtype(dtype_name)
    resolve(args.target, dtype)
    target = load(args.target, backend=args.backend, dtype=dtype, device=device)
    draft = load(args.draft, backend=args.backend, dtype=dtype, device=device) if args.draft else None
    config = spec_config(
        args,
        method=method,
        k=k,
        heads=method_heads(args.target, method, args.heads, draft=args.draft),
        batch_invariant=(target.lean and not args.no_batch_invariant) or None,
    )
    gen = SpeculativeGenerator(target, draft=draft, config=config)
    from ..serve import Server, batch_sizes

    if gen.drafter is not None and not args.no_load_aware:
        if args.load_costs and Path(args.load_costs).exists():
            gen.load_costs = LoadCosts.load(args.load_costs)
        else:
            gen.load_costs = calibrate(gen, batch_sizes(args.max_batch))
            if args.load_costs:
                gen.load_costs.save(args.load_costs)
    server = Server(
        gen,
        args.served_model_name or args.target,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_model_len=args.max_model_len,
        default_max_tokens=args.max_tokens,
        sampling_rule=args.sampling_rule,
    )
    return gen, server


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

    from ..calibrate import measure_load_costs

    return measure_load_costs(gen.spec, sizes, progress=progress)


def _serve(args: argparse.Namespace) -> int:
    check_args(args)
    gen, server = build(args)
    what = f"{gen.method}, k = {gen.k}" if gen.method else "no speculation"
    inv = "batch-invariant" if gen.batch_invariant else "plain forward"
    print(
        f"specdecode serve: {args.served_model_name or args.target} ({what}; {inv}; "
        f"max batch {args.max_batch}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    server.run(args.host, args.port)
    return 0
