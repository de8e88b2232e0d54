"""The price of a seed that fixes the text: the invariant sampling rule against the standard one,
per drafter, side by side in one process.

For each model set and temperature, every configuration (target-only, and each drafter) runs
the same prompts under both rules, seeded, batch 1: tokens/s, the speed-up over target-only
under the same rule, tau (tokens per target forward), and the acceptance of every tested draft
position. A second, untimed pass of the same seeded runs records, at each tested chain position,
the target's p and the drafter's q (one-hot for copy drafters): TV(p, q), the standard rule's
expected acceptance 1 - TV, the invariant rule's closed form
sum_x 1 / sum_y max(p_y/p_x, q_y/q_x) (theory.invariant_acceptance) and its bound
(1 - TV)/(1 + TV). The measured invariant acceptance must sit at the closed form within
sampling noise and at or above the bound: a check on the implementation. Under the invariant
rule every configuration's text must equal target-only's (reported as "same text").

    .venv/bin/python benchmarks/sampling_rules.py --out benchmarks/sampling-rules
    .venv/bin/python benchmarks/sampling_rules.py --sets qwen-pair --limit 2 --max-new-tokens 48

The qwen-pair set needs `make models` and runs the 1.5B target and the 0.5B draft in w8a8
(the fastest pair here, docs/quantization.md); run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import specdecode.engine.verify as verify_mod  # noqa: E402
from specdecode import SamplingParams, SpeculativeGenerator, load  # noqa: E402
from specdecode.bench.model_bench import read_prompts  # noqa: E402
from specdecode.bench.prompts import CODE, PROSE  # noqa: E402
from specdecode.core.theory import invariant_acceptance, invariant_bound  # noqa: E402
from specdecode.formats import weight_format  # noqa: E402
from specdecode.progress import bar  # noqa: E402

MODELS = ROOT / "models"


def spec_bench(limit: int) -> list[str]:
    seen, out = set(), []
    for p in read_prompts("spec-bench"):
        if p["category"] not in seen:
            seen.add(p["category"])
            out.append(p["text"])
    return out[:limit]


def model_set(name: str, limit: int):
    """(target, {config name: generator kwargs}, prompts as ids) of a set."""
    if name in ("three-kingdoms", "python-code"):
        fam = MODELS / name
        target = load(str(fam / "target"))
        draft = load(str(fam / ("draft-64" if name == "three-kingdoms" else "draft")))
        configs = {
            "draft k=4": dict(draft=draft, k=4),
            "draft tree 4,2,1": dict(draft=draft, tree="4,2,1"),
            "eagle k=4": dict(method="eagle", heads=fam / "eagle", k=4),
            "medusa k=3": dict(method="medusa", heads=fam / "medusa", k=3),
            "ngram k=4": dict(method="ngram", k=4),
        }
        texts = list((PROSE if name == "three-kingdoms" else CODE)[:limit])
    elif name == "smollm2-135m":
        target = load("smollm2-135m", dtype=torch.bfloat16)
        configs = {
            "eagle3 k=4": dict(method="eagle3", heads=MODELS / "smollm2-135m" / "eagle3", k=4),
            "eagle3 tree 4,2,1": dict(
                method="eagle3", heads=MODELS / "smollm2-135m" / "eagle3", tree="4,2,1"
            ),
            "suffix": dict(method="suffix", k=4),
        }
        texts = [[{"role": "user", "content": t}] for t in spec_bench(limit)]
        for c in configs.values():
            c["batch_invariant"] = True
    elif name == "qwen-pair":
        dtype, quant = weight_format("w8a8")
        target = load("qwen2.5-coder-1.5b", dtype=dtype, quant=quant)
        draft = load("qwen2.5-coder-0.5b", dtype=dtype, quant=quant)
        configs = {"w8a8 draft k=4": dict(draft=draft, k=4, batch_invariant=True)}
        he = [p["text"] for p in read_prompts("humaneval")[:limit]]
        texts = he + [[{"role": "user", "content": t}] for t in spec_bench(limit)]
    else:
        raise SystemExit(f"unknown set {name!r}")
    base = dict(batch_invariant=True) if name in ("smollm2-135m", "qwen-pair") else {}
    configs = {"target-only": base, **configs}
    gens = {n: SpeculativeGenerator(target, **kw) for n, kw in configs.items()}
    ids = [gens["target-only"].encode(t) for t in texts]
    return target, gens, ids


class Recorder:
    """Per tested chain position: TV(p, q), accepted, and under the invariant rule the closed
    form of its acceptance (the chain verifiers wrapped; trees are not recorded)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, bool, float | None, float | None]] = []
        self.on = False
        self._chain, self._inv = verify_mod.verify_chain, verify_mod.verify_invariant
        verify_mod.verify_chain = self.chain
        verify_mod.verify_invariant = self.invariant

    def chain(self, tokens, q, p, u, noise, n=None):
        v = self._chain(tokens, q, p, u, noise, n)
        self._record(v, tokens, q, p, False)
        return v

    def invariant(self, tokens, p, noise, n=None, q=None):
        v = self._inv(tokens, p, noise, n, q)
        self._record(v, tokens, q, p, True)
        return v

    def _record(self, v, tokens, q, p, closed: bool) -> None:
        if not self.on:
            return
        tested = v.tested
        for b, i in tested.nonzero().tolist():
            pb = p[b, i].double()
            qb = (
                torch.zeros_like(pb).scatter_(0, tokens[b, i].view(1), 1.0) if q is None else q[b, i].double()
            )
            tv = 0.5 * float((pb - qb).abs().sum())
            form = tail = None
            if closed:  # the whole V x V sum up to 8,192 tokens, else the top 2,048 by min(p, q)
                top = None if pb.numel() <= 8192 else 2048
                form = invariant_acceptance(pb, qb, top=top)
                m = torch.minimum(pb, qb)
                tail = 0.0 if top is None else float(m.sum() - m.topk(top).values.sum())
            self.rows.append((tv, bool(i < int(v.accepted[b])), form, tail))

    def take(self) -> dict:
        rows, self.rows = self.rows, []
        if not rows:
            return {}
        tv = np.array([r[0] for r in rows])
        acc = np.array([r[1] for r in rows], dtype=float)
        out = {
            "positions": len(rows),
            "acceptance": float(acc.mean()),
            "acceptance_se": float(acc.std(ddof=1) / np.sqrt(len(rows))) if len(rows) > 1 else None,
            "one_minus_tv": float((1 - tv).mean()),
            "bound": float(np.mean([invariant_bound(t) for t in tv])),
        }
        if rows[0][2] is not None:
            out["closed_form"] = float(np.mean([r[2] for r in rows]))
            # what the top-2,048 sum may leave out (each term <= min(p_x, q_x)); 0 when exact
            out["closed_form_tail_at_most"] = float(np.mean([r[3] for r in rows]))
        return out


def run_set(name: str, temps: list[float], args, rec: Recorder) -> list[dict]:
    target, gens, ids = model_set(name, args.limit)
    rules = ("standard", "invariant")
    out = []
    for T in temps:
        params = {
            rule: [
                SamplingParams(
                    temperature=T,
                    seed=args.seed + i,
                    max_new_tokens=args.max_new_tokens,
                    ignore_eos=True,
                    sampling_rule=rule,
                )
                for i in range(len(ids))
            ]
            for rule in rules
        }
        for g in gens.values():  # warm-up
            g.generate([ids[0][:32]], SamplingParams(temperature=T, max_new_tokens=4))
            g.forget()
        # every (config, rule) runs every prompt, order rotated prompt by prompt: side by side
        runners = [(n, rule) for n in gens for rule in rules]
        res: dict = {c: [] for c in runners}
        for j, p_ids in enumerate(bar(ids, f"{name} T={T}")):
            for n, rule in runners[j % len(runners) :] + runners[: j % len(runners)]:
                t0 = time.perf_counter()
                (r,) = gens[n].generate([p_ids], params[rule][j])
                res[(n, rule)].append((r, time.perf_counter() - t0))
        std = res[("target-only", "standard")]
        std_tps = sum(len(r.token_ids) for r, _ in std) / sum(s for _, s in std)
        for rule in rules:
            base = res[("target-only", rule)]
            base_ids = [r.token_ids for r, _ in base]
            base_tps = sum(len(r.token_ids) for r, _ in base) / sum(s for _, s in base)
            for n, g in gens.items():
                rs = res[(n, rule)]
                tokens, secs = sum(len(r.token_ids) for r, _ in rs), sum(s for _, s in rs)
                fwd = sum(r.stats.target_forwards for r, _ in rs)
                same = sum(r.token_ids == b for (r, _), b in zip(rs, base_ids))
                row = {
                    "set": name,
                    "config": n,
                    "T": T,
                    "rule": rule,
                    "tokens_per_s": tokens / secs,
                    "speedup": tokens / secs / base_tps,
                    "speedup_vs_standard_target_only": tokens / secs / std_tps,
                    "tau": tokens / fwd,
                    "same_text_as_target_only": f"{same}/{len(rs)}",
                }
                if n != "target-only":  # the untimed pass: p and q at every tested position
                    g.forget()
                    rec.on = True
                    for p_ids, prm in zip(ids, params[rule]):
                        g.generate([p_ids], prm)
                    rec.on = False
                    row |= rec.take()
                out.append(row)
                print(json.dumps(row), file=sys.stderr)
    del target, gens
    return out


def markdown(rows: list[dict]) -> str:
    lines = [
        "| set | config | T | rule | tok/s | x target-only (same rule) | x standard target-only | tau "
        "| acceptance (± se) | 1-TV | closed form | bound (1-TV)/(1+TV) | same text as target-only |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = "" if "acceptance" not in r else f"{r['acceptance']:.3f} ± {r['acceptance_se'] or 0:.3f}"

        def f(k: str, r: dict = r) -> str:
            return f"{r[k]:.3f}" if k in r else ""

        lines.append(
            f"| {r['set']} | {r['config']} | {r['T']} | {r['rule']} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | {r['speedup_vs_standard_target_only']:.2f}x | {r['tau']:.2f} | {acc} | "
            f"{f('one_minus_tv')} | {f('closed_form')} | "
            f"{f('bound')} | {r['same_text_as_target_only']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="three-kingdoms,python-code,smollm2-135m")
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--limit", type=int, default=4, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "sampling-rules"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    rec = Recorder()
    temps = [float(t) for t in args.temperatures.split(",")]
    rows = [r for s in args.sets.split(",") for r in run_set(s, temps, args, rec)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "-".join(args.sets.split(","))
    meta = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "args": vars(args),
    }
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
