"""`specdecode bench`: transformers' generate, assisted generation and prompt lookup against
our engine, on the bundled families, in one process, repeats interleaved after a warm-up.

Every cell is one (family, prompt set, temperature, configuration); each repeat times every
configuration on every prompt of the set, in an order that rotates between repeats, so the
machine's load falls on all of them alike. Ratios between cells of one run are the result;
absolute tokens/s on a shared machine are not.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.theory import expected_speedup
from ..engine import SpeculativeGenerator
from ..errors import SpecDecodeError
from ..models import load, resolve
from .prompts import SETS, prompts
from .runners import OursRunner, Run, Runner, TransformersRunner, load_transformers, synchronize

FAMILIES = {"three-kingdoms": "three-kingdoms/draft-64", "python-code": "python-code/draft"}
# (method, policy[, tree]) of ours; quick keeps one of each kind
OURS_FULL = (
    [("draft", p) for p in ("fixed", "heuristic", "confidence", "optimal")]
    + [("ngram", p) for p in ("fixed", "heuristic", "optimal")]
    + [("early-exit", p) for p in ("fixed", "confidence", "optimal")]
    + [("medusa", "fixed"), ("eagle", "fixed"), ("eagle", "tree 2,2,1")]
)
OURS_QUICK = (
    ("draft", "fixed"),
    ("draft", "optimal"),
    ("ngram", "fixed"),
    ("early-exit", "confidence"),
    ("medusa", "fixed"),
    ("eagle", "fixed"),
)
ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def check_families_and_k(families: tuple[str, ...], k: int) -> None:
    """SpecDecodeError naming the first bundled family we do not have, or a k below 1."""
    for f in families:
        if f not in FAMILIES:
            raise SpecDecodeError(f"unknown family {f!r}; choose from {', '.join(FAMILIES)}")
    if k < 1:
        raise SpecDecodeError(f"k must be >= 1, got {k}")


@dataclass
class BenchConfig:
    families: tuple[str, ...] = tuple(FAMILIES)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    k: int = 4
    max_new_tokens: int = 64
    repeats: int = 3
    prompts_per_set: int = 4
    quick: bool = False
    transformers: bool = True
    seed: int = 0
    sampling_rule: str = "standard"
    progress: bool = True
    device: str = "cpu"

    @staticmethod
    def make(quick: bool = False, **overrides) -> BenchConfig:
        base = BenchConfig(quick=quick)
        if quick:
            base = BenchConfig(quick=True, max_new_tokens=48, repeats=3, prompts_per_set=2)
        cfg = BenchConfig(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        check_families_and_k(self.families, self.k)
        if self.max_new_tokens < 4:
            raise SpecDecodeError(f"max-new-tokens must be >= 4 for a benchmark, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise SpecDecodeError(f"repeats must be >= 1, got {self.repeats}")
        if not 1 <= self.prompts_per_set <= 4:
            raise SpecDecodeError(f"prompts per set must be in 1..4, got {self.prompts_per_set}")
        if any(t < 0 for t in self.temperatures):
            raise SpecDecodeError("temperatures must be >= 0")


def _ours(family: str, target, draft, cfg: BenchConfig) -> list[Runner]:
    k = cfg.k
    runners: list[Runner] = [
        OursRunner(
            "ours target-only", SpeculativeGenerator(target), "target-only", "-", {}, cfg.sampling_rule
        )
    ]
    for method, policy in OURS_QUICK if cfg.quick else OURS_FULL:
        kw: dict = {"k": k, "method": method}
        if method == "draft":
            kw["draft"] = draft
        if method in ("medusa", "eagle"):
            kw["heads"] = resolve(f"{family}/target").parent / method  # bundled next to the target
        if policy.startswith("tree"):
            kw.update(tree=policy.split()[1])
            kw.pop("k")
        else:
            kw["policy"] = policy
        gen = SpeculativeGenerator(target, **kw)
        settings = {"k": gen.k, "draft": FAMILIES[family] if method == "draft" else None}
        runners.append(
            OursRunner(f"ours {method} ({policy})", gen, method, policy, settings, cfg.sampling_rule)
        )
    return runners


def _transformers(family: str, cfg: BenchConfig) -> list[Runner]:
    hf_target = load_transformers(resolve(f"{family}/target"), cfg.device)
    hf_draft = load_transformers(resolve(FAMILIES[family]), cfg.device)
    defaults = {key: getattr(hf_draft.generation_config, key) for key in ASSISTANT_KEYS}
    k = cfg.k
    constant = {
        "num_assistant_tokens": k,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }
    return [
        TransformersRunner("transformers generate", hf_target, "generate", {}),
        TransformersRunner(
            f"transformers assisted (k={k}, constant)",
            hf_target,
            "assisted",
            {"k": k, "draft": FAMILIES[family], **constant},
            hf_draft,
            constant,
        ),
        TransformersRunner(
            "transformers assisted (defaults)",
            hf_target,
            "assisted",
            {
                "draft": FAMILIES[family],
                "generation_config": "defaults (20 tokens, constant, confidence 0.4)",
            },
            hf_draft,
            defaults,
        ),
        TransformersRunner(f"transformers prompt lookup (k={k})", hf_target, "lookup", {"k": k}),
    ]


def forward_costs(
    model,
    context: int = 160,
    max_n: int = 9,
    repeats: int = 5,
    calls: int = 20,
    batch: int = 1,
    widths: tuple[int, ...] | None = None,
) -> dict[int, float]:
    """Seconds of one target forward over n new tokens per row (n = 1..max_n, or `widths`)
    for `batch` rows after `context` cached tokens each (interleaved over n, best of
    `repeats`): the verification cost T(n)."""
    gen = torch.Generator().manual_seed(0)
    ns = widths or tuple(range(1, max_n + 1))
    cache = model.new_cache(batch, context + max(ns) + 1)
    dev = model.device
    model.forward(torch.randint(0, model.vocab_size, (batch, context), generator=gen).to(dev), cache)
    toks = {n: torch.randint(0, model.vocab_size, (batch, n), generator=gen).to(dev) for n in ns}
    best = {n: float("inf") for n in toks}
    for n in toks:  # warm-up
        model.forward(toks[n], cache)
        cache.rewind(cache.lengths - n)
    for _ in range(repeats):
        for n, tok in toks.items():
            synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(calls):
                model.forward(tok, cache)
                cache.rewind(cache.lengths - n)
            synchronize(dev)
            best[n] = min(best[n], (time.perf_counter() - t0) / calls)
    return best


@dataclass
class Cell:
    family: str
    prompt_set: str
    temperature: float
    runner: Runner
    reps: list[list[Run]] = field(default_factory=list)  # [repeat][prompt]

    def total(self, attr: str) -> float:
        return sum(getattr(r, attr) for rep in self.reps for r in rep)

    def rates(self) -> list[float]:
        return [sum(r.tokens for r in rep) / sum(r.seconds for r in rep) for rep in self.reps]


def _summarise(cells: list[Cell], costs: dict[int, float]) -> list[dict]:
    """One row per cell: speed, speed-ups over the baselines, Theorem 3.8's prediction."""
    by = {(c.prompt_set, c.temperature, c.runner.name): c for c in cells}
    t1 = costs[1]
    rows = []
    for c in cells:
        rates = c.rates()
        med = statistics.median(rates)
        row = {
            "family": c.family,
            "prompt_set": c.prompt_set,
            "temperature": c.temperature,
            "config": c.runner.name,
            "engine": c.runner.engine,
            "method": c.runner.method,
            "policy": c.runner.policy,
            "settings": c.runner.settings,
            "tokens_per_s": med,
            "tokens_per_s_min": min(rates),
            "tokens_per_s_max": max(rates),
            "ms_per_token": 1000 / med,
            "tokens": int(c.total("tokens")),
            "tokens_per_forward": c.total("tokens") / c.total("forwards") if c.total("forwards") else None,
        }
        for base_name, key in (
            ("ours target-only", "speedup_vs_ours_target_only"),
            ("transformers generate", "speedup_vs_transformers_generate"),
            (
                next((n for (_, _, n) in by if n.startswith("transformers assisted (k=")), ""),
                "speedup_vs_transformers_assisted",
            ),
        ):
            base = by.get((c.prompt_set, c.temperature, base_name))
            row[key] = med / statistics.median(base.rates()) if base else None
        row.update(
            alpha=None,
            mean_k=None,
            cost_ratio=None,
            predicted_speedup=None,
            engine_efficiency=None,
            accounted_speedup=None,
        )
        if c.runner.engine == "ours" and c.total("drafted") > 0:
            alpha = c.total("accepted") / c.total("tested") if c.total("tested") else 0.0
            mean_k = c.total("drafted") / c.total("rounds")
            base = by[(c.prompt_set, c.temperature, "ours target-only")]
            t_fwd = base.total("target_s") / base.total("forwards")  # one target forward, in the loop
            cost = (c.total("draft_s") / c.total("drafted")) / t_fwd
            row.update(alpha=alpha, mean_k=mean_k, cost_ratio=cost)
            if not c.runner.policy.startswith("tree"):
                pred = expected_speedup(min(alpha, 0.999999), mean_k, cost)
                # what the measured tokens/forward, draft cost and verification cost allow
                n = mean_k + 1
                lo = min(int(n), max(costs))
                ratio = costs[lo] / t1 + (n - lo) * ((costs.get(lo + 1, costs[lo]) - costs[lo]) / t1)
                accounted = row["tokens_per_forward"] / (mean_k * cost + ratio)
                row.update(
                    predicted_speedup=pred,
                    engine_efficiency=row["speedup_vs_ours_target_only"] / pred,
                    accounted_speedup=accounted,
                )
        rows.append(row)
    return rows


def _targets(results: dict) -> list[dict]:
    rows = [r for fam in results["families"].values() for r in fam["rows"]]

    def pick(config: str) -> list[dict]:
        return [r for r in rows if r["config"] == config]

    out = []

    def add(name: str, goal: float, cells: list[tuple[str, float]], higher: bool = True) -> None:
        if not cells:
            return
        worst = min(cells, key=lambda x: x[1]) if higher else max(cells, key=lambda x: x[1])
        values = sorted(v for _, v in cells)
        out.append(
            {
                "target": name,
                "goal": goal,
                "worst": worst[1],
                "worst_at": worst[0],
                "median": statistics.median(values),
                "cells": len(cells),
                "met": all((v >= goal) if higher else (v <= goal) for _, v in cells),
            }
        )

    def where(r: dict) -> str:
        return f"{r['family']} {r['prompt_set']} T={r['temperature']:g}"

    def cells(config: str, key: str) -> list[tuple[str, float]]:
        return [(where(r), r[key]) for r in pick(config) if r[key]]

    add(
        "ours target-only >= 4x transformers generate",
        4.0,
        cells("ours target-only", "speedup_vs_transformers_generate"),
    )
    add(
        "ours draft (fixed k) >= 3x transformers assisted (same pair, same k)",
        3.0,
        cells("ours draft (fixed)", "speedup_vs_transformers_assisted"),
    )
    code = [
        r
        for r in rows
        if r["family"] == "python-code"
        and r["prompt_set"] == "code"
        and r["temperature"] == 0
        and r["engine"] == "ours"
    ]
    if code:
        best = max(code, key=lambda r: r["speedup_vs_ours_target_only"])
        add(
            f"best method >= 2x our target-only, greedy, python-code prompts ({best['config']})",
            2.0,
            [(where(best), best["speedup_vs_ours_target_only"])],
        )
    add(
        "engine efficiency (measured / Theorem 3.8) >= 0.9, draft model k fixed",
        0.9,
        cells("ours draft (fixed)", "engine_efficiency"),
    )
    add(
        "verification cost T(k+1)/T(1) <= 1.3 at k = 4",
        1.3,
        [(f, fam["verification_cost_ratio"]["5"]) for f, fam in results["families"].items()],
        higher=False,
    )
    return out


def run_bench(cfg: BenchConfig, log=print) -> dict:
    """Run the benchmark; returns the JSON-able results (see benchmarks/RESULTS.md)."""
    import transformers
    from rich.progress import Progress

    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    results: dict = {
        "config": asdict(cfg),
        "machine": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "families": {},
    }
    plan = []
    for family in cfg.families:
        target = load(f"{family}/target", device=cfg.device)
        draft = load(FAMILIES[family], device=cfg.device)
        runners = _ours(family, target, draft, cfg)
        if cfg.transformers:
            runners = _transformers(family, cfg) + runners
        sets = {s: prompts(family, s, target, cfg.prompts_per_set) for s in SETS[family]}
        ids = {s: [target.tokenizer.encode(p) for p in ps] for s, ps in sets.items()}
        plan.append((family, target, runners, sets, ids))
    total = sum(
        len(runners) * len(cfg.temperatures) * cfg.repeats * sum(len(v) for v in ids.values())
        for _, _, runners, _, ids in plan
    )
    with Progress(disable=not cfg.progress, transient=True) as progress:
        task = progress.add_task("bench", total=total)
        for family, target, runners, sets, ids in plan:
            progress.update(task, description=f"bench {family}: warm-up")
            for r in runners:  # warm-up: every code path once per temperature
                for temp in cfg.temperatures:
                    r.run(ids[next(iter(ids))][0], temp, 8, cfg.seed)
            cells = {
                (s, temp, r.name): Cell(family, s, temp, r)
                for temp in cfg.temperatures
                for s in ids
                for r in runners
            }
            for temp in cfg.temperatures:
                for rep in range(cfg.repeats):
                    progress.update(task, description=f"bench {family}: T = {temp:g}, repeat {rep + 1}")
                    order = runners[rep % len(runners) :] + runners[: rep % len(runners)]
                    for s, prompt_ids in ids.items():
                        for r in order:
                            cells[(s, temp, r.name)].reps.append([])
                        for i, p in enumerate(prompt_ids):
                            seed = cfg.seed + 1000 * rep + i
                            for r in order:
                                cells[(s, temp, r.name)].reps[-1].append(
                                    r.run(p, temp, cfg.max_new_tokens, seed)
                                )
                                progress.advance(task)
            progress.update(task, description=f"bench {family}: verification cost")
            costs = forward_costs(target, repeats=3 if cfg.quick else 5)
            results["families"][family] = {
                "target": f"{family}/target",
                "draft": FAMILIES[family],
                "prompts": sets,
                "forward_ms": {str(n): 1000 * t for n, t in costs.items()},
                "verification_cost_ratio": {str(n): t / costs[1] for n, t in costs.items()},
                "rows": _summarise(list(cells.values()), costs),
            }
    results["targets"] = _targets(results)
    results["seconds"] = time.perf_counter() - started
    return results


def save(results: dict, out: Path) -> dict[str, Path]:
    """bench.json, bench.md and bench.png in `out`."""
    import json

    from .report import markdown, plot

    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md", "plot": out / "bench.png"}
    paths["json"].write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    paths["markdown"].write_text(markdown(results))
    plot(results, paths["plot"])
    return paths
