"""Load test of `specdecode serve`: throughput and latency at several concurrencies, with each
speculation method and with speculation off, every server started the way a user starts it.

    .venv/bin/python benchmarks/serve.py                      # smollm2-135m, the default methods
    .venv/bin/python benchmarks/serve.py --methods none,ngram --concurrency 1,4 --quick

For each method a `specdecode serve` subprocess is started on a free loopback port (its load-aware
round costs are measured once and kept in OUT/costs-<method>.json); then, for each concurrency c,
c client threads send Spec-Bench chat prompts (all categories, interleaved) until max(2c, 8)
requests are done, streamed, greedy. Measured per request: time to first token and latency;
per run: completion tokens per second of wall time. Greedy outputs are compared across methods
(the server is batch-invariant, so they must be identical). Bounded: loopback only, a fixed
number of requests. Writes OUT/serve-bench.json, .md and .png.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdecode.bench.model_bench import read_prompts  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interleaved(prompts: list[dict]) -> list[dict]:
    """Round-robin over the categories, so any prefix mixes all of them."""
    by: dict[str, list[dict]] = {}
    for p in prompts:
        by.setdefault(p["category"], []).append(p)
    out, i = [], 0
    while any(i < len(v) for v in by.values()):
        out += [v[i] for v in by.values() if i < len(v)]
        i += 1
    return out


class ServerProcess:
    def __init__(self, args, method: str, out: Path) -> None:
        self.port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "specdecode.cli",
            "serve",
            "--target",
            args.target,
            "--port",
            str(self.port),
        ]
        cmd += ["--method", method, "--max-batch", str(args.max_batch), "--k", str(args.k)]
        if method != "none":
            cmd += ["--load-costs", str(out / f"costs-{method}.json")]
        if args.no_load_aware and method != "none":
            cmd = [c for c in cmd if c not in ("--load-costs", str(out / f"costs-{method}.json"))]
            cmd += ["--no-load-aware"]
        self.log = open(out / f"server-{method}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server for {method} did not start; see {self.log.name}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def one_request(conn: http.client.HTTPConnection, prompt: str, max_tokens: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    text, ttft, usage, spec = "", None, None, None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            resp.read()  # the end of the chunked body, so the connection can be reused
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        for ch in chunk.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
        if chunk.get("usage"):
            usage, spec = chunk["usage"], chunk.get("speculative")
    return {
        "latency_s": time.perf_counter() - t0,
        "ttft_s": ttft,
        "tokens": usage["completion_tokens"],
        "text": text,
        "forwards": spec["target_forwards"] if spec else None,
        "drafted": spec["drafted"] if spec else 0,
        "accepted": spec["accepted"] if spec else 0,
    }


def load_run(port: int, prompts: list[dict], concurrency: int, max_tokens: int, offset: int = 0) -> dict:
    """n = max(2c, 8) requests, prompts[offset:offset + n] (each run its own prompts: a suffix
    cache would otherwise draft the answers it already gave)."""
    n = max(2 * concurrency, 8)
    todo = list(range(n))
    lock = threading.Lock()
    results: dict[int, dict] = {}
    errors: list[str] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        while True:
            with lock:
                if not todo:
                    break
                i = todo.pop(0)
            try:
                results[i] = one_request(conn, prompts[(offset + i) % len(prompts)]["text"], max_tokens)
            except Exception as e:  # noqa: BLE001 — counted and reported
                errors.append(str(e))
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    rs = [results[i] for i in sorted(results)]
    lat = sorted(r["latency_s"] for r in rs)
    tokens = sum(r["tokens"] for r in rs)
    forwards = sum(r["forwards"] or 0 for r in rs)
    drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")

    return {
        "concurrency": concurrency,
        "requests": n,
        "errors": len(errors),
        "error_examples": errors[:3],
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": pct(lat, 0.5),
        "latency_p99_s": pct(lat, 0.99),
        "ttft_p50_s": pct(sorted(r["ttft_s"] for r in rs if r["ttft_s"] is not None), 0.5),
        "tokens_per_forward": tokens / forwards if forwards else None,
        "acceptance": accepted / drafted if drafted else None,
        "texts": [results[i]["text"] if i in results else None for i in range(n)],
    }


def markdown(res: dict) -> str:
    methods, cs = res["methods"], res["concurrency"]
    lines = [
        f"# `specdecode serve` under load: {res['target']}",
        "",
        "Greedy chat requests from Spec-Bench (all categories interleaved), "
        f"{res['max_tokens']} tokens at most, "
        f"max(2c, 8) requests per concurrency c, k = {res['k']}, load-aware drafting "
        f"{'off' if res['no_load_aware'] else 'on'}, batch-invariant bf16, {res['threads']} CPU threads. "
        "Speed-up: tokens/s over the same server with speculation off, at the same concurrency.",
        "",
        "| method | c | tokens/s | speed-up | p50 latency s | p99 latency s | p50 TTFT s | tokens/forward | "
        "acceptance | errors | outputs = off |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        for c in cs:
            r = res["runs"][m][str(c)]
            off = res["runs"].get("none", {}).get(str(c))
            sp = f"{r['tokens_per_s'] / off['tokens_per_s']:.2f}x" if off and m != "none" else "1.00x"
            same = f"{r['identical_to_off']}/{r['requests']}" if "identical_to_off" in r else "-"
            tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else "-"
            acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            lines.append(
                f"| {m} | {c} | {r['tokens_per_s']:.1f} | {sp} | {r['latency_p50_s']:.2f} | "
                f"{r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} | {tpf} | {acc} | {r['errors']} | {same} |"
            )
    lines += ["", "Targets:", ""]
    for t in res["targets"]:
        lines.append(f"- {t['target']}: {t['measured']} — **{'met' if t['met'] else 'missed'}**")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    cs = res["concurrency"]
    for m in res["methods"]:
        runs = [res["runs"][m][str(c)] for c in cs]
        a.plot(cs, [r["tokens_per_s"] for r in runs], marker="o", label=m)
        b.plot(cs, [r["latency_p50_s"] for r in runs], marker="o", label=m)
    for ax, title in ((a, "throughput (completion tokens/s)"), (b, "p50 request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a.legend()
    fig.suptitle(f"specdecode serve, {res['target']}: speculation on vs off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--methods", default="none,ngram,suffix,eagle3,auto", help="comma-separated; none = off")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument(
        "--no-load-aware", action="store_true", help="draft k at any load (to show what the cap buys)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "serve")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    methods = [m for m in args.methods.split(",") if m]
    cs = [int(c) for c in args.concurrency.split(",")]
    prompts = interleaved(read_prompts("spec-bench"))
    import torch

    res = {
        "target": args.target,
        "methods": methods,
        "concurrency": cs,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "no_load_aware": args.no_load_aware,
        "threads": torch.get_num_threads(),
        "runs": {},
    }
    for m in methods:
        print(f"[{m}] starting the server", file=sys.stderr, flush=True)
        server = ServerProcess(args, m, args.out)
        try:
            offset = len(prompts) - 8
            load_run(server.port, prompts, 2, 16, offset)  # warm-up (the last 8 prompts): first-call costs
            res["runs"][m] = {}
            offset = 0
            for c in cs:
                r = load_run(server.port, prompts, c, args.max_tokens, offset)
                offset += r["requests"]
                res["runs"][m][str(c)] = r
                print(
                    f"[{m}] c={c}: {r['tokens_per_s']:.1f} tokens/s, p50 {r['latency_p50_s']:.2f} s, "
                    f"p99 {r['latency_p99_s']:.2f} s, errors {r['errors']}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            server.stop()
    targets = []
    if "none" in res["runs"]:
        for m in methods:
            if m == "none":
                continue
            for c in cs:
                r, off = res["runs"][m][str(c)], res["runs"]["none"][str(c)]
                r["speedup"] = r["tokens_per_s"] / off["tokens_per_s"]
                r["identical_to_off"] = sum(
                    a == b and a is not None for a, b in zip(r["texts"], off["texts"])
                )
        spec = [m for m in methods if m != "none"]
        if spec:
            worst = min((res["runs"][m][str(c)]["speedup"], m, c) for m in spec for c in cs)
            targets.append(
                {
                    "target": "speculation on >= 1.0x speculation off at every concurrency (each method)",
                    "measured": f"lowest {worst[0]:.2f}x ({worst[1]}, c = {worst[2]})",
                    "met": worst[0] >= 1.0,
                }
            )
            if 1 in cs:
                best = max((res["runs"][m]["1"]["speedup"], m) for m in spec)
                targets.append(
                    {
                        "target": ">= 1.5x at concurrency 1 with the best drafter",
                        "measured": f"{best[0]:.2f}x ({best[1]})",
                        "met": best[0] >= 1.5,
                    }
                )
    errors = sum(r["errors"] for m in res["runs"].values() for r in m.values())
    targets.append({"target": "0 errors", "measured": str(errors), "met": errors == 0})
    res["targets"] = targets
    (args.out / "serve-bench.json").write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    (args.out / "serve-bench.md").write_text(markdown(res))
    plot(res, args.out / "serve-bench.png")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
