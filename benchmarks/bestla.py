"""Intel's AutoRound kernel (auto-round-lib, BesTLA's successor: int4 weights, int8 activations,
VNNI / AMX tiles) beside specdecode's kq on the 1.5B's projection shapes, in one process, 2
threads: the measurement issue 53 asked for before adopting anything of it. Never needed by CI
(the library is not a dependency): install it beside the venv, not into it,

    .venv/bin/pip install --target /tmp/arl auto-round-lib py-cpuinfo --no-deps
    .venv/bin/python benchmarks/bestla.py --site /tmp/arl

It times ARK's `woqgemm` on random int4 weights of the 1.5B's shapes (every layer's q|k|v, o,
gate|up, down and the head) at each group size and kq's packed projections of the real model
at the same row counts, interleaved, and says whether a row's result depends on how many rows
share ARK's call (kq's never does: tests/test_kernels.py)."""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", required=True, help="folder auto-round-lib was installed into (pip --target)")
    ap.add_argument("--rows", default="1,2,5,8,16,20,64")
    ap.add_argument("--groups", default="32,128", help="ARK group sizes (Q4_K's sub-blocks are 32)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, args.site)
    import torch

    try:
        import auto_round_kernel as ark
    except ImportError as e:
        print(f"bestla.py: cannot import auto_round_kernel from {args.site} ({e})", file=sys.stderr)
        return 2
    from specdecode.models import load

    torch.set_num_threads(2)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536)] * 28 + [(1536, 151936)]
    zp = torch.empty(0, dtype=torch.int8)
    ark_sets = {}
    for gs in (int(g) for g in args.groups.split(",")):
        packed = []
        for k, n in shapes:
            q = torch.randint(-8, 8, (k, n), dtype=torch.int8)
            s = torch.rand(k // gs, n) * 0.01 + 0.001
            blob = ark._repack_quantized_weight_core(q, s, zp, gs, "int8", "int4", "fp32", False)
            packed.append((k, n, blob))
        ark_sets[f"ark int4 g{gs}"] = (gs, packed)
        gb = sum(b.numel() for _, _, b in packed) / 1e9
        print(f"ark int4 g{gs}: {gb:.3f} GB packed", file=sys.stderr)
    kq = [lin for _, lin in load("qwen2.5-coder-1.5b", dtype=torch.float32, quant="kq").linears()]
    xs = {m: {k: torch.randn(m, k) for k in (1536, 8960)} for m in rows}
    zeros = {n: torch.zeros(n) for _, n in shapes}

    def ark_pass(gs, packed, m):
        t0 = time.perf_counter()
        for k, n, blob in packed:
            ark.woqgemm(xs[m][k], blob, zeros[n], n, k, gs, "int8", "int4", "fp32", False)
        return time.perf_counter() - t0

    def kq_pass(m):
        with torch.inference_mode():
            t0 = time.perf_counter()
            for lin in kq:
                lin(xs[m][lin.in_features])
            return time.perf_counter() - t0

    systems = {"kq (specdecode)": kq_pass} | {
        name: (lambda m, gs=gs, p=p: ark_pass(gs, p, m)) for name, (gs, p) in ark_sets.items()
    }
    for run in systems.values():
        run(rows[0])
    best = {(s, m): float("inf") for s in systems for m in rows}
    for _ in range(args.reps):
        for m in rows:
            for s, run in systems.items():
                best[s, m] = min(best[s, m], run(m))
    print("| system | " + " | ".join(f"T({m})" for m in rows) + " | row 0 alone = among M rows |")
    print("|---" * (len(rows) + 2) + "|")
    for s in systems:
        same = "yes (tested)" if s.startswith("kq") else _invariant(ark, *ark_sets[s], zeros)
        print(f"| {s} | " + " | ".join(f"{best[s, m] * 1e3:.1f}" for m in rows) + f" | {same} |")
    return 0


def _invariant(ark, gs, packed, zeros) -> str:
    import torch

    k, n, blob = packed[2]
    x = torch.randn(64, k)
    alone = ark.woqgemm(x[:1], blob, zeros[n], n, k, gs, "int8", "int4", "fp32", False)
    differ = []
    for m in (2, 5, 8, 16, 64):
        many = ark.woqgemm(x[:m], blob, zeros[n], n, k, gs, "int8", "int4", "fp32", False)
        if not torch.equal(many[:1], alone):
            differ.append(m)
    return "yes" if not differ else f"no (differs at M = {', '.join(map(str, differ))})"


if __name__ == "__main__":
    sys.exit(main())
