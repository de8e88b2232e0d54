"""Peers side by side on the real pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B-Instruct draft):
ours, transformers and llama.cpp on the same prompts, greedy, batch 1, 2 threads, one machine,
the systems interleaved prompt by prompt. Never needed by CI.

    .venv/bin/python benchmarks/peers.py --build-llama-cpp     # once: llama.cpp from the sdist
    .venv/bin/python benchmarks/peers.py --limit 4 --max-new-tokens 128

Systems (each reported as tokens/s and speed-up over its own target-only):
- ours: target-only, draft model (k), suffix, auto; target --dtype (default: what `specdecode
  demo` picks for this CPU), draft --draft-dtype (default bf16);
- transformers: generate, assisted generation with the 0.5B draft (k, constant schedule),
  prompt lookup (k), on our converted checkpoints in --hf-dtype;
- llama.cpp (built from llama-cpp-python==0.3.36's vendored sources, CMake Release, native
  flags): `llama-completion` (target-only; not `llama-simple`, which takes no thread count and
  ran 9-10 tok/s on 2 cores against llama-completion's 14.3 and llama-bench's 14.8),
  `llama-speculative-simple -md <draft>` and
  `llama-lookup`, on the GGUF files themselves (Q4_K_M) and, with --llama-bf16, on BF16 copies
  made by `llama-quantize --allow-requantize`;
- ours-ov (system `openvino`): our engine with `--backend openvino` (models/openvino.py: OpenVINO's
  CPU plugin runs target and draft, --ov-dtype, default int4-g128): target-only, draft model, auto;
- OpenVINO GenAI is not run: its LLMPipeline takes only stateful models exported by optimum-intel
  (whose export pulls another torch and transformers; see benchmarks/NOTES.md).

Prompts: the demo's four coding prompts (chat), HumanEval tasks (raw completion) and Spec-Bench
prompts (chat), --limit of each. Writes OUT/peers.json and OUT/peers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

LLAMA_CPP_VERSION = "0.3.36"
LLAMA_TOOLS = (
    "llama-completion",
    "llama-speculative-simple",
    "llama-lookup",
    "llama-quantize",
    "llama-bench",
    "llama-server",
)
THREADS = 2


def build_llama_cpp(dest: Path) -> Path:
    """llama.cpp's tools from the llama-cpp-python sdist (its vendor/llama.cpp), Release, native."""
    dest.mkdir(parents=True, exist_ok=True)
    bin_dir = dest / "build" / "bin"
    if all((bin_dir / t).exists() for t in LLAMA_TOOLS):
        return bin_dir
    if not (dest / "src" / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "-d",
                    tmp,
                    f"llama-cpp-python=={LLAMA_CPP_VERSION}",
                ],
                check=True,
            )
            (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            (src,) = Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")
            shutil.copytree(src, dest / "src", dirs_exist_ok=True)
    build = dest / "build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(dest / "src"),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            # without AMX: its matmul faults on the AMX Xeon VMs here (general protection fault
            # in ggml_backend_amx_mul_mat on any prompt of 2+ tokens; benchmarks/NOTES.md)
            "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
            "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_SERVER=ON",  # llama-server: benchmarks/serve.py --peer llama-server
        ],
        check=True,
    )
    subprocess.run(
        [
            "cmake",
            "--build",
            str(build),
            "--config",
            "Release",
            "-j",
            str(os.cpu_count() or 2),
            "--target",
            *LLAMA_TOOLS,
        ],
        check=True,
    )
    return bin_dir


_SPEED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+s")
# llama-completion: "eval time = 4399.51 ms / 63 runs" (the decoded tokens after the first)
_EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_DRAFTED = re.compile(r"n_draft(?:ed)?\s*=\s*(\d+)")


def run_llama(bin_dir: Path, tool: str, model: Path, prompt: str, n: int, k: int, draft: Path | None) -> dict:
    """One llama.cpp run; tokens and seconds of decoding (after the prompt) from its own lines:
    'decoded N tokens in S s' (lookup, speculative) or 'eval time = MS ms / N runs' (completion)."""
    args = [str(bin_dir / tool), "-m", str(model), "-n", str(n), "-p", prompt]
    args += ["-t", str(THREADS), "-tb", str(THREADS), "--temp", "0", "-c", "4096"]
    if tool == "llama-completion":
        args += ["-no-cnv", "--no-display-prompt", "--ignore-eos"]
    else:
        if tool == "llama-speculative-simple":
            args += [
                "-md",
                str(draft),
                "--spec-type",
                "draft-simple",
                "-td",
                str(THREADS),
                "-tbd",
                str(THREADS),
            ]
        args += ["--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    t0 = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - t0
    log = done.stdout + done.stderr
    if tool == "llama-completion":
        m = [(runs, float(ms) / 1e3) for ms, runs in _EVAL.findall(log)]
    else:
        m = _SPEED.findall(log)
    if done.returncode != 0 or not m:
        raise RuntimeError(f"{tool} failed ({done.returncode}): {log[-800:]}")
    tokens, secs = int(m[-1][0]), float(m[-1][1])
    acc, dr = _ACCEPT.findall(log), _DRAFTED.findall(log)
    out = {"tokens": tokens, "seconds": secs, "wall": wall}
    if acc and dr and int(dr[-1]):
        out["acceptance"] = int(acc[-1]) / int(dr[-1])
    return out


def run_llama_bench(bin_dir: Path, model: Path, n: int, pp: int = 512) -> dict:
    """llama-bench's own figures for the target: tg<n> (decoding) and pp<pp> (prompt) tokens/s."""
    args = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(THREADS), "-p", str(pp), "-n", str(n)]
    done = subprocess.run([*args, "-o", "json"], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr[-800:]}")
    rows = json.loads(done.stdout)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    pps = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    return {"tg": tg, "pp": pps, "pp_tokens": pp, "tg_tokens": n}


def run_ours(gen, params, w: dict) -> dict:
    gen.forget()  # each prompt on its own: no suffix drafts from other runs of it
    (r,) = gen.generate([w["ids"]], params)
    st = r.stats
    return {
        "tokens": len(r.token_ids),
        "seconds": st.wall_s - st.prefill_s,  # decoding, as llama.cpp's tools report it
        "prefill_s": st.prefill_s,
        "acceptance": st.acceptance_rate,
        "tau": st.tokens_per_forward,
        "draft_s": st.draft_s,
        "target_s": st.target_s,
        "rounds": st.rounds,
        "drafted": st.drafted,
        "token_ids": list(r.token_ids),  # greedy identity with ours target-only (the report)
    }


def with_torch_threads(n: int, run: Callable[[dict], dict], w: dict) -> dict:
    """run(w) with torch on n threads (the openvino rows give torch one; the others THREADS)."""
    import torch

    torch.set_num_threads(n)
    return run(w)


def run_transformers(runner, n: int, w: dict) -> dict:
    r = runner.run(w["ids"], 0.0, n, 0)
    return {"tokens": r.tokens, "seconds": r.seconds, "forwards": r.forwards}


def run_llama_prompt(
    bin_dir: Path, tool: str, model: Path, n: int, k: int, draft: Path | None, w: dict
) -> dict:
    return run_llama(bin_dir, tool, model, w["prompt_text"], n, k, draft)


def prompts(limit: int) -> list[dict]:
    from specdecode.bench.model_bench import read_prompts
    from specdecode.demo import CODE_PROMPTS

    out = [{"set": "code (chat)", "text": t, "chat": True} for t in CODE_PROMPTS[:limit]]
    out += [
        {"set": "humaneval (raw)", "text": p["text"], "chat": False}
        for p in read_prompts("humaneval")[:limit]
    ]
    spec = read_prompts("spec-bench")
    cats = list(dict.fromkeys(p["category"] for p in spec))
    out += [
        {
            "set": "spec-bench (chat)",
            "text": next(p for p in spec if p["category"] == c)["text"],
            "chat": True,
        }
        for c in cats[:limit]
    ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-llama-cpp", action="store_true", help="build llama.cpp's tools, then exit")
    ap.add_argument("--llama-dir", default=str(ROOT / "benchmarks" / ".llama.cpp"), help="where it is built")
    ap.add_argument("--limit", type=int, default=2, help="prompts of each set (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="auto", help="our target's format (default auto: measured)")
    ap.add_argument("--draft-dtype", default="auto", help="our draft's format (default auto)")
    ap.add_argument(
        "--draft-vocab",
        type=lambda s: int(s) if s.isdigit() else s,
        help="our draft's head list (N, FILE.json or a shipped name); adds a whole-head row",
    )
    ap.add_argument("--hf-dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--systems", default="ours,transformers,llama.cpp", help="comma-separated")
    ap.add_argument("--ov-dtype", default="auto", help="the openvino system's format (auto: int4-g128)")
    ap.add_argument("--llama-bf16", action="store_true", help="also llama.cpp on BF16 copies of the GGUFs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "qwen-pair"))
    args = ap.parse_args()
    llama_dir = Path(args.llama_dir)
    if args.build_llama_cpp:
        print(build_llama_cpp(llama_dir))
        return 0

    import torch

    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.bench.runners import TransformersRunner, load_transformers
    from specdecode.demo import PAIR_DRAFT, PAIR_TARGET
    from specdecode.formats import DTYPES
    from specdecode.models import ZOO, resolve
    from specdecode.opener import open_models

    torch.set_num_threads(THREADS)
    systems = set(args.systems.split(","))
    dt = lambda name: getattr(torch, DTYPES[name])
    # ours: the library's one loading path with the CLI's defaults (formats measured, invariant)
    loaded = open_models(
        PAIR_TARGET,
        draft=PAIR_DRAFT,
        k=args.k,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        draft_vocab=args.draft_vocab,
    )
    target, draft, inv = loaded.target, loaded.draft, loaded.config.batch_invariant
    threshold = loaded.config.confidence_threshold
    t_dtype = f"{loaded.choice.target} + draft {loaded.choice.draft}, draft policy {loaded.config.policy}" + (
        f" (threshold {threshold:g})" if threshold is not None else ""
    )
    tok = target.tokenizer
    work = prompts(args.limit)
    for w in work:
        w["ids"] = (
            tok.encode_chat([{"role": "user", "content": w["text"]}]) if w["chat"] else tok.encode(w["text"])
        )
        # llama.cpp tokenizes the text itself (the chat template's special tokens included)
        w["prompt_text"] = (
            tok.apply_chat_template([{"role": "user", "content": w["text"]}]) if w["chat"] else w["text"]
        )

    runners: dict[str, Callable[[dict], dict]] = {}
    n, k = args.max_new_tokens, args.k
    if "ours" in systems:
        vocab = loaded.config.draft_vocab  # --draft-vocab (FR-Spec), or None: the whole head
        policy = loaded.config.policy  # the library's default for a draft model (prefix)
        pol = {"policy": policy, "confidence_threshold": threshold}
        gens = {
            "ours target-only": SpeculativeGenerator(target, batch_invariant=inv),
            f"ours draft (k={k})": SpeculativeGenerator(
                target, draft=draft, k=k, batch_invariant=inv, draft_vocab=vocab, **pol
            ),
            f"ours suffix (k={k})": SpeculativeGenerator(target, method="suffix", k=k, batch_invariant=inv),
            f"ours auto (k={k})": SpeculativeGenerator(
                target, draft=draft, method="auto", k=k, batch_invariant=inv, draft_vocab=vocab, **pol
            ),
        }
        if vocab not in (None, "full"):  # what the smaller head costs in acceptance and saves per step
            gens[f"ours draft, whole head (k={k})"] = SpeculativeGenerator(
                target, draft=draft, k=k, batch_invariant=inv, **pol
            )
            gens[f"ours draft, list head always (k={k})"] = SpeculativeGenerator(
                target, draft=draft, k=k, batch_invariant=inv, **pol, draft_vocab=vocab,
                draft_vocab_fallback=0,
            )
            gens[f"ours auto, whole head (k={k})"] = SpeculativeGenerator(
                target, draft=draft, method="auto", k=k, batch_invariant=inv, **pol
            )
        params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
        for name, g in gens.items():
            run = partial(run_ours, g, params)
            runners[name] = partial(with_torch_threads, THREADS, run)
    if "openvino" in systems:
        ov = open_models(PAIR_TARGET, draft=PAIR_DRAFT, k=k, dtype=args.ov_dtype, backend="openvino")
        policy = ov.config.policy
        ov_gens = {
            "ours-ov target-only": SpeculativeGenerator(ov.target),
            f"ours-ov draft (k={k})": SpeculativeGenerator(ov.target, draft=ov.draft, k=k, **pol),
            f"ours-ov auto (k={k})": SpeculativeGenerator(
                ov.target, draft=ov.draft, method="auto", k=k, **pol
            ),
        }
        params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
        for name, g in ov_gens.items():  # torch's own ops on one thread beside the plugin (docs/openvino.md)
            run = partial(run_ours, g, params)
            runners[name] = partial(with_torch_threads, 1, run)
        torch.set_num_threads(THREADS)  # open_models set 1; the other systems' rows run on THREADS
    if "transformers" in systems:
        hf = load_transformers(resolve(PAIR_TARGET, dt(args.hf_dtype)), "cpu", dt(args.hf_dtype))
        hf_draft = load_transformers(resolve(PAIR_DRAFT, dt(args.hf_dtype)), "cpu", dt(args.hf_dtype))
        const = {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant"}
        hf_runners = {
            "transformers generate": TransformersRunner("g", hf, "generate", {}),
            f"transformers assisted (k={k})": TransformersRunner(
                "a", hf, "assisted", {"k": k}, hf_draft, const
            ),
            f"transformers prompt lookup (k={k})": TransformersRunner("l", hf, "lookup", {"k": k}),
        }
        runners.update({name: partial(run_transformers, r, n) for name, r in hf_runners.items()})
    if "llama.cpp" in systems:
        bin_dir = llama_dir / "build" / "bin"
        if not (bin_dir / "llama-completion").exists():
            print("llama.cpp is not built: run with --build-llama-cpp first; skipped", file=sys.stderr)
        else:
            files = {"Q4_K_M": (ZOO[PAIR_TARGET].gguf_path(), ZOO[PAIR_DRAFT].gguf_path())}
            if args.llama_bf16:
                files["BF16"] = tuple(_bf16_copy(bin_dir, p, llama_dir) for p in files["Q4_K_M"])
            for prec, (tm, dm) in files.items():
                for label, tool, d in (
                    ("plain", "llama-completion", None),
                    (f"draft (k={k})", "llama-speculative-simple", dm),
                    (f"lookup (k={k})", "llama-lookup", None),
                ):
                    runners[f"llama.cpp {prec} {label}"] = partial(
                        run_llama_prompt, bin_dir, tool, tm, n, k, d
                    )
    names = list(runners)
    for name in names:  # warm-up
        runners[name]({**work[0], "ids": work[0]["ids"][:32], "prompt_text": work[0]["prompt_text"][:100]})
    results: dict[str, list] = {name: [] for name in names}
    for i, w in enumerate(work):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            res = runners[name](w)
            res["set"] = w["set"]
            results[name].append(res)
            print(f"{w['set']:<18} {name:<36} {res['tokens'] / res['seconds']:6.2f} tok/s", file=sys.stderr)
    report = summarise(results, work, args, t_dtype)
    if "llama.cpp" in systems and (llama_dir / "build" / "bin" / "llama-bench").exists():
        bench = run_llama_bench(llama_dir / "build" / "bin", ZOO[PAIR_TARGET].gguf_path(), n)
        report["llama_bench"] = bench
        report["markdown"] += (
            f"- llama-bench (Q4_K_M target, {THREADS} threads): tg{n} {bench['tg']:.2f} tok/s, "
            f"pp{bench['pp_tokens']} {bench['pp']:.1f} tok/s\n"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps({"results": results, "report": report}, indent=2, default=str))
    (out / "peers.md").write_text(report["markdown"])
    print(report["markdown"])
    return 0


def _bf16_copy(bin_dir: Path, gguf: Path, llama_dir: Path) -> Path:
    out = llama_dir / (gguf.stem + ".bf16.gguf")
    if not out.exists():
        subprocess.run(
            [str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(out), "BF16"], check=True
        )
    return out


def _base_of(name: str, names: list[str]) -> str:
    system = name.split(" ")[0]
    if system == "llama.cpp":
        prec = name.split(" ")[1]
        return f"llama.cpp {prec} plain"
    return "transformers generate" if system == "transformers" else f"{system} target-only"


def summarise(results: dict, work: list[dict], args, t_dtype: str) -> dict:
    sets = list(dict.fromkeys(w["set"] for w in work))
    rate = {
        s: {
            name: sum(r["tokens"] for r in rs if r["set"] == s)
            / sum(r["seconds"] for r in rs if r["set"] == s)
            for name, rs in results.items()
        }
        for s in sets
    }
    names = list(results)
    lines = [
        f"# Peers on Qwen2.5-Coder-1.5B-Instruct (+0.5B draft), greedy, batch 1, {THREADS} threads, "
        f"{args.max_new_tokens} new tokens, k = {args.k}; ours: target {t_dtype}; "
        f"transformers {args.hf_dtype}",
        "",
        "| system | " + " | ".join(sets) + " | geometric mean speed-up |",
        "|---|" + "---|" * (len(sets) + 1),
    ]
    table = {}
    for name in names:
        base = _base_of(name, names)
        ups = [rate[s][name] / rate[s][base] for s in sets if base in rate[s]]
        gm = statistics.geometric_mean(ups) if ups else float("nan")
        table[name] = {"tokens_per_s": {s: rate[s][name] for s in sets}, "speedup_geomean": gm}
        cells = [f"{rate[s][name]:.2f} tok/s ({rate[s][name] / rate[s][base]:.2f}x)" for s in sets]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {gm:.2f}x |")
    lines += ["", "Speed-ups are over each system's own target-only on the same prompts in this run.", ""]
    best = {}
    for s in sets:  # each system's best mode per prompt set, ours over llama.cpp's
        ours = max((n for n in names if n.startswith("ours")), key=lambda n: rate[s][n], default=None)
        peer = max((n for n in names if n.startswith("llama.cpp")), key=lambda n: rate[s][n], default=None)
        if ours and peer:
            best[s] = {"ours": ours, "llama.cpp": peer, "ratio": rate[s][ours] / rate[s][peer]}
            lines.append(
                f"- {s}: ours best ({ours}, {rate[s][ours]:.2f} tok/s) / llama.cpp best ({peer}, "
                f"{rate[s][peer]:.2f} tok/s) = **{best[s]['ratio']:.2f}x**"
            )
    for system in ("ours", "ours-ov"):  # greedy identity with the same engine's target-only
        base = f"{system} target-only"
        if base in names and "token_ids" in results[base][0]:
            ref = [r["token_ids"] for r in results[base]]
            for name in names:
                if name.startswith(system + " ") and name != base:
                    same = sum(r["token_ids"] == t for r, t in zip(results[name], ref))
                    lines.append(f"- {name}: greedy tokens equal {base}'s on {same}/{len(ref)} prompts")
    plain = [n for n in names if n.startswith("llama.cpp") and n.endswith("plain")]
    for mine in ("ours target-only", "ours-ov target-only"):
        for s in sets:
            for p in plain if mine in names else ():
                lines.append(f"- {s}: {mine} / {p} = {rate[s][mine] / rate[s][p]:.2f}x")
    lines += _round_lines(results, names, sets)
    return {"table": table, "best": best, "markdown": "\n".join(lines) + "\n"}


def _round_lines(results: dict, names: list[str], sets: list[str]) -> list[str]:
    """Where a round's time goes, per speculative system of ours and prompt set: tokens a round
    (tau), and the drafter's and the target's milliseconds a round (their sums over the set)."""
    rows = []
    for name in names:
        rs = results[name]
        if not name.startswith("ours") or not rs or "rounds" not in rs[0] or "target-only" in name:
            continue
        cells = []
        for s in sets:
            mine = [r for r in rs if r["set"] == s]
            rounds = sum(r["rounds"] for r in mine)
            if not rounds:
                cells.append("-")
                continue
            tau = sum(r["tokens"] for r in mine) / rounds
            draft, target = (1e3 * sum(r[k] for r in mine) / rounds for k in ("draft_s", "target_s"))
            cells.append(f"{tau:.2f}; {draft:.1f}; {target:.1f}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    head = ["", "A round, per set (tokens a round; the drafter's ms; the target's ms):", ""]
    return head + ["| system | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets), *rows]


if __name__ == "__main__":
    sys.exit(main())
