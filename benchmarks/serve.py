"""Load test of `specdecode serve`, every server started the way a user starts it, on loopback.

    .venv/bin/python benchmarks/serve.py                                   # smollm2-135m, everything
    .venv/bin/python benchmarks/serve.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --methods none,draft,suffix,auto --out benchmarks/serve/qwen-pair
    .venv/bin/python benchmarks/serve.py --scenarios multiturn,chunked     # one part only

Four scenarios (OUT/serve-bench.json, .md and .png):

- load: for each method a `specdecode serve` subprocess (its load-aware round costs measured
  once and kept in OUT/costs-<method>.json); then for each run (concurrency c and prompt set:
  Spec-Bench chat, HumanEval code, or both interleaved) c client threads send streamed greedy
  chat requests until the run's requests are done, `--reps` times. Speculation off is served
  twice by two separate servers ("none" and "none (again)"): the spread between the two is the
  noise each speed-up is read against. Speed-up: the median tokens/s of the reps over the
  median of "none" at the same run. `--interleave` starts every server at once and runs each
  rep on all of them in turn, so a machine whose speed drifts during the run shifts them alike.
- multiturn: 8 conversations x 4 turns, one after another (each turn's prompt holds the earlier
  turns and answers), against the default method's server with the prefix cache on, then off:
  TTFT per turn, the turn-k TTFT with the cache over the same prompt's without, and whether the
  answers (greedy, and seeded T = 1) are the same with and without.
- `--peer llama-server`: llama.cpp's server (built with `benchmarks/peers.py --build-llama-cpp`,
  the same llama.cpp as the peers table) on the same GGUF files, with the same threads, started
  as CPU users serve with it: plain (`-m target.gguf`) and with the draft model
  (`-md draft.gguf --spec-type draft-simple`: `-md` alone loads the draft but drafts nothing in
  this llama.cpp; its other draft settings default), one slot per client (`-np` = the highest
  concurrency); measured in the load scenario beside our servers, on the same prompts; their
  ratios are read against our speculation-off server, with the same noise.
- ttft: the time to first token of prompts of about `--ttft-tokens` tokens, each new to the
  server, for our server (`--multiturn-method`) and the peers.
- chunked: `--streams` greedy streams decoding, then one prompt of about `--long-tokens` tokens
  is admitted; the running streams' inter-token latency (gaps between streamed chunks) while the
  long prompt is prefilled, against the same streams without it, with chunked prefill auto, at a
  fixed budget, and off.

Bounded: loopback only, a fixed number of requests.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
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


def prompt_sets() -> dict[str, list[str]]:
    chat = [p["text"] for p in interleaved(read_prompts("spec-bench"))]
    code = [p["chat_text"] for p in read_prompts("humaneval")]
    mix = [x for pair in zip(chat, code) for x in pair]
    return {"chat": chat, "code": code, "mix": mix}


class ServerProcess:
    def __init__(self, args, method: str, out: Path, label: str, extra: tuple[str, ...] = ()) -> None:
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
        if args.draft and method in ("draft", "auto"):
            cmd += ["--draft", args.draft]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        if args.draft_dtype and method in ("draft", "auto"):
            cmd += ["--draft-dtype", args.draft_dtype]
        cmd += ["--method", method, "--max-batch", str(args.max_batch)]
        if args.k:
            cmd += ["--k", str(args.k)]
        if method != "none":
            cmd += (
                ["--no-load-aware"]
                if args.no_load_aware
                else ["--load-costs", str(out / f"costs-{method}.json")]
            )
        cmd += [*args.server_args.split(), *extra]
        self.cmd = cmd
        self.log = open(out / f"server-{label}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        wait_healthy(self, label, 1800)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


LLAMA_BIN = ROOT / "benchmarks" / ".llama.cpp" / "build" / "bin"
PEERS = {"llama-server": False, "llama-server -md": True}  # label -> with the draft model


class LlamaServerProcess:
    """llama.cpp's llama-server on the same GGUF files as ours, `threads` threads, one slot per
    client; ready when /health answers 200."""

    def __init__(self, args, label: str, out: Path) -> None:
        from specdecode.models import ZOO

        exe = LLAMA_BIN / "llama-server"
        if not exe.exists():
            raise SystemExit(f"no {exe}; run .venv/bin/python benchmarks/peers.py --build-llama-cpp")
        if args.target not in ZOO or (PEERS[label] and args.draft not in ZOO):
            raise SystemExit("--peer llama-server needs known models (their GGUF files), e.g. the pair")
        import torch

        threads = str(torch.get_num_threads())
        slots = max(args.cs)
        self.port = free_port()
        cmd = [str(exe), "-m", str(ZOO[args.target].gguf_path()), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "-t", threads, "-tb", threads, "-np", str(slots)]
        cmd += ["-c", str(4096 * slots), "--jinja", "--no-webui"]
        if PEERS[label]:
            # -md alone loads the draft but drafts nothing in this llama.cpp (--spec-type defaults to
            # none): draft-simple is its draft-model speculation
            cmd += ["-md", str(ZOO[args.draft].gguf_path()), "--spec-type", "draft-simple"]
            cmd += ["-td", threads, "-tbd", threads]
        self.cmd = cmd
        self.log = open(out / f"server-{label.replace(' ', '')}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        wait_healthy(self, label, 600)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def wait_healthy(server, label: str, seconds: float) -> None:
    deadline = time.time() + seconds
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        if server.proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"server {label} did not start; see {server.log.name}")
        time.sleep(0.5)


def start(args, label: str, out: Path):
    """Our server for a method label ("none (again)": a second speculation-off server), or a peer."""
    if label in PEERS:
        return LlamaServerProcess(args, label, out)
    method = "none" if label.startswith("none") else label
    return ServerProcess(args, method, out, label.replace(" (again)", "-again"))


def one_request(
    conn: http.client.HTTPConnection,
    messages: list[dict],
    max_tokens: int,
    sampling: dict | None = None,
    arrivals: list[float] | None = None,
) -> dict:
    """One streamed chat request: its text, TTFT, latency, the arrival time of every chunk
    (appended to `arrivals` as they come, when a list is given: another thread can watch it)."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | (sampling or {})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    text, ttft, usage, spec = "", None, None, None
    arrivals = [] if arrivals is None else arrivals
    while True:
        line = resp.readline()
        if not line:  # a stream cut short (the server died: once, killed for memory) is an error
            raise RuntimeError(f"the stream ended without [DONE] after {len(arrivals)} chunks")
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
                now = time.perf_counter()
                arrivals.append(now)
                if ttft is None:
                    ttft = now - t0
                text += piece
        if chunk.get("usage"):
            usage, spec = chunk["usage"], chunk.get("speculative")
    usage = usage or {}  # a peer may send no usage: one streamed chunk is one token there
    return {
        "latency_s": time.perf_counter() - t0,
        "ttft_s": ttft,
        "tokens": usage.get("completion_tokens", len(arrivals)),
        "prompt_tokens": usage.get("prompt_tokens"),
        "text": text,
        "arrivals": arrivals,
        "forwards": spec["target_forwards"] if spec else None,
        "drafted": spec["drafted"] if spec else 0,
        "accepted": spec["accepted"] if spec else 0,
    }


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


COUNTERS = (
    "draft_deferred_rows",
    "draft_warmed_rows",
    "draft_prefill_tokens",
    "draft_prefill_seconds",
    "prefill_tokens",
    "engine_rounds",
)


def engine_counters(port: int) -> dict[str, float]:
    """Our server's engine counters (Prometheus /metrics; a peer's: empty): read before and after
    a run, their difference says what the engine did in it (draft prefills skipped and fed)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
    except (OSError, http.client.HTTPException):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(f"specdecode:{name}") and "_created" not in line:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def load_run(port: int, prompts: list[str], concurrency: int, n: int, max_tokens: int, offset: int) -> dict:
    """n requests, prompts[offset:offset + n] (each run its own prompts: a suffix cache would
    otherwise draft the answers it already gave), from `concurrency` client threads."""
    todo = list(range(n))
    lock = threading.Lock()
    results: dict[int, dict] = {}
    errors: list[str] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        while True:
            with lock:
                if not todo:
                    break
                i = todo.pop(0)
            msg = [{"role": "user", "content": prompts[(offset + i) % len(prompts)]}]
            try:
                try:
                    results[i] = one_request(conn, msg, max_tokens)
                except (http.client.RemoteDisconnected, ConnectionError):
                    # a server that closes a kept-alive connection after a stream (llama-server):
                    # the client's artefact, not the server's error; once more on a new connection
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
                    results[i] = one_request(conn, msg, max_tokens)
            except Exception as e:  # noqa: BLE001 — counted and reported
                errors.append(str(e))
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        conn.close()

    before = engine_counters(port)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = engine_counters(port)
    rs = [results[i] for i in sorted(results)]
    tokens = sum(r["tokens"] for r in rs)
    forwards = sum(r["forwards"] or 0 for r in rs)
    drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
    return {
        "requests": n,
        "errors": len(errors),
        "error_examples": errors[:3],
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": pct([r["latency_s"] for r in rs], 0.5),
        "ttft_p50_s": pct([r["ttft_s"] for r in rs if r["ttft_s"] is not None], 0.5),
        "tokens_per_forward": tokens / forwards if forwards else None,
        "acceptance": accepted / drafted if drafted else None,
        "texts": [results[i]["text"] if i in results else None for i in range(n)],
        "engine": {k: after[k] - before.get(k, 0.0) for k in after},
    }


# -- load ----------------------------------------------------------------------------------------


def runs_of(args) -> list[tuple[str, int]]:
    """(prompt set, concurrency): each named set at c = 1, the interleaved mix above."""
    out = [(s, 1) for s in args.c1_sets.split(",") if s] if 1 in args.cs else []
    return out + [("mix", c) for c in args.cs if c > 1]


def load_scenario(args, sets: dict[str, list[str]]) -> dict:
    methods = ["none", *[m for m in args.methods if m != "none"], "none (again)", *args.peers]
    runs = runs_of(args)
    res: dict = {"methods": methods, "runs": [f"{s} c={c}" for s, c in runs], "results": {}}
    # every (run, rep) its own prompts, never sent before in this server's life (the mix set holds
    # the chat and code prompts: without this a suffix drafter copies its earlier greedy answer);
    # the same prompts for every method
    warm = sets["mix"][-8:]
    used, chosen = set(warm), {}
    for s, c in runs:
        n = args.requests or max(c, 4)
        for rep in range(args.reps):
            fresh = [x for x in sets[s] if x not in used]
            if len(fresh) < n:
                raise SystemExit(f"not enough unused {s} prompts for {len(runs)} runs x {args.reps} reps")
            chosen[s, c, rep] = fresh[:n]
            used.update(fresh[:n])
    reps_of: dict[str, dict[tuple[str, int], list[dict]]] = {label: {} for label in methods}

    def measure(label: str, server, s: str, c: int, rep: int) -> None:
        n = args.requests or max(c, 4)
        r = load_run(server.port, chosen[s, c, rep], c, n, args.max_tokens, offset=0)
        reps_of[label].setdefault((s, c), []).append(r)
        print(
            f"[load] {label} {s} c={c} rep {rep + 1}: {r['tokens_per_s']:.2f} tokens/s, errors {r['errors']}"
            + (f" (first: {r['error_examples'][0]})" if r["error_examples"] else ""),
            file=sys.stderr,
            flush=True,
        )

    if args.interleave:  # every server up at once; each rep of a run visits them in turn
        servers = {}
        try:
            for label in methods:
                print(f"[load] {label}: starting the server", file=sys.stderr, flush=True)
                servers[label] = start(args, label, args.out)
                load_run(servers[label].port, warm, 2, 4, 16, 0)  # warm-up
            for s, c in runs:
                for rep in range(args.reps):
                    for label in methods:
                        measure(label, servers[label], s, c, rep)
        finally:
            for server in servers.values():
                server.stop()
    else:
        for label in methods:
            print(f"[load] {label}: starting the server", file=sys.stderr, flush=True)
            server = start(args, label, args.out)
            try:
                load_run(server.port, warm, 2, 4, 16, 0)  # warm-up
                for s, c in runs:
                    for rep in range(args.reps):
                        measure(label, server, s, c, rep)
            finally:
                server.stop()
    for label in methods:
        out = res["results"][label] = {}
        for s, c in runs:
            reps = reps_of[label][s, c]
            out[f"{s} c={c}"] = {
                "tokens_per_s": [r["tokens_per_s"] for r in reps],
                "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in reps),
                "errors": sum(r["errors"] for r in reps),
                "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in reps),
                "latency_p50_s": statistics.median(r["latency_p50_s"] for r in reps),
                "tokens_per_forward": reps[-1]["tokens_per_forward"],
                "acceptance": reps[-1]["acceptance"],
                "engine": [r.get("engine", {}) for r in reps],
                "texts": [r["texts"] for r in reps],
            }
    # speed-ups against the first speculation-off server; the noise: the second one's ratio
    for run in res["runs"]:
        off = res["results"]["none"][run]
        again = res["results"]["none (again)"][run]
        noise = abs(again["median_tokens_per_s"] / off["median_tokens_per_s"] - 1)
        for label in methods:
            r = res["results"][label][run]
            r["speedup"] = r["median_tokens_per_s"] / off["median_tokens_per_s"]
            r["noise"] = noise
            r["identical_to_off"] = sum(
                a == b and a is not None for ta, tb in zip(r["texts"], off["texts"]) for a, b in zip(ta, tb)
            )
            r["compared"] = sum(len(t) for t in r["texts"])
    return res


def load_targets(res: dict, pair: bool) -> list[dict]:
    spec = [m for m in res["methods"] if not m.startswith("none") and m not in PEERS]
    peers = [m for m in res["methods"] if m in PEERS]
    targets = []
    for run in res["runs"] if peers and spec else ():
        # issue: c = 1 >= 1.3x llama-server's best on code, >= 1.1x on chat; c >= 4: >= 1.0x
        c = int(run.split("c=")[1])
        goal = 1.0 if c > 1 else (1.3 if run.startswith("code") else 1.1 if run.startswith("chat") else 1.0)
        ours = max((res["results"][m][run]["median_tokens_per_s"], m) for m in spec)
        theirs = max((res["results"][m][run]["median_tokens_per_s"], m) for m in peers)
        noise = res["results"][spec[0]][run]["noise"]
        targets.append(
            {
                "target": f"{run}: our best speculative method >= {goal}x llama-server's best",
                "measured": f"{ours[0] / theirs[0]:.2f}x ± {noise:.2f} ({ours[1]} {ours[0]:.2f} vs "
                f"{theirs[1]} {theirs[0]:.2f} tok/s)",
                "met": ours[0] / theirs[0] >= goal,
            }
        )
    if spec:
        worst = min(
            (r["speedup"] + r["noise"], r["speedup"], r["noise"], m, run)
            for m in spec
            for run, r in res["results"][m].items()
        )
        targets.append(
            {
                "target": "every method >= 1.0x speculation off at every concurrency, within the noise",
                "measured": f"lowest {worst[1]:.2f}x ± {worst[2]:.2f} ({worst[3]}, {worst[4]})",
                "met": worst[0] >= 1.0,
            }
        )
        if pair:
            for s, goal in (("code", 1.8), ("chat", 1.3)):
                run = f"{s} c=1"
                if run in res["runs"]:
                    best = max((res["results"][m][run]["speedup"], m) for m in spec)
                    targets.append(
                        {
                            "target": f"the pair at c = 1 on {s} prompts >= {goal}x",
                            "measured": f"{best[0]:.2f}x ({best[1]})",
                            "met": best[0] >= goal,
                        }
                    )
    errors = sum(r["errors"] for m in res["results"].values() for r in m.values())
    targets.append({"target": "0 server errors under load", "measured": str(errors), "met": errors == 0})
    return targets


# -- multi-turn chats and the prefix cache -----------------------------------------------------------


def conversation_run(
    port: int, convs: list[list[str]], max_tokens: int, sampling: dict | None
) -> list[list[dict]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    out = []
    for turns in convs:
        history = [{"role": "system", "content": SYSTEM}]
        rows = []
        for user in turns:
            history.append({"role": "user", "content": user})
            r = one_request(conn, history, max_tokens, sampling)
            rows.append({k: r[k] for k in ("ttft_s", "prompt_tokens", "text", "tokens")})
            history.append({"role": "assistant", "content": r["text"]})
        out.append(rows)
    conn.close()
    return out


SYSTEM = (
    "You are a careful assistant. Answer in plain prose, keep each answer short, and build on the "
    "earlier turns of the conversation when they are relevant."
)


def multiturn_scenario(args, sets: dict[str, list[str]]) -> dict:
    chat = sets["chat"]
    convs = [
        [chat[(c * 4 + t) * 3 % len(chat)] for t in range(args.turns)] for c in range(args.conversations)
    ]
    warm = [[chat[-1 - t] for t in range(2)]]
    res: dict = {"method": args.multiturn_method, "conversations": len(convs), "turns": args.turns}
    for label, extra in (("cache on", ()), ("cache off", ("--no-prefix-cache",))):
        print(f"[multiturn] {label}: starting the server", file=sys.stderr, flush=True)
        server = ServerProcess(args, args.multiturn_method, args.out, f"multiturn-{label.split()[1]}", extra)
        try:
            conversation_run(server.port, warm, 8, None)
            greedy = conversation_run(server.port, convs, args.max_tokens, None)
            seeded = conversation_run(
                server.port, convs[:2], args.max_tokens, {"temperature": 1.0, "seed": 11}
            )
        finally:
            server.stop()
        res[label] = {"greedy": greedy, "seeded": seeded}
    on, off = res["cache on"]["greedy"], res["cache off"]["greedy"]
    per_turn = []
    for t in range(args.turns):
        ttft_on = [c[t]["ttft_s"] for c in on]
        ttft_off = [c[t]["ttft_s"] for c in off]
        per_turn.append(
            {
                "turn": t + 1,
                "prompt_tokens": statistics.mean(c[t]["prompt_tokens"] for c in on),
                "ttft_on_s": statistics.median(ttft_on),
                "ttft_off_s": statistics.median(ttft_off),
                "ratio": statistics.median(a / b for a, b in zip(ttft_on, ttft_off)),
            }
        )
    res["per_turn"] = per_turn
    later = [p["ratio"] for p in per_turn[1:]]
    res["later_turns_ratio"] = max(later) if later else None
    res["greedy_identical"] = sum(a["text"] == b["text"] for ca, cb in zip(on, off) for a, b in zip(ca, cb))
    res["seeded_identical"] = sum(
        a["text"] == b["text"]
        for ca, cb in zip(res["cache on"]["seeded"], res["cache off"]["seeded"])
        for a, b in zip(ca, cb)
    )
    res["answers"] = len(on) * args.turns
    res["seeded_answers"] = len(res["cache on"]["seeded"]) * args.turns
    return res


# -- chunked prefill: inter-token latency while a long prompt is admitted -----------------------------


def itl_run(
    port: int,
    prompts: list[str],
    streams: int,
    max_tokens: int,
    long_prompt: str | None,
    settle: float,
    window: float,
) -> dict:
    """`streams` greedy streams; once every one has its first token, `settle` seconds later (all
    are decoding: a round's gaps, not their own prompts' prefill) long_prompt, if given, is sent;
    the streams' inter-token gaps from then until the long prompt's first token (without one:
    over the next `window` seconds of the same decoding)."""
    results: dict[int, dict] = {}
    seen: list[list[float]] = [[] for _ in range(streams)]

    def stream(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        results[i] = one_request(
            conn, [{"role": "user", "content": prompts[i]}], max_tokens, {"ignore_eos": True}, seen[i]
        )
        conn.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + 600
    while not all(seen) and time.perf_counter() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    time.sleep(settle)
    t_admit = time.perf_counter()
    long = None
    if long_prompt is not None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        long = one_request(conn, [{"role": "user", "content": long_prompt}], 4)
        conn.close()
        t_end = t_admit + long["ttft_s"]
    else:
        t_end = t_admit + window
    for t in threads:
        t.join()
    gaps, late, timeline = [], 0, []
    for r in results.values():
        a = r["arrivals"]
        # every gap that overlaps the window: one that spans the long prompt's first token (a
        # whole prefill's stall ends with it) counts too
        inside = [(x, y) for x, y in zip(a, a[1:]) if y >= t_admit and x <= t_end]
        gaps += [y - x for x, y in inside]
        timeline += [(round(x - t_admit, 3), round(y - x, 3)) for x, y in inside]
        late += a[-1] < t_end if a else 1  # a stream that ended before the window did
    return {
        "gaps": len(gaps),
        "itl_p50_s": pct(gaps, 0.5),
        "itl_p99_s": pct(gaps, 0.99),
        "itl_max_s": max(gaps) if gaps else float("nan"),
        "streams_done_early": late,
        "long_ttft_s": long["ttft_s"] if long else None,
        "long_prompt_tokens": long["prompt_tokens"] if long else None,
        "window_s": t_end - t_admit,
        "gap_timeline": sorted(timeline),  # (start of the gap after t_admit, its length) in s
    }


def long_text(tokens: int, start: int = 0) -> str:
    """About `tokens` tokens of code (HumanEval prompts from the `start`-th on, concatenated)."""
    text = ""
    for p in read_prompts("humaneval")[start:]:
        text += p["text"] + "\n"
        if len(text) > 3.2 * tokens:
            break
    return "Explain what each of these functions does:\n\n" + text[: int(3.2 * tokens)]


# -- time to first token on a long prompt ------------------------------------------------------------


def ttft_scenario(args) -> dict:
    """Each server (ours with the default method, and the peers) answers `--ttft-reps` prompts of
    about `--ttft-tokens` tokens, one at a time, each starting with text no server has seen (so
    no prefix cache helps): the time to the first streamed token."""
    res: dict = {"prompt_tokens": args.ttft_tokens, "servers": {}}
    prompts = [long_text(args.ttft_tokens, 8 * i + 3) for i in range(args.ttft_reps + 1)]
    for label in [args.multiturn_method, *args.peers]:
        print(f"[ttft] {label}: starting the server", file=sys.stderr, flush=True)
        server = start(args, label, args.out) if label in PEERS else ServerProcess(
            args, label, args.out, f"ttft-{label}", ("--no-prefix-cache",)
        )
        try:
            runs = []
            for i, text in enumerate(prompts):
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
                r = one_request(conn, [{"role": "user", "content": text}], 2)
                conn.close()
                if i:  # the first is a warm-up
                    runs.append(r)
        finally:
            server.stop()
        res["servers"][label] = {
            "ttft_s": [r["ttft_s"] for r in runs],
            "median_ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "prompt_tokens": statistics.median(r["prompt_tokens"] or 0 for r in runs),
        }
        print(f"[ttft] {label}: {res['servers'][label]['median_ttft_s']:.2f} s", file=sys.stderr, flush=True)
    return res


def chunked_scenario(args, sets: dict[str, list[str]]) -> dict:
    res: dict = {"streams": args.streams, "long_tokens": args.long_tokens, "settings": {}}
    long_prompt = long_text(args.long_tokens)
    for label in args.chunked_settings.split(","):
        value = "0" if label == "off" else label
        print(f"[chunked] --max-num-batched-tokens {value}: starting the server", file=sys.stderr, flush=True)
        extra = ("--max-num-batched-tokens", value, "--no-prefix-cache")
        server = ServerProcess(args, args.multiturn_method, args.out, f"chunked-{label}", extra)
        try:
            itl_run(server.port, sets["chat"][-20:], 2, 16, None, 0.5, 0.5)  # warm-up
            base = itl_run(
                server.port, sets["chat"], args.streams, args.stream_tokens, None, args.settle, args.window
            )
            admit = itl_run(
                server.port,
                sets["chat"][8:],
                args.streams,
                args.stream_tokens,
                long_prompt,
                args.settle,
                args.window,
            )
        finally:
            server.stop()
        res["settings"][label] = {
            "without": base,
            "with": admit,
            "p99_ratio": admit["itl_p99_s"] / base["itl_p99_s"],
            "p99_over_p50_without": admit["itl_p99_s"] / base["itl_p50_s"],
        }
        print(
            f"[chunked] {label}: p99 ITL {base['itl_p99_s']:.3f} -> {admit['itl_p99_s']:.3f} s",
            file=sys.stderr,
        )
    return res


# -- report ----------------------------------------------------------------------------------------


INTERLEAVED = " (servers interleaved: every rep visits each server in turn)"


def markdown(res: dict) -> str:
    lines = [
        f"# `specdecode serve` under load: {res['target']}" + (f" + {res['draft']}" if res["draft"] else ""),
        "",
    ]
    lines.append(
        f"Weights: {res['dtype'] or 'the server default'}"
        + (f", draft {res['draft_dtype']}" if res.get("draft_dtype") else "")
        + f"; k = {res['k'] or 'the server default'}; {res['threads']} CPU threads; "
        f"{res['max_tokens']} tokens at most per answer; greedy chat requests, streamed. Prefix cache, "
        "chunked prefill (auto) and online round costs on (the server defaults)."
    )
    if "load" in res:
        load = res["load"]
        lines += [
            "",
            "## Load",
            "",
            f"Median of {res['reps']} runs{INTERLEAVED if res.get('interleave') else ''}"
            " (tokens/s of completion tokens over wall time); speed-up over "
            "speculation off at the same run; noise: how far a second, identical speculation-off server "
            "lands from the first (|ratio − 1|).",
            "",
            "| method | " + " | ".join(load["runs"]) + " |",
            "|---|" + "---|" * len(load["runs"]),
        ]
        for m in load["methods"]:
            cells = []
            for run in load["runs"]:
                r = load["results"][m][run]
                if m == "none":
                    cells.append(f"{r['median_tokens_per_s']:.2f} tok/s")
                else:
                    acc = f", acc {r['acceptance']:.2f}" if r["acceptance"] is not None else ""
                    cells.append(f"{r['speedup']:.2f}x ± {r['noise']:.2f}{acc}")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        same = {
            m: (
                sum(r["identical_to_off"] for r in load["results"][m].values()),
                sum(r["compared"] for r in load["results"][m].values()),
            )
            for m in load["methods"]
        }
        lines += [
            "",
            "Greedy answers identical to speculation off: "
            + ", ".join(f"{m} {a}/{b}" for m, (a, b) in same.items() if m != "none"),
        ]
        errors = {m: sum(r["errors"] for r in load["results"][m].values()) for m in load["methods"]}
        lines += ["", "Errors: " + ", ".join(f"{m} {e}" for m, e in errors.items())]
    if "multiturn" in res:
        mt = res["multiturn"]
        lines += [
            "",
            "## Multi-turn chats: the prefix cache",
            "",
            f"{mt['conversations']} conversations x {mt['turns']} turns, one request at a time, method "
            f"{mt['method']}. TTFT median over the conversations; ratio: median of each turn's TTFT with the "
            "cache over the same prompt's without it.",
            "",
            "| turn | prompt tokens | TTFT cache on s | TTFT cache off s | on / off |",
            "|---|---|---|---|---|",
        ]
        for p in mt["per_turn"]:
            lines.append(
                f"| {p['turn']} | {p['prompt_tokens']:.0f} | {p['ttft_on_s']:.3f} | {p['ttft_off_s']:.3f} | "
                f"{p['ratio']:.2f} |"
            )
        lines += [
            "",
            f"Answers identical with the cache on and off: greedy {mt['greedy_identical']}/{mt['answers']}, "
            f"seeded T = 1 {mt['seeded_identical']}/{mt['seeded_answers']}.",
        ]
    if "chunked" in res:
        ch = res["chunked"]
        lines += [
            "",
            "## Chunked prefill: inter-token latency while a long prompt is admitted",
            "",
            f"{ch['streams']} streams decoding; a prompt of about {ch['long_tokens']} tokens admitted. "
            "ITL: gaps between streamed chunks of the running streams, while the long prompt waits for its "
            "first token (without it: a window of the same streams' decoding; both start once every stream "
            "has its first token). p99 / p50: the with-p99 over the without-p50 gap (not a round: under "
            "speculation a round's tokens arrive as several chunks, and the p99 without is already 2-3x "
            "the p50).",
            "",
            "| --max-num-batched-tokens | ITL p50 / p99 without s | ITL p50 / p99 with s | p99 ratio "
            "| p99 with / p50 without | long prompt: tokens, TTFT s |",
            "|---|---|---|---|---|---|",
        ]
        for label, r in ch["settings"].items():
            a, b = r["without"], r["with"]
            lines.append(
                f"| {label} | {a['itl_p50_s']:.3f} / {a['itl_p99_s']:.3f} | {b['itl_p50_s']:.3f} / "
                f"{b['itl_p99_s']:.3f} | {r['p99_ratio']:.2f} | {r['p99_over_p50_without']:.2f} | "
                f"{b['long_prompt_tokens']}, {b['long_ttft_s']:.2f} |"
            )
    if "ttft" in res:
        tt = res["ttft"]
        lines += [
            "",
            "## Time to first token on a long prompt",
            "",
            f"Prompts of about {tt['prompt_tokens']} tokens (HumanEval code to explain), each new to the "
            "server, one at a time; median of the reps after a warm-up.",
            "",
            "| server | prompt tokens | TTFT s (each) | median s |",
            "|---|---|---|---|",
        ]
        for label, r in tt["servers"].items():
            each = " / ".join(f"{x:.2f}" for x in r["ttft_s"])
            lines.append(f"| {label} | {r['prompt_tokens']:.0f} | {each} | {r['median_ttft_s']:.2f} |")
    lines += ["", "## Targets", ""]
    for t in res["targets"]:
        lines.append(f"- {t['target']}: {t['measured']} — **{'met' if t['met'] else 'missed'}**")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    if "load" not in res:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load = res["load"]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(load["runs"]))
    for m in load["methods"]:
        ys = [load["results"][m][run]["speedup"] for run in load["runs"]]
        ax.plot(x, ys, marker="o", label=m)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), load["runs"])
    ax.set_ylabel("tokens/s over speculation off")
    ax.set_title(f"specdecode serve, {res['target']}: speed-up under load (median of {res['reps']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", help="a draft model (methods draft and auto use it)")
    ap.add_argument("--dtype", help="the target's weights (default: the server's for this target)")
    ap.add_argument("--draft-dtype", help="the draft's weights (default: the server's)")
    ap.add_argument("--methods", default="none,ngram,suffix,eagle3,auto", help="comma-separated; none = off")
    ap.add_argument("--scenarios", default="load,multiturn,ttft,chunked")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--c1-sets", default="chat,code", help="prompt sets measured separately at c = 1")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default max(c, 4))")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="load: start every server at once and let each rep visit them in turn (a machine whose "
        "speed drifts over a long run then shifts them alike; needs the memory of all servers)",
    )
    ap.add_argument("--k", type=int, default=0, help="draft length (default: the server's)")
    ap.add_argument(
        "--multiturn-method", default="auto", help="the method of the multiturn and chunked servers"
    )
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--ttft-tokens", type=int, default=500, help="ttft: the long prompts' length")
    ap.add_argument("--ttft-reps", type=int, default=3, help="ttft: prompts per server")
    ap.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="chunked: seconds after every stream's first token before the long prompt is sent",
    )
    ap.add_argument("--window", type=float, default=10.0, help="chunked: seconds of ITL measured without it")
    ap.add_argument(
        "--chunked-settings",
        default="auto,512,off",
        help="chunked: the --max-num-batched-tokens settings to run (auto, a number, off)",
    )
    ap.add_argument(
        "--no-load-aware", action="store_true", help="draft k at any load (to show what the cap buys)"
    )
    ap.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=("llama-server",),
        help="also serve with llama.cpp's llama-server on the same GGUF files, plain and with -md "
        "(load scenario; known models only)",
    )
    ap.add_argument(
        "--server-args",
        default="",
        help="more options for every `specdecode serve` started, e.g. --server-args=--no-carry-prefill",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "serve")
    args = ap.parse_args()
    bad = [s for s in args.chunked_settings.split(",") if s not in ("auto", "off") and not s.isdigit()]
    if bad:
        ap.error(f"--chunked-settings: {bad[0]!r} is not auto, off or a number of tokens")
    args.peers = [p for p in PEERS if "llama-server" in args.peer and (p == "llama-server" or args.draft)]
    args.out.mkdir(parents=True, exist_ok=True)
    args.methods = [m for m in args.methods.split(",") if m]
    cs = [c.strip() for c in args.concurrency.split(",") if c.strip()]
    if not cs or not all(c.isdigit() and int(c) > 0 for c in cs):
        ap.error(f"--concurrency: {args.concurrency!r} is not a comma-separated list of positive numbers")
    args.cs = [int(c) for c in cs]
    scenarios = [s for s in args.scenarios.split(",") if s]
    sets = prompt_sets()
    import torch

    res = {
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "draft_dtype": args.draft_dtype,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "reps": args.reps,
        "interleave": args.interleave,
        "threads": torch.get_num_threads(),
        "server_args": args.server_args,
    }
    targets = []
    if "load" in scenarios:
        res["load"] = load_scenario(args, sets)
        targets += load_targets(res["load"], pair=bool(args.draft))
    if "multiturn" in scenarios:
        res["multiturn"] = mt = multiturn_scenario(args, sets)
        targets.append(
            {
                "target": "prefix cache: turn 2-4 TTFT <= 0.3x the same prompt's without the cache",
                "measured": f"worst turn {mt['later_turns_ratio']:.2f}x",
                "met": mt["later_turns_ratio"] <= 0.3,
            }
        )
        same = mt["greedy_identical"] == mt["answers"] and mt["seeded_identical"] == mt["seeded_answers"]
        targets.append(
            {
                "target": "prefix cache: greedy and seeded answers identical with it on and off",
                "measured": f"greedy {mt['greedy_identical']}/{mt['answers']}, seeded "
                f"{mt['seeded_identical']}/{mt['seeded_answers']}",
                "met": same,
            }
        )
    if "ttft" in scenarios:
        res["ttft"] = tt = ttft_scenario(args)
        ours = tt["servers"][args.multiturn_method]["median_ttft_s"]
        for peer in args.peers:
            theirs = tt["servers"][peer]["median_ttft_s"]
            targets.append(
                {
                    "target": f"time to first token on a {args.ttft_tokens}-token prompt <= {peer}'s",
                    "measured": f"{ours:.2f} s vs {theirs:.2f} s ({ours / theirs:.2f}x)",
                    "met": ours <= theirs,
                }
            )
    if "chunked" in scenarios:
        res["chunked"] = ch = chunked_scenario(args, sets)
        r = ch["settings"].get("auto")
    if "chunked" in scenarios and r is not None:
        targets.append(
            {
                "target": "chunked prefill: running rows' ITL p99 while a long prompt is admitted "
                "<= 2x their p99 without it",
                "measured": f"{r['p99_ratio']:.2f}x (auto"
                + (f"; off: {ch['settings']['off']['p99_ratio']:.2f}x)" if "off" in ch["settings"] else ")"),
                "met": r["p99_ratio"] <= 2.0,
            }
        )
    res["targets"] = targets
    (args.out / "serve-bench.json").write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    (args.out / "serve-bench.md").write_text(markdown(res))
    plot(res, args.out / "serve-bench.png")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
