"""`specdecode plan`: predicted speed-ups for big models on GPUs, by roofline simulation."""

from __future__ import annotations

import argparse

from .common import numbers, show


def register(sub) -> None:
    from ..plan import PRESETS

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
    p.add_argument(
        "--dtype",
        default="bf16",
        help="weights: fp32, bf16 (default), fp16, fp8, int8, w8a8, int4, int4-g128 (the KV cache: the "
        "float type, bf16 for quantized weights)",
    )
    p.add_argument(
        "--draft-dtype",
        help="the draft's weights (default --dtype): a quantized draft reads fewer bytes, so c falls",
    )
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
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from ..plan import run_plan

    result = run_plan(
        target=args.target,
        draft=args.draft,
        hardware=args.hardware,
        alphas=tuple(numbers(args.alpha, "--alpha")),
        context=args.context,
        batches=tuple(numbers(args.batch, "--batch", int)),
        max_k=args.max_k,
        dtype=args.dtype,
        compute_efficiency=args.compute_efficiency,
        bandwidth_efficiency=args.bandwidth_efficiency,
        verify_tokens=args.verify_tokens,
        draft_dtype=args.draft_dtype,
    )
    return show(result, args)
