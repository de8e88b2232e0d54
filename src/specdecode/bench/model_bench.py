"""`specdecode bench --target MODEL`: any model, per prompt category (Spec-Bench's or a file's).

One process, batch 1: our target-only decoding, our drafting method, transformers' generate
and prompt lookup (and assisted generation with --draft) on the same checkpoint and dtype, and
llama.cpp when llama-cpp-python is importable and the model came from a GGUF. Each prompt is
run by every configuration in turn (the order rotates from prompt to prompt, so the machine's
load falls on all alike) after one warm-up run each. Per category: tokens/s, tokens per target
forward (tau), the speed-ups, and whether greedy output equals transformers generate token for
token. The runtime section has the target's verification cost T(k+1)/T(1), the memory floor
(weight bytes per token over this machine's measured read bandwidth) and the resident memory.
"""

from __future__ import annotations

import json
import platform
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..engine import SpeculativeGenerator
from ..errors import SpecDecodeError
from ..models import ZOO, resolve
from ..progress import bar
from .runners import LlamaCppRunner, OursRunner, Run, Runner, TransformersRunner, load_transformers

SPEC_BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "prompts" / "spec-bench" / "questions.jsonl"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def category_of(raw: str) -> str:
    """Spec-Bench's reporting category: the eight MT-bench ones are one, 'mt_bench'."""
    return "mt_bench" if raw in MT_BENCH else raw


def read_prompts(source: str) -> list[dict]:
    """[{"id", "category", "text"}] from 'spec-bench', 'humaneval' or a JSONL file. Each line:
    {"turns": [...]} (first turn used), {"prompt": ...} or {"text": ...}, with an optional
    "category". HumanEval's rows (category humaneval) keep their task for pass@1 ("task") and
    the chat-mode question ("chat_text")."""
    from .humaneval import HUMANEVAL, chat_text

    path = {"spec-bench": SPEC_BENCH, "humaneval": HUMANEVAL}.get(source, Path(source))
    if not path.is_file():
        raise SpecDecodeError(
            f"--prompts {source}: no such file; pass spec-bench, humaneval or a .jsonl file"
        )
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"{path}:{n} is not JSON ({e.msg})") from None
        text = (row.get("turns") or [None])[0] if isinstance(row, dict) else None
        text = text or (row.get("prompt") or row.get("text") if isinstance(row, dict) else None)
        if not isinstance(text, str) or not text:
            raise SpecDecodeError(f'{path}:{n} has no prompt; give "turns", "prompt" or "text"')
        task = row if {"task_id", "entry_point", "test"} <= set(row) else None
        raw = str(row.get("category", "humaneval" if task else "all"))
        prompt = {
            "id": row.get("question_id", row.get("task_id", row.get("id", n))),
            "category": category_of(raw),
            "text": text,
            "raw": raw,
        }
        if task is not None:
            prompt.update(task=task, chat_text=chat_text(text))
        out.append(prompt)
    if not out:
        raise SpecDecodeError(f"{path} holds no prompts")
    return _round_robin(out)


def _round_robin(prompts: list[dict]) -> list[dict]:
    """Within each reporting category, interleave its raw categories (writing, roleplay, ... for
    mt_bench), so that the first N prompts of a category cover all of them."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for p in prompts:
        groups.setdefault((p["category"], p["raw"]), []).append(p)
    out = []
    for cat in dict.fromkeys(p["category"] for p in prompts):
        lists = [g for (c, _), g in groups.items() if c == cat]
        for i in range(max(len(g) for g in lists)):
            out += [g[i] for g in lists if i < len(g)]
    return out


@dataclass
class ModelBenchConfig:
    target: str
    draft: str | None = None
    method: str | None = None
    heads: str | None = None
    k: int = 4
    policy: str = "fixed"
    ngram_max: int = 3
    ngram_min: int = 1
    prompts: str = "spec-bench"
    categories: tuple[str, ...] = ()
    per_category: int = 0  # 0 = every prompt
    chat: bool = False
    quick: bool = False
    max_new_tokens: int = 128
    temperature: float = 0.0
    dtype: str | None = None  # None: opener.default_dtype (auto for known models, else fp32)
    draft_dtype: str | None = None  # the draft model's (default: auto / the target's, opener.open_models)
    device: str = "cpu"
    # the heavy comparisons; None: on for small models, off for the known real models (a float
    # copy in transformers and a second forward mode of a 1.5B model cost minutes and gigabytes)
    transformers: bool | None = None
    llama_cpp: bool = True
    invariance: bool | None = None  # also run ours batch-invariant: divergences, cost, batch of 8
    tree: str | None = None  # a token tree for the method (e.g. 4,2,1)
    seed: int = 0
    sampling_rule: str = "standard"  # invariant: sampled runs must give target-only's text
    progress: bool = True

    @staticmethod
    def make(quick: bool = False, **overrides) -> ModelBenchConfig:
        base = {"quick": quick}
        if quick:
            base.update(per_category=2, max_new_tokens=64)
        cfg = ModelBenchConfig(**{**base, **{k: v for k, v in overrides.items() if v is not None}})
        heavy_default = cfg.target not in ZOO or cfg.target == "smollm2-135m"
        cfg.transformers = heavy_default if cfg.transformers is None else cfg.transformers
        cfg.invariance = heavy_default if cfg.invariance is None else cfg.invariance
        if cfg.k < 1:
            raise SpecDecodeError(f"--k must be >= 1, got {cfg.k}")
        if cfg.max_new_tokens < 4:
            raise SpecDecodeError(f"--max-new-tokens must be >= 4 for a benchmark, got {cfg.max_new_tokens}")
        if cfg.temperature < 0:
            raise SpecDecodeError(f"--temperature must be >= 0, got {cfg.temperature}")
        if cfg.method is None and cfg.draft is not None:
            cfg.method = "draft"
        # the drafting options, checked before any model is loaded
        from ..core.config import SpecConfig
        from ..drafters import DRAFTERS

        SpecConfig(
            method=cfg.method,
            k=cfg.k,
            policy=cfg.policy,
            ngram_max=cfg.ngram_max,
            ngram_min=cfg.ngram_min,
            tree=cfg.tree,
        )
        if cfg.method is not None and cfg.method not in DRAFTERS:
            raise SpecDecodeError(f"unknown --method {cfg.method!r}; choose one of {', '.join(DRAFTERS)}")
        if cfg.method == "draft" and not cfg.draft:
            raise SpecDecodeError("--method draft needs --draft MODEL")
        from ..opener import check_draft_dtype

        check_draft_dtype(cfg.draft_dtype, cfg.draft, cfg.method)
        return cfg


def read_bandwidth(dtype: torch.dtype, mbytes: int = 256, repeats: int = 7) -> float:
    """Bytes per second this machine reads from memory with torch's threads (a sum over a
    buffer far larger than the caches, best of `repeats`)."""
    a = torch.ones(mbytes * 2**20 // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.numel() * a.element_size() / best


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _weight_bytes(model) -> int:
    """Bytes one token's forward reads (quantized projections at their packed size)."""
    if hasattr(model, "weight_bytes"):
        return model.weight_bytes()
    return model.num_parameters() * torch.empty(0, dtype=model.dtype).element_size()


def _gguf_of(target: str, path: Path) -> Path | None:
    if target in ZOO:
        return ZOO[target].gguf_path()
    source = path / "SOURCE"  # written by import-gguf
    if source.exists():
        gguf = Path(source.read_text().strip().rsplit(" from ", 1)[-1])
        return gguf if gguf.is_file() else None
    return None


def _runners(cfg: ModelBenchConfig, loaded, dtype: torch.dtype, log) -> list[Runner]:
    from ..opener import method_heads

    rule = cfg.sampling_rule
    target, inv = loaded.target, loaded.config.batch_invariant
    solo = SpeculativeGenerator(target, batch_invariant=inv)
    runners: list[Runner] = [OursRunner("ours target-only", solo, "target-only", "-", {}, rule)]
    if cfg.invariance:
        gen = SpeculativeGenerator(target, batch_invariant=True)
        runners.append(OursRunner(INV_BASE, gen, "target-only", "-", {"batch_invariant": True}, rule))
    if cfg.method is not None:
        kw: dict = {"k": cfg.k, "method": cfg.method, "policy": cfg.policy}
        if cfg.method == "ngram":
            kw.update(ngram_max=cfg.ngram_max, ngram_min=cfg.ngram_min)
        if cfg.draft:
            kw["draft"] = loaded.draft
        elif cfg.draft_dtype:
            kw["draft_dtype"] = cfg.draft_dtype
        heads = method_heads(cfg.target, cfg.method, cfg.heads, draft=cfg.draft)
        if heads is not None:
            kw["heads"] = heads
        if cfg.tree:
            kw["tree"] = cfg.tree
        gen = SpeculativeGenerator(target, batch_invariant=inv, **kw)
        runners.append(
            OursRunner(f"ours {cfg.method} ({cfg.policy})", gen, cfg.method, cfg.policy, {"k": cfg.k}, rule)
        )
        if cfg.invariance:
            gen = SpeculativeGenerator(target, batch_invariant=True, **kw)
            settings = {"k": cfg.k, "batch_invariant": True}
            runners.append(OursRunner(_inv_method(cfg), gen, cfg.method, cfg.policy, settings, rule))
    if cfg.transformers and getattr(target, "quant", None) is not None:
        log(f"transformers: skipped (it runs float weights, the target here is {target.quant})")
    elif cfg.transformers:
        hf = load_transformers(resolve(cfg.target, dtype), cfg.device, dtype)
        runners.append(TransformersRunner("transformers generate", hf, "generate", {}))
        runners.append(
            TransformersRunner(f"transformers prompt lookup (k={cfg.k})", hf, "lookup", {"k": cfg.k})
        )
        if cfg.draft and getattr(loaded.draft, "quant", None) is None:
            draft_dtype = loaded.draft.dtype
            hf_draft = load_transformers(resolve(cfg.draft, draft_dtype), cfg.device, draft_dtype)
            const = {"num_assistant_tokens": cfg.k, "num_assistant_tokens_schedule": "constant"}
            runners.append(
                TransformersRunner(
                    f"transformers assisted (k={cfg.k})", hf, "assisted", {"k": cfg.k}, hf_draft, const
                )
            )
    if cfg.llama_cpp and cfg.temperature == 0 and cfg.device == "cpu":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            log("llama.cpp: llama-cpp-python is not installed; skipped (optional)")
        else:
            gguf = _gguf_of(cfg.target, resolve(cfg.target, dtype))
            if gguf is None:
                log("llama.cpp: the target did not come from a GGUF; skipped")
            else:
                runners.append(LlamaCppRunner(gguf, torch.get_num_threads(), 4096))
    return runners


INV_BASE = "ours target-only (batch-invariant)"


def _fixed_text(cfg: ModelBenchConfig) -> bool:
    """The output is a function of the target alone (greedy, or seeded under the invariant rule):
    every run must give target-only's tokens."""
    return cfg.temperature == 0 or cfg.sampling_rule == "invariant"


def _inv_method(cfg: ModelBenchConfig) -> str:
    return f"ours {cfg.method} ({cfg.policy}, batch-invariant)"


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where a and b differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _batched_outputs(runner: Runner, prompts: list[list[int]], cfg: ModelBenchConfig, batch: int) -> list:
    """Greedy outputs of `prompts` decoded `batch` at a time in one batch (seeds as in the runs)."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        params = [
            runner.params(cfg.temperature, cfg.max_new_tokens, cfg.seed + i + j) for j in range(len(chunk))
        ]
        out += [list(r.token_ids) for r in runner.gen.generate(chunk, params)]
    return out


def encode_prompt(target, prompt: dict, chat: bool) -> list[int]:
    tok = target.tokenizer
    if tok is None:
        raise SpecDecodeError(f"{target.path} has no tokenizer; bench needs text prompts")
    if chat:
        return tok.encode_chat([{"role": "user", "content": prompt.get("chat_text", prompt["text"])}])
    return tok.encode(prompt["text"])


def _text_until_eos(target, token_ids: list[int]) -> str:
    """The text of a run's tokens up to the model's first end-of-sequence token (runs ignore EOS
    so that every configuration makes the same number of tokens)."""
    eos = set(target.eos_token_ids)
    cut = next((i for i, t in enumerate(token_ids) if t in eos), len(token_ids))
    return target.tokenizer.decode(token_ids[:cut])


def _pass_at_1(target, prompts: list[dict], runs: dict[str, list[Run]], chat: bool) -> dict:
    """pass@1 of each greedy configuration's completions of HumanEval tasks: {runner: {...}}."""
    from .humaneval import pass_at_1

    tasks = [p["task"] for p in prompts]
    return {
        name: pass_at_1(tasks, [_text_until_eos(target, r.token_ids) for r in lst], chat)
        for name, lst in runs.items()
        if lst and lst[0].token_ids
    }


def _select_prompts(cfg: ModelBenchConfig) -> tuple[list[str], dict[str, list[dict]]]:
    """The categories to run, in order, and their prompts (checked: an unknown --category is an error)."""
    prompts = read_prompts(cfg.prompts)
    known = sorted({p["category"] for p in prompts})
    for c in cfg.categories:
        if c not in known:
            raise SpecDecodeError(f"unknown --category {c!r}; these prompts have {', '.join(known)}")
    chosen = [
        c for c in (CATEGORIES + tuple(known)) if c in known and (not cfg.categories or c in cfg.categories)
    ]
    chosen = list(dict.fromkeys(chosen))
    by_cat = {c: [p for p in prompts if p["category"] == c] for c in chosen}
    if cfg.per_category:
        by_cat = {c: ps[: cfg.per_category] for c, ps in by_cat.items()}
    return chosen, by_cat


def _summary(cfg: ModelBenchConfig, rs: dict[str, list[Run]]) -> dict:
    """Tokens/s, tau and speed-ups of each runner over these runs, with greedy identity checks."""
    out: dict = {"runners": {}}
    for name, lst in rs.items():
        tokens, secs, fwd = (
            sum(r.tokens for r in lst),
            sum(r.seconds for r in lst),
            sum(r.forwards for r in lst),
        )
        out["runners"][name] = {
            "tokens": tokens,
            "seconds": round(secs, 4),
            "tokens_per_s": round(tokens / secs, 3) if secs else None,
            "tau": round(tokens / fwd, 3) if fwd else None,
        }
    rate = {name: v["tokens_per_s"] for name, v in out["runners"].items()}
    ours_base = rate["ours target-only"]
    out["speedup_vs_ours_target_only"] = {n: round(v / ours_base, 3) for n, v in rate.items()}
    if "transformers generate" in rate:
        base = rate["transformers generate"]
        out["speedup_vs_transformers_generate"] = {n: round(v / base, 3) for n, v in rate.items()}
        lookup = next((n for n in rate if n.startswith("transformers prompt lookup")), None)
        if lookup and cfg.method:
            ours = f"ours {cfg.method} ({cfg.policy})"
            out["ours_method_vs_transformers_lookup"] = round(rate[ours] / rate[lookup], 3)
        if cfg.temperature == 0:
            ref = [r.token_ids for r in rs["transformers generate"]]
            out["greedy_identical_to_transformers"] = {
                n: f"{sum(a.token_ids == b for a, b in zip(lst, ref))}/{len(ref)}"
                for n, lst in rs.items()
                if n.startswith("ours")
            }
    if _fixed_text(cfg) and cfg.method:
        # speculation must not change greedy output (nor a seeded sample under the invariant
        # rule): every method against our own target-only
        ref = [r.token_ids for r in rs["ours target-only"]]
        lst = rs[f"ours {cfg.method} ({cfg.policy})"]
        out["greedy_identical_to_ours_target_only"] = (
            f"{sum(a.token_ids == b for a, b in zip(lst, ref))}/{len(ref)}"
        )
        out["divergences"] = {"plain": sum(a.token_ids != b for a, b in zip(lst, ref))}
        if cfg.invariance:
            ref = [r.token_ids for r in rs[INV_BASE]]
            lst = rs[_inv_method(cfg)]
            out["divergences"]["batch_invariant"] = sum(a.token_ids != b for a, b in zip(lst, ref))
    if cfg.invariance:
        # tokens/s of the invariant runs over the plain ones (1.0 = free)
        out["invariance_cost"] = {"target_only": round(rate[INV_BASE] / ours_base, 3)}
        if cfg.method:
            plain = rate[f"ours {cfg.method} ({cfg.policy})"]
            out["invariance_cost"]["method"] = round(rate[_inv_method(cfg)] / plain, 3)
    return out


def run_model_bench(cfg: ModelBenchConfig, log=print) -> dict:
    from ..opener import open_models

    chosen, by_cat = _select_prompts(cfg)

    rss0 = _rss_mb()
    loaded = open_models(
        cfg.target,
        draft=cfg.draft,
        method=cfg.method,
        k=cfg.k,
        dtype=cfg.dtype,
        draft_dtype=cfg.draft_dtype if cfg.draft else None,
        device=cfg.device,
        log=log,
    )
    target, dtype = loaded.target, loaded.target.dtype
    cfg.dtype = loaded.choice.target
    rss_model = _rss_mb() - rss0
    ids = {c: [encode_prompt(target, p, cfg.chat) for p in ps] for c, ps in by_cat.items()}
    runners = _runners(cfg, loaded, dtype, log)

    # runtime: verification cost, memory floor, memory
    from .harness import forward_costs

    k1 = cfg.k + 1
    costs = forward_costs(target, context=160, widths=(1, k1), repeats=3, calls=10)
    weight_bytes = _weight_bytes(target)
    bw = read_bandwidth(dtype) if cfg.device == "cpu" else float("nan")
    draft_model = next(
        (r.gen.drafter.model for r in runners if isinstance(r, OursRunner) and r.gen.drafter is not None),
        None,
    )
    draft_info = None
    if draft_model is not None:  # c by forwards: the draft's step over the target's
        d1 = forward_costs(draft_model, context=160, widths=(1,), repeats=3, calls=10)[1]
        draft_info = {
            "weights": getattr(draft_model, "quant", None) or str(draft_model.dtype).replace("torch.", ""),
            "weight_bytes": _weight_bytes(draft_model),
            "T(1)_ms": round(d1 * 1e3, 3),
            "c_forward": round(d1 / costs[1], 3),
        }
    floor_tps = bw / weight_bytes

    warm = ids[chosen[0]][0][:64]
    for r in runners:  # warm-up: one short run each
        r.run(warm, cfg.temperature, 8, cfg.seed)
    for r in runners:  # suffix / auto: no timed run drafts from a warm-up's output
        r.forget()
    runs: dict[str, dict[str, list[Run]]] = {c: {r.name: [] for r in runners} for c in chosen}
    work = [(c, i) for c in chosen for i in range(len(ids[c]))]
    for n, (c, i) in enumerate(bar(work, "benchmarking", enabled=cfg.progress)):
        order = runners[n % len(runners) :] + runners[: n % len(runners)]
        for r in order:
            runs[c][r.name].append(r.run(ids[c][i], cfg.temperature, cfg.max_new_tokens, cfg.seed + i))

    categories = {c: {"prompts": len(ids[c]), **_summary(cfg, runs[c])} for c in chosen}
    if cfg.temperature == 0:
        for c in chosen:
            if all("task" in p for p in by_cat[c]):
                categories[c]["pass_at_1"] = _pass_at_1(target, by_cat[c], runs[c], cfg.chat)
    if cfg.invariance and _fixed_text(cfg):
        # the same prompts 8 to a batch: every output must equal its batch-of-one run
        inv = next(r for r in runners if r.name == (_inv_method(cfg) if cfg.method else INV_BASE))
        for c in bar(chosen, "batch of 8", enabled=cfg.progress):
            alone = [r.token_ids for r in runs[c][inv.name]]
            batched = _batched_outputs(inv, ids[c], cfg, 8)
            firsts = [_first_difference(a, b) for a, b in zip(alone, batched)]
            categories[c]["batch8_divergences"] = {
                "runner": inv.name,
                "prompts": sum(f is not None for f in firsts),
                "first_difference": [f for f in firsts if f is not None],
            }
    overall = _summary(cfg, {r.name: [x for c in chosen for x in runs[c][r.name]] for r in runners})
    if "batch8_divergences" in categories[chosen[0]]:
        overall["batch8_divergences"] = sum(categories[c]["batch8_divergences"]["prompts"] for c in chosen)
    ours_tps = overall["runners"]["ours target-only"]["tokens_per_s"]
    targets = drafter_targets(cfg, categories)
    return {
        "kind": "model-bench",
        "config": asdict(cfg),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "runtime": {
            "parameters": target.num_parameters(),
            "weights": cfg.dtype,
            "weight_bytes": weight_bytes,
            "draft": draft_info,
            "read_bandwidth_gb_s": round(bw / 1e9, 2),
            "memory_floor_tokens_per_s": round(floor_tps, 2),
            "ours_target_only_fraction_of_floor": round(ours_tps / floor_tps, 3),
            "forward_ms": {"T(1)": round(costs[1] * 1e3, 3), f"T({k1})": round(costs[k1] * 1e3, 3)},
            "verification_cost": round(costs[k1] / costs[1], 3),
            "rss_growth_loading_target_mb": round(rss_model, 1),
            "rss_growth_over_weight_bytes": round(rss_model * 2**20 / weight_bytes, 3),
        },
        "categories": categories,
        "overall": overall,
        "targets": targets,
        "runners": [r.name for r in runners],
    }


# the trained-drafter targets (issue: drafters for real models), per method and temperature:
# (what, category or "mt_bench", threshold)
TARGETS = {
    ("eagle3", True): [("tau", "mt_bench", 2.5), ("speedup", "mt_bench", 2.0)],
    ("eagle3", False): [("tau", "mt_bench", 2.0), ("speedup", "mt_bench", 1.6)],
    ("auto", True): [
        ("speedup", "summarization", 2.5),
        ("speedup", "rag", 2.5),
        ("speedup", "humaneval", 2.0),
    ],
    # the real pair (Qwen2.5-Coder-1.5B + 0.5B): the best method >= 2x on HumanEval
    ("draft", True): [("speedup", "humaneval", 2.0)],
}


def drafter_targets(cfg: ModelBenchConfig, categories: dict) -> list[dict]:
    """The method's targets measured here: tau (tokens per target forward) or the speed-up over
    ours target-only, in the category named, with the threshold and whether it is met."""
    out = []
    name = f"ours {cfg.method} ({cfg.policy})"
    for what, cat, threshold in TARGETS.get((cfg.method, cfg.temperature == 0), []):
        if cat not in categories:
            continue
        c = categories[cat]
        value = c["runners"][name]["tau"] if what == "tau" else c["speedup_vs_ours_target_only"][name]
        out.append(
            {
                "metric": what,
                "category": cat,
                "value": value,
                "target": threshold,
                "met": value is not None and value >= threshold,
            }
        )
    return out


def markdown(res: dict) -> str:
    cfg, rt = res["config"], res["runtime"]
    lines = [
        f"# bench: {cfg['target']} ({cfg['dtype']}, {cfg['device']}), method {cfg['method'] or '-'}, "
        f"k={cfg['k']}, T={cfg['temperature']}, {cfg['max_new_tokens']} tokens, chat={cfg['chat']}",
        "",
        f"Runtime: T(1) {rt['forward_ms']['T(1)']} ms, verification cost T({cfg['k'] + 1})/T(1) "
        f"{rt['verification_cost']}; memory floor {rt['memory_floor_tokens_per_s']} tokens/s "
        f"({rt['weight_bytes'] / 1e6:.0f} MB per token at {rt['read_bandwidth_gb_s']} GB/s read), ours "
        f"target-only reaches {rt['ours_target_only_fraction_of_floor']:.0%} of it; loading the target grew "
        f"the resident set by {rt['rss_growth_loading_target_mb']} MB ({rt['rss_growth_over_weight_bytes']}x "
        "the weight bytes).",
        "",
    ]
    d = rt.get("draft")
    if d:
        lines[-1:-1] = [
            f"Draft: {d['weights']}, {d['weight_bytes'] / 1e6:.0f} MB per token, T(1) {d['T(1)_ms']} ms: "
            f"c = {d['c_forward']} of the target's ({rt.get('weights', '')}) forward.",
        ]
    names = res["runners"]
    lines.append("| category | prompts | " + " | ".join(names) + " |")
    lines.append("|---|---|" + "---|" * len(names))
    for cat, c in [*res["categories"].items(), ("overall", {**res["overall"], "prompts": ""})]:
        cells = []
        for n in names:
            r = c["runners"][n]
            sp = c["speedup_vs_ours_target_only"][n]
            cells.append(f"{r['tokens_per_s']:.1f} tok/s, τ {r['tau']}, {sp:.2f}x")
        lines.append(f"| {cat} | {c['prompts']} | " + " | ".join(cells) + " |")
    lines += ["", "Speed-ups are over ours target-only. τ: tokens per target forward."]
    for cat, c in res["categories"].items():
        if "pass_at_1" in c:
            lines.append(
                f"pass@1 on {cat} (greedy completions, the tasks' own tests): "
                + ", ".join(f"{n} {v['passed']}/{v['tasks']}" for n, v in c["pass_at_1"].items())
            )
    for t in res.get("targets", []):
        mark = "met" if t["met"] else "MISSED"
        lines.append(f"Target: {t['metric']} on {t['category']} {t['value']} (>= {t['target']}): {mark}")
    ov = res["overall"]
    if "greedy_identical_to_transformers" in ov:
        lines.append(
            "Greedy output identical to transformers generate: "
            + ", ".join(f"{n} {v}" for n, v in ov["greedy_identical_to_transformers"].items())
        )
    if "greedy_identical_to_ours_target_only" in ov:
        lines.append(
            f"Greedy output of ours {cfg['method']} identical to ours target-only: "
            f"{ov['greedy_identical_to_ours_target_only']}"
        )
    if "ours_method_vs_transformers_lookup" in ov:
        lines.append(
            f"Ours {cfg['method']} over transformers prompt lookup: "
            f"{ov['ours_method_vs_transformers_lookup']}x"
        )
    if "divergences" in ov or "invariance_cost" in ov:
        lines += [
            "",
            "Batch invariance (prompts whose greedy speculative output differs from target-only, "
            "plain forward vs batch-invariant forward; the invariant runs' tokens/s over the plain ones; "
            "prompts whose output changes when decoded 8 to a batch):",
            "",
            "| category | differ, plain | differ, batch-invariant | cost, target-only | cost, method "
            "| batch of 8 differs |",
            "|---|---|---|---|---|---|",
        ]
        for cat, c in [*res["categories"].items(), ("overall", ov)]:
            d, cost = c.get("divergences", {}), c.get("invariance_cost", {})
            b8 = c.get("batch8_divergences", "-")
            b8 = b8["prompts"] if isinstance(b8, dict) else b8
            lines.append(
                f"| {cat} | {d.get('plain', '-')} | {d.get('batch_invariant', '-')} | "
                f"{cost.get('target_only', '-')} | {cost.get('method', '-')} | {b8} |"
            )
    return "\n".join(lines) + "\n"


def save_model_bench(res: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "model-bench.json", "markdown": out / "model-bench.md"}
    paths["json"].write_text(json.dumps(res, indent=2, ensure_ascii=False))
    paths["markdown"].write_text(markdown(res))
    return paths


__all__ = ["ModelBenchConfig", "read_prompts", "run_model_bench", "save_model_bench"]
