"""Every drafting method and draft-length policy on one target, greedy and sampled: tokens per
target forward and the wall-clock speed-up over target-only decoding, measured in one run."""

from __future__ import annotations

import time

from ..core.config import POLICIES
from ..core.sampling import SamplingParams
from ..engine import SpeculativeGenerator
from .common import LabConfig, LabResult, Table, label, new_figure

TREES = ("2,2,1", "4,2,1")
CONFIGS = (
    [("draft", p) for p in POLICIES]
    + [("ngram", p) for p in ("fixed", "heuristic", "optimal")]
    + [("early-exit", p) for p in POLICIES]
)


def run(cfg: LabConfig, k: int = 4, new_tokens: int | None = None, repeats: int | None = None) -> LabResult:
    n_new = new_tokens or (32 if cfg.quick else 64)
    reps = repeats or (1 if cfg.quick else 2)
    target = cfg.model(cfg.target)
    draft = cfg.model(cfg.drafts[0])
    gens = {("target-only", "-"): SpeculativeGenerator(target)}
    for method, policy in CONFIGS:
        gens[(method, policy)] = SpeculativeGenerator(
            target, draft=draft if method == "draft" else None, k=k, method=method, policy=policy
        )
    for tree in TREES:
        gens[("draft", f"tree {tree}")] = SpeculativeGenerator(target, draft=draft, tree=tree)
    for method in ("medusa", "eagle"):  # trained heads next to the target, when there are any
        heads = target.path.parent / method
        if (heads / "config.json").exists():
            gens[(method, "fixed")] = SpeculativeGenerator(target, k=k, method=method, heads=heads)
            for tree in TREES:
                gens[(method, f"tree {tree}")] = SpeculativeGenerator(
                    target, method=method, heads=heads, tree=tree
                )
    rows, data = [], []
    for temperature in (0.0, 1.0):
        totals = {key: [0, 0, 0.0, 0, 0] for key in gens}  # tokens, forwards, seconds, accepted, tested
        warm = SamplingParams(temperature=temperature, max_new_tokens=4, seed=0, ignore_eos=True)
        for gen in gens.values():
            gen.generate([cfg.prompt], warm)
        jobs = [(r, p) for r in range(reps) for p in cfg.prompts]
        for r, prompt in cfg.track(jobs, f"methods: T = {temperature:g}", total=len(jobs)):
            params = SamplingParams(
                temperature=temperature, max_new_tokens=n_new, seed=cfg.seed + r, ignore_eos=True
            )
            for key, gen in gens.items():  # interleaved: every config sees the same machine load
                t0 = time.perf_counter()
                (res,) = gen.generate([prompt], params)
                t = totals[key]
                t[0] += len(res.token_ids)
                t[1] += res.stats.target_forwards
                t[2] += time.perf_counter() - t0
                t[3] += res.stats.accepted
                t[4] += res.stats.tested
        base = totals[("target-only", "-")]
        for (method, policy), (tok, fwd, sec, acc, tested) in totals.items():
            row = {
                "temperature": temperature,
                "method": method,
                "policy": policy,
                "tokens_per_forward": tok / fwd,
                "acceptance_rate": acc / tested if tested else None,
                "tokens_per_s": tok / sec,
                "speedup": (tok / sec) / (base[0] / base[2]),
            }
            data.append(row)
            rows.append(
                [
                    "greedy" if temperature == 0 else "T = 1",
                    method if method != "draft" else f"draft ({label(cfg.drafts[0])})",
                    policy,
                    row["tokens_per_forward"],
                    "" if row["acceptance_rate"] is None else row["acceptance_rate"],
                    row["tokens_per_s"],
                    row["speedup"],
                ]
            )
    return LabResult(
        "methods",
        "methods: every drafter and policy, tokens per forward and speed-up",
        "One target, every drafting method and draft-length policy, greedy and sampled at T = 1, each "
        "timed interleaved with target-only decoding on the same prompts. Tokens per forward is what "
        "the method saves in target forwards; the speed-up is what is left after paying for drafting.",
        "lesson 001 lists the variants (draft model, self-speculation, Medusa, EAGLE, lookahead/n-gram).",
        [
            Table(
                f"{cfg.target}, k = {k} (start for adaptive policies), {len(cfg.prompts)} prompts × "
                f"{reps} × {n_new} tokens",
                ["decoding", "method", "policy", "tokens/forward", "α", "tokens/s", "speed-up"],
                rows,
            )
        ],
        {"k": k, "new_tokens": n_new, "repeats": reps, "rows": data},
        {},
        _plot(data),
    )


def _plot(data: list[dict]):
    import numpy as np

    fig, ax = new_figure(figsize=(8, 4))
    names = [f"{r['method']}/{r['policy']}" for r in data if r["temperature"] == 0]
    x = np.arange(len(names))
    for i, t in enumerate((0.0, 1.0)):
        vals = [r["speedup"] for r in data if r["temperature"] == t]
        ax.bar(x + (i - 0.5) * 0.4, vals, 0.4, label="greedy" if t == 0 else "T = 1")
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speed-up over target-only")
    ax.legend(fontsize=8)
    return fig
