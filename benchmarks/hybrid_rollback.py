"""Rollback of a hybrid target's linear-attention state: time and memory of the two strategies
(snapshot, recompute) against k and the state size.

    .venv/bin/python benchmarks/hybrid_rollback.py

For each head size D (state D x D per head) a random hybrid model is made (4 heads, 3 linear
layers + 1 attention layer, vocab 2048, float32); for each k it times one verification round as
the engine runs it: a forward of k + 1 tokens after a 64-token context, then a rewind that keeps
half of the drafts (the median of 30 rounds), and reads the memory the journal held. Writes
benchmarks/hybrid/rollback.json and .md.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from specdecode import load  # noqa: E402
from specdecode.train.hybrid import init_hybrid  # noqa: E402

HEADS, CONTEXT, REPS = 4, 64, 30


def round_cost(model, rollback: str, k: int) -> tuple[float, int, int]:
    cache = model.new_cache(1, CONTEXT + k + 2, rollback=rollback)
    g = torch.Generator().manual_seed(0)
    model.forward(torch.randint(0, 2048, (1, CONTEXT), generator=g), cache)
    cache.rewind(cache.lengths.clone())
    drafts = torch.randint(0, 2048, (1, k + 1), generator=g)
    keep = torch.tensor([CONTEXT + 1 + k // 2])
    states, lengths = dict(cache.state), cache.lengths.clone()
    times, journal, before = [], 0, 0
    for _ in range(REPS + 3):
        cache.state, cache.lengths = dict(states), lengths.clone()  # back to the context
        t0 = time.perf_counter()
        model.forward(drafts, cache)
        used = cache.rollback_bytes()
        cache.rewind(keep)
        times.append(time.perf_counter() - t0)
        journal, before = used["journal"], used["state_before"]
    return statistics.median(times[3:]), journal, before


def main() -> None:
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for D in (32, 64, 128):
            path = init_hybrid(
                Path(tmp) / f"h{D}", vocab=2048, layers=4, dim=HEADS * D, linear_layers=(0, 1, 2), heads=HEADS
            )
            model = load(path)
            for k in (1, 2, 4, 8):
                row = {"head_dim": D, "state_floats_per_layer": HEADS * D * D, "k": k}
                for rollback in ("snapshot", "recompute"):
                    seconds, journal, before = round_cost(model, rollback, k)
                    row[rollback] = {
                        "round_ms": seconds * 1e3,
                        "journal_bytes": journal,
                        "state_before": before,
                    }
                row["memory_ratio"] = row["recompute"]["journal_bytes"] / row["snapshot"]["journal_bytes"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = ROOT / "benchmarks" / "hybrid"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollback.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# Rolling back a hybrid target's linear-attention state: snapshot vs recompute",
        "",
        f"Random hybrid model: {HEADS} heads of size D, 3 linear-attention layers + 1 attention layer, "
        f"float32, 2 CPU threads. One round: a forward of k + 1 tokens after {CONTEXT} tokens, then a "
        f"rewind keeping half the drafts; median of {REPS}. Journal: what the cache keeps for the "
        "rewind (snapshots: the state after every position; recompute: k, v, α, β per position). "
        "Both also keep the state before the round (state before, equal for both).",
        "",
        "| D | state floats / layer | k | snapshot round ms | recompute round ms | snapshot journal KiB "
        "| recompute journal KiB | recompute / snapshot memory | 1/k | state before KiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, c = r["snapshot"], r["recompute"]
        lines.append(
            f"| {r['head_dim']} | {r['state_floats_per_layer']:,} | {r['k']} | {s['round_ms']:.2f} | "
            f"{c['round_ms']:.2f} | {s['journal_bytes'] / 1024:.0f} | {c['journal_bytes'] / 1024:.1f} | "
            f"{r['memory_ratio']:.3f} | {1 / r['k']:.3f} | {s['state_before'] / 1024:.0f} |"
        )
    (out / "rollback.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
