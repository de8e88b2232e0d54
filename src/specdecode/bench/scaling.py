"""`specdecode bench --scaling`: per-token decoding cost against context length (128..2048)
and batch size (1..32), target-only and speculative (fixed k and the optimal policy).

Decoding cost excludes the prefill. The batch sweep also records the optimal policy's mean
draft length and the target's verification cost T(k+1)/T(1) at that batch: as the batch
grows the verification forward stops being nearly free, and the policy must shorten k or stop
drafting so that speculation is never slower than target-only decoding.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.sampling import SamplingParams
from ..engine import SpeculativeGenerator
from ..lab.common import PROMPTS as PROSE
from ..models import load
from .harness import FAMILIES, check_families_and_k
from .prompts import CODE

CONFIGS = ("target-only", "draft (fixed)", "draft (optimal)")
SOURCES = ("textwrap.dedent", "shlex.quote", "fnmatch.translate", "difflib.get_close_matches")


@dataclass
class ScalingConfig:
    families: tuple[str, ...] = ("three-kingdoms", "python-code")
    contexts: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    batch_context: int = 128
    k: int = 4
    new_tokens: int = 128
    repeats: int = 3
    quick: bool = False
    seed: int = 0
    progress: bool = True

    @staticmethod
    def make(quick: bool = False, **overrides) -> ScalingConfig:
        base = ScalingConfig(quick=quick)
        if quick:
            base = ScalingConfig(
                quick=True, contexts=(128, 512, 2048), batches=(1, 4, 16, 32), new_tokens=64, repeats=2
            )
        cfg = ScalingConfig(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})
        check_families_and_k(cfg.families, cfg.k)
        return cfg


def _source(qualname: str) -> str:
    """The source of a pure-Python standard-library function (every machine has it)."""
    import importlib
    import inspect
    import textwrap

    module, name = qualname.rsplit(".", 1)
    return textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), name)))


def _long_text(family: str, target, tokens: int) -> list[int]:
    """At least `tokens` tokens of the family's kind of text: standard-library source for code,
    the target's own greedy prose for three-kingdoms (deterministic, nothing read from outside)."""
    if family == "python-code":
        text = "".join(_source(q) for q in SOURCES) + "".join(CODE)
        ids = target.tokenizer.encode(text)
        while len(ids) < tokens:
            ids = ids + ids
        return ids[:tokens]
    ids: list[int] = []
    for prompt in PROSE:
        params = SamplingParams(
            temperature=0, max_new_tokens=max(64, tokens // len(PROSE) + 8), ignore_eos=True
        )
        (res,) = SpeculativeGenerator(target).generate([prompt], params)
        ids += target.tokenizer.encode(prompt) + res.token_ids
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def _decode_ms(
    gen: SpeculativeGenerator, prompts: list[list[int]], n: int, seed: int
) -> tuple[float, float, float]:
    """(ms per generated token, decoding only; mean draft tokens per round; tokens per forward)."""
    params = SamplingParams(temperature=0, max_new_tokens=n, seed=seed, ignore_eos=True)
    results = gen.generate(prompts, params)
    st = results[0].stats
    tokens = sum(len(r.token_ids) for r in results)
    mean_k = sum(r.stats.drafted for r in results) / sum(r.stats.rounds for r in results)
    per_forward = tokens / sum(r.stats.target_forwards for r in results)
    return 1000 * (st.wall_s - st.prefill_s) / tokens, mean_k, per_forward


def run_scaling(cfg: ScalingConfig) -> dict:
    from rich.progress import Progress

    from .harness import forward_costs

    started = time.perf_counter()
    out: dict = {"config": asdict(cfg), "families": {}}
    with Progress(disable=not cfg.progress, transient=True) as progress:
        total = len(cfg.families) * cfg.repeats * len(CONFIGS) * (len(cfg.contexts) + len(cfg.batches))
        task = progress.add_task("scaling", total=total)
        for family in cfg.families:
            target, draft = load(f"{family}/target"), load(FAMILIES[family])
            gens = {
                "target-only": SpeculativeGenerator(target),
                "draft (fixed)": SpeculativeGenerator(target, draft=draft, k=cfg.k),
                "draft (optimal)": SpeculativeGenerator(target, draft=draft, k=cfg.k, policy="optimal"),
            }
            text = _long_text(family, target, max(cfg.contexts) + cfg.batch_context * max(cfg.batches))
            for g in gens.values():  # warm-up
                g.generate([text[:64]], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
            raw: dict = {"context": {}, "batch": {}}
            per_batch: dict[int, SpeculativeGenerator] = {}
            for rep in range(cfg.repeats):
                for L in cfg.contexts:
                    progress.update(task, description=f"scaling {family}: context {L}")
                    for name, g in gens.items():
                        raw["context"].setdefault((L, name), []).append(
                            _decode_ms(g, [text[:L]], cfg.new_tokens, rep)
                        )
                        progress.advance(task)
                for B in cfg.batches:
                    progress.update(task, description=f"scaling {family}: batch {B}")
                    C = cfg.batch_context
                    rows = [text[i * C : (i + 1) * C] for i in range(B)]  # B different prompts, C tokens each
                    for name, g in gens.items():
                        if name == "draft (optimal)":  # its cost model is measured on this batch size
                            g = per_batch.setdefault(
                                B, SpeculativeGenerator(target, draft=draft, k=cfg.k, policy="optimal")
                            )
                        raw["batch"].setdefault((B, name), []).append(
                            _decode_ms(g, rows, cfg.new_tokens, rep)
                        )
                        progress.advance(task)
            progress.update(task, description=f"scaling {family}: verification cost by batch")
            verify = {}
            for B in cfg.batches:
                costs = forward_costs(
                    target, cfg.batch_context, repeats=2, calls=10, batch=B, widths=(1, cfg.k + 1)
                )
                verify[B] = costs[cfg.k + 1] / costs[1]

            out["families"][family] = {
                "context": _table(raw, "context", cfg.contexts),
                "batch": _table(raw, "batch", cfg.batches, verify),
                "forward_ms_batch1": {str(n): 1000 * t for n, t in forward_costs(target, repeats=2).items()},
            }
    out["seconds"] = time.perf_counter() - started
    return out


def _table(raw: dict, kind: str, keys, verify: dict | None = None) -> list[dict]:
    """Medians over repeats per (x, configuration), one row per x."""
    rows = []
    for x in keys:
        row: dict = {kind: x}
        for name in CONFIGS:
            runs = raw[kind][(x, name)]
            ms = [r[0] for r in runs]
            row[name] = statistics.median(ms)
            row[f"{name} min"], row[f"{name} max"] = min(ms), max(ms)
            row[f"{name} mean k"] = statistics.mean(r[1] for r in runs)
            row[f"{name} tokens/forward"] = statistics.mean(r[2] for r in runs)
        if verify is not None:
            row["verification cost ratio"] = verify[x]
        rows.append(row)
    return rows


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [
        "# specdecode bench --scaling",
        "",
        f"Greedy decoding, {cfg['new_tokens']} new tokens per row, k = {cfg['k']}, "
        f"median of {cfg['repeats']} interleaved repeats; ms per generated token, decoding only "
        f"(prefill excluded). {results['seconds']:.0f} s.",
    ]
    for family, fam in results["families"].items():
        lines += [
            "",
            f"## {family}: context length (batch 1)",
            "",
            "| context | target-only ms/token | draft (fixed) | draft (optimal) | optimal mean k | "
            "fixed vs target-only | optimal vs target-only |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in fam["context"]:
            lines.append(
                f"| {r['context']} | {r['target-only']:.2f} | {r['draft (fixed)']:.2f} | "
                f"{r['draft (optimal)']:.2f} | "
                f"{r['draft (optimal) mean k']:.2f} | {r['target-only'] / r['draft (fixed)']:.2f}x | "
                f"{r['target-only'] / r['draft (optimal)']:.2f}x |"
            )
        lines += [
            "",
            f"## {family}: batch size (context {cfg['batch_context']})",
            "",
            "| batch | T(k+1)/T(1) | target-only ms/token | draft (fixed) | draft (optimal) | "
            "optimal mean k | fixed vs target-only | optimal vs target-only |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in fam["batch"]:
            lines.append(
                f"| {r['batch']} | {r['verification cost ratio']:.2f} | {r['target-only']:.3f} | "
                f"{r['draft (fixed)']:.3f} | {r['draft (optimal)']:.3f} | "
                f"{r['draft (optimal) mean k']:.2f} | {r['target-only'] / r['draft (fixed)']:.2f}x | "
                f"{r['target-only'] / r['draft (optimal)']:.2f}x |"
            )
    lines += [
        "",
        "ms/token in the batch table is per generated token of the whole batch (decoding time / "
        "(batch x tokens)). mean k: draft tokens per round the policy chose (0 = drafting off).",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    from ..lab.common import new_figure

    fams = list(results["families"])
    fig, axes = new_figure(len(fams), 3, figsize=(16, 4.5 * len(fams)), squeeze=False)
    for i, family in enumerate(fams):
        fam = results["families"][family]
        for j, kind in enumerate(("context", "batch")):
            ax = axes[i][j]
            xs = [r[kind] for r in fam[kind]]
            for name in CONFIGS:
                ax.plot(xs, [r[name] for r in fam[kind]], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)" if kind == "context" else "batch size (rows)")
            ax.set_ylabel("ms per generated token")
            ax.set_title(f"{family}: cost vs {kind}")
            ax.legend(fontsize=8)
        ax = axes[i][2]
        xs = [r["batch"] for r in fam["batch"]]
        ax.plot(
            xs,
            [r["draft (optimal) mean k"] for r in fam["batch"]],
            marker="o",
            label="optimal policy: mean k",
        )
        ax.plot(
            xs,
            [r["verification cost ratio"] for r in fam["batch"]],
            marker="s",
            label=f"T(k+1)/T(1), k = {results['config']['k']}",
        )
        ax.plot(
            xs,
            [r["target-only"] / r["draft (optimal)"] for r in fam["batch"]],
            marker="^",
            label="optimal speed-up over target-only",
        )
        ax.axhline(1.0, color="gray", ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (rows)")
        ax.set_title(f"{family}: where the policy switches")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save_scaling(results: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "scaling.json", "markdown": out / "scaling.md", "plot": out / "scaling.png"}
    paths["json"].write_text(json.dumps(results, indent=1) + "\n")
    paths["markdown"].write_text(markdown(results))
    plot(results, paths["plot"])
    return paths
