"""The projections of the real 1.5B target (every layer's q|k|v, o, gate|up, down and the LM head)
through each quantized kernel, at 1, 2, 5, 8, 16 and 64 rows, beside llama.cpp's own forward on the
same GGUF file and a read-bandwidth probe, in one run on one machine (2 threads). Never needed by CI.

    .venv/bin/python benchmarks/kernels.py                      # kq, w8a8, int4 + llama-bench + probe
    .venv/bin/python benchmarks/kernels.py --formats kq --reps 3

Formats (models.load on the installed GGUF, `qwen2.5-coder-1.5b`):
- kq: our kernel (src/specdecode/kernels/) on the file's own Q4_K / Q6_K blocks, int8 rows;
- w8a8: int8 weights (requantized from the file) x int8 rows, FBGEMM / oneDNN as chosen at load;
- int4: torch's weight-only int4 kernel on the file's Q4_K values (Q6_K tensors as int8).
The formats and row counts are interleaved rep by rep and each figure is the fastest of --reps passes
(other work on the machine only adds time). The probe sums a 1 GiB float32 tensor with torch (the
read speed a memory-bound step can reach) between the passes, fastest pass kept. llama-bench (built by
`benchmarks/peers.py --build-llama-cpp`) reports whole forwards: pp n = a forward over n new tokens
(n = 1, 2, 5, 8, 16, 64), tg = one decode step; ours are the projections alone (they read every
weight; attention, norms and sampling come on top, see benchmarks/NOTES.md).

Writes OUT/<cpu>.json and OUT/<cpu>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def probe_gbps(buf) -> float:
    t0 = time.perf_counter()
    buf.sum()
    return buf.numel() * 4 / (time.perf_counter() - t0) / 1e9


def one_pass(linears, xs) -> float:
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        for lin in linears:
            lin(xs[lin.in_features])
        return time.perf_counter() - t0


def llama_bench(bin_dir: Path, gguf: Path, rows: list[int], reps: int) -> dict:
    """{'pp1': ms, ..., 'tg': ms} from llama-bench on the file (2 threads)."""
    exe = bin_dir / "llama-bench"
    if not exe.exists():
        print(f"llama-bench not built ({exe}); run benchmarks/peers.py --build-llama-cpp", file=sys.stderr)
        return {}
    cmd = [str(exe), "-m", str(gguf), "-t", "2", "-r", str(reps), "-o", "json", "-n", "32",
           "-p", ",".join(map(str, rows))]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    res = {}
    for t in out:
        ms = t["avg_ns"] / 1e6
        if t["n_gen"]:
            res["tg"] = ms / t["n_gen"]
        else:
            res[f"pp{t['n_prompt']}"] = ms
    return res


def main() -> int:
    import torch

    from specdecode import kernels
    from specdecode.autotune import cpu_name
    from specdecode.models import ZOO, load

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="kq,kq@avx2,w8a8,int4", help="kq@ISA: kq forced onto that path")
    ap.add_argument("--rows", default="1,2,5,8,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--llama-dir", default=str(ROOT / "benchmarks" / ".llama.cpp"))
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "kernels"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    name = "qwen2.5-coder-1.5b"
    gguf = ZOO[name].gguf_path()
    models = {}
    for fmt in formats:
        base = fmt.split("@")[0]  # kq@ISA: the kq model on a forced path (set around its passes: on_path)
        if base not in models:
            dtype = torch.float32 if base in ("kq", "w8a8") else torch.bfloat16
            print(f"loading {name} as {base}", file=sys.stderr)
            m = load(name, dtype=dtype, quant=base)
            models[base] = ([lin for _, lin in m.linears()], dtype, m.weight_bytes())
        models[fmt] = models[base]

    def on_path(fmt: str) -> None:
        """kq@ISA runs on that path (SPECDECODE_ISA, read when the choice is made), kq on the chosen one."""
        isa = fmt.split("@")[1] if "@" in fmt else None
        if isa:
            os.environ["SPECDECODE_ISA"] = isa
        else:
            os.environ.pop("SPECDECODE_ISA", None)
        kernels.chosen_isa.cache_clear()
        kernels.chosen_isa()  # the choice (and its timing) now, outside the timed passes

    gen = torch.Generator().manual_seed(0)
    xs = {r: {k: torch.randn(r, k, generator=gen) for k in (1536, 8960)} for r in rows}
    best = {(f, r): float("inf") for f in formats for r in rows}
    buf = torch.ones(1 << 28)
    probe = 0.0
    for fmt in formats:  # warm: packing caches, page faults, the kernel's path choice
        on_path(fmt)
        lins, dtype, _ = models[fmt]
        one_pass(lins, {k: v.to(dtype) for k, v in xs[rows[0]].items()})
    for rep in range(args.reps):
        probe = max(probe, probe_gbps(buf))
        for r in rows:
            for fmt in formats:
                on_path(fmt)
                lins, dtype, _ = models[fmt]
                best[fmt, r] = min(best[fmt, r], one_pass(lins, {k: v.to(dtype) for k, v in xs[r].items()}))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    probe = max(probe, probe_gbps(buf))
    on_path("kq")
    llama = {} if args.no_llama else llama_bench(Path(args.llama_dir) / "build" / "bin", gguf, rows, 3)
    cpu = cpu_name()
    result = {
        "cpu": cpu,
        "threads": 2,
        "isa": kernels.chosen_isa() if kernels.available() else None,
        "probe_gbps": probe,
        "ms": {f: {r: best[f, r] * 1e3 for r in rows} for f in formats},
        "weight_bytes": {f: models[f][2] for f in formats},
        "llama_bench_ms": llama,
    }
    lines = [f"# Projections + head of {name}, ms ({cpu}, 2 threads, kernel path {result['isa']})", ""]
    head = "| format | " + " | ".join(f"T({r})" for r in rows) + " | T(5)/T(1) | T(8)/T(1) | GB/s at 1 row |"
    lines += [head, "|" + "---|" * (len(rows) + 4)]
    for f in formats:
        ms = result["ms"][f]
        gbps = models[f][2] / (ms[1] / 1e3) / 1e9 if 1 in ms else float("nan")
        r5, r8 = (f"{ms[n] / ms[1]:.2f}" if n in ms and 1 in ms else "-" for n in (5, 8))
        lines.append(
            f"| {f} | " + " | ".join(f"{ms[r]:.1f}" for r in rows)
            + f" | {r5} | {r8} | {gbps:.1f} ({gbps / probe:.0%} of the probe) |"
        )
    if llama:
        cells = " | ".join(f"{llama.get(f'pp{r}', float('nan')):.1f}" for r in rows)
        pp = {r: llama.get(f"pp{r}") for r in rows}
        r5 = f"{pp[5] / pp[1]:.2f}" if pp.get(5) and pp.get(1) else "-"
        r8 = f"{pp[8] / pp[1]:.2f}" if pp.get(8) and pp.get(1) else "-"
        lines.append(f"| llama.cpp Q4_K_M, whole forward (llama-bench pp n) | {cells} | {r5} | {r8} | "
                     f"tg {llama.get('tg', float('nan')):.1f} ms a token |")
    lines += ["", f"Read-bandwidth probe (torch sum over 1 GiB of float32): {probe:.1f} GB/s."]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = re.sub(r"[^a-z0-9]+", "-", cpu.split("[")[0].lower()).strip("-") or "cpu"
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"{tag}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
