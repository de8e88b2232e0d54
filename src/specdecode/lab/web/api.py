"""The web lab's JSON and SSE API: each widget asks the real engine and models for its numbers.

Every function here takes a validated request and returns a plain dict (or, for live
generation, an iterator of dicts); the routes in `web/__init__.py` only translate. Models and
generators are loaded once and kept; a lock runs one computation at a time, because the lab
shares two CPU cores with whatever else the machine (or `specdecode serve`) is doing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ...core.theory import (
    acceptance_from_probs,
    expected_tokens_per_round,
    invariant_acceptance,
    invariant_bound,
    resample_from_target_tv,
)
from ...engine.verify import verify_chain
from ...errors import SpecDecodeError
from ...roofline import DTYPE_BYTES, HARDWARE, ModelSpec, forward_time, measure_cpu, spec_from_config

# Llama-3.1 shapes from their published config.json files (no weights needed for a roofline).
LLAMA_31 = {
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "llama-3.1-70b": {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
}
ROOFLINE_MODELS = (
    "three-kingdoms/target",
    "three-kingdoms/draft-64",
    "three-kingdoms/draft-128",
    "python-code/target",
    "python-code/draft",
    "smollm2-135m",
    "llama-3.1-8b",
    "llama-3.1-70b",
)
# (target, drafter) pairs the acceptance, replay and formula widgets offer: the bundled families
# with their small draft models; the real model only where it has a drafter (formula, generate)
RULE_PAIRS = {
    "three-kingdoms/target + draft-64": ("three-kingdoms/target", "three-kingdoms/draft-64"),
    "three-kingdoms/target + draft-128": ("three-kingdoms/target", "three-kingdoms/draft-128"),
    "python-code/target + draft": ("python-code/target", "python-code/draft"),
}
MEASURED_PAIRS = {
    **{name: (t, "draft", d) for name, (t, d) in RULE_PAIRS.items()},
    "smollm2-135m + eagle3": ("smollm2-135m", "eagle3", None),
}
PROMPTS = {
    "three-kingdoms/target": "孔明曰：「",
    "python-code/target": "def ",
    "smollm2-135m": "What is speculative decoding?",
}
GENERATE_TARGETS = {
    "three-kingdoms/target": ("draft-64", "draft-128", "eagle", "medusa", "ngram", "suffix"),
    "python-code/target": ("draft", "eagle", "medusa", "ngram", "suffix"),
    "smollm2-135m": ("eagle3", "ngram", "suffix", "auto"),
}
DRAFT_MODELS = {"draft", "draft-64", "draft-128"}


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RooflineRequest(Request):
    model: str = Field("smollm2-135m", description="a model preset (GET /lab/api/presets)")
    hardware: str = Field("h100-sxm", description="a hardware preset; 'cpu' is this machine, measured")
    k: int = Field(4, ge=1, le=32, description="draft tokens: compare 1 and k + 1 positions")
    dtype: str = Field("bf16", description="weight type: " + ", ".join(DTYPE_BYTES))
    context: int = Field(0, ge=0, le=131072, description="cached tokens each position attends to")


class PairRequest(Request):
    pair: str = Field(next(iter(RULE_PAIRS)), description="a target + draft pair (GET /lab/api/presets)")
    prompt: str = Field("", max_length=2000, description="the prefix; empty: the family's first prompt")


class DistRequest(PairRequest):
    top: int = Field(8, ge=1, le=20, description="tokens shown; the rest are pooled as 'others'")


class RoundRequest(PairRequest):
    seed: int = Field(0, ge=0, le=2**31 - 1)


class SampleRequest(PairRequest):
    rule: Literal["accept-if-equal", "resample-from-p", "residual", "invariant"]
    draws: int = Field(10_000, ge=100, le=200_000)
    seed: int = Field(0, ge=0, le=2**31 - 1)


class ReplayRequest(PairRequest):
    k: int = Field(4, ge=1, le=8)
    max_tokens: int = Field(32, ge=1, le=128)
    seed: int = Field(0, ge=0, le=2**31 - 1)


class FormulaRequest(Request):
    alpha: float = Field(0.6, ge=0.0, le=1.0, description="per-token acceptance rate")
    c: float = Field(0.1, ge=0.0, le=2.0, description="draft forward cost / target forward cost")
    k: int = Field(4, ge=1, le=16, description="draft tokens per round")


class MeasuredRequest(Request):
    pair: str = Field(next(iter(MEASURED_PAIRS)), description="a pair (GET /lab/api/presets)")
    k: int = Field(4, ge=1, le=8)


class GenerateRequest(Request):
    target: str = Field("three-kingdoms/target", description="a model (GET /lab/api/presets)")
    method: str = Field("draft-64", description="its drafter: a draft model or a method")
    k: int = Field(4, ge=1, le=8)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    prompt: str = Field("", max_length=2000, description="empty: the model's example prompt")
    max_tokens: int = Field(32, ge=1, le=256)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    baseline: bool = Field(True, description="also run target-only decoding, for the speed-up")


@dataclass
class Lab:
    """Loaded models, generators and measured figures, kept for the life of the server."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    models: dict = field(default_factory=dict)
    generators: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)

    # -- shared -------------------------------------------------------------------------
    def model(self, name: str):
        if name not in self.models:
            from ...models import load

            self.models[name] = load(name, dtype=torch.bfloat16 if name == "smollm2-135m" else torch.float32)
        return self.models[name]

    def pair(self, name: str) -> tuple:
        if name not in RULE_PAIRS:
            raise SpecDecodeError(f"unknown pair {name!r}; choose one of {', '.join(RULE_PAIRS)}")
        t, d = RULE_PAIRS[name]
        return self.model(t), self.model(d), t

    def encode(self, model, target: str, prompt: str) -> list[int]:
        text = prompt or PROMPTS[target]
        ids = model.tokenizer.encode(text)
        if not ids:
            raise SpecDecodeError(f"the prompt {text!r} encodes to no tokens; type some text")
        if len(ids) > 256:
            raise SpecDecodeError(f"the prompt has {len(ids)} tokens; the lab takes at most 256")
        return ids

    def show(self, model, t: int) -> str:
        return model.tokenizer.decode([int(t)])

    # -- presets ------------------------------------------------------------------------
    def presets(self) -> dict:
        return {
            "roofline_models": list(ROOFLINE_MODELS),
            "hardware": {
                **{k: {"name": h.name, "source": h.source} for k, h in HARDWARE.items()},
                "cpu": {"name": "this CPU (measured)", "source": "measured on first use"},
            },
            "dtypes": list(DTYPE_BYTES),
            "pairs": list(RULE_PAIRS),
            "measured_pairs": list(MEASURED_PAIRS),
            "prompts": PROMPTS,
            "generate": {t: list(m) for t, m in GENERATE_TARGETS.items()},
        }

    # -- 1. roofline --------------------------------------------------------------------
    def model_spec(self, name: str, dtype: str) -> tuple[ModelSpec, dict]:
        if dtype not in DTYPE_BYTES:
            raise SpecDecodeError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
        if name in LLAMA_31:
            config = LLAMA_31[name]
        elif name in ROOFLINE_MODELS:
            from ...models import resolve

            config = json.loads((resolve(name) / "config.json").read_text())
        else:
            raise SpecDecodeError(f"unknown model {name!r}; choose one of {', '.join(ROOFLINE_MODELS)}")
        return spec_from_config(config, name, dtype), config

    def hardware(self, name: str):
        if name == "cpu":
            if "cpu" not in self.cache:
                self.cache["cpu"] = measure_cpu()
            return self.cache["cpu"]
        if name not in HARDWARE:
            raise SpecDecodeError(f"unknown hardware {name!r}; choose one of {', '.join([*HARDWARE, 'cpu'])}")
        return HARDWARE[name]

    def roofline(self, r: RooflineRequest) -> dict:
        spec, config = self.model_spec(r.model, r.dtype)
        hw = self.hardware(r.hardware)
        out = {}
        for label, positions in (("one", 1), ("verify", r.k + 1)):
            t = forward_time(spec, hw, positions, context=r.context)
            out[label] = {
                "positions": positions,
                "compute_ms": t["compute_s"] * 1e3,
                "weight_read_ms": t["memory_s"] * 1e3,
                "time_ms": t["time_s"] * 1e3,
                "bound": t["bound"],
                "intensity": t["flops"] / t["bytes"],
            }
        d = config["hidden_size"]
        heads = config["num_attention_heads"]
        return {
            "model": r.model,
            "hardware": {
                "name": hw.name,
                "peak_tflops": hw.peak_flops / 1e12,
                "bandwidth_tbs": hw.bandwidth / 1e12,
                "ridge": hw.ridge,
                "source": hw.source,
            },
            "k": r.k,
            "dtype": r.dtype,
            "params": spec.params,
            "weight_gb": spec.weight_bytes / 1e9,
            "dims": {
                "layers": config["num_hidden_layers"],
                "hidden": d,
                "heads": heads,
                "kv_heads": config.get("num_key_value_heads") or heads,
                "head_dim": config.get("head_dim") or d // heads,
                "intermediate": config["intermediate_size"],
                "vocab": config["vocab_size"],
            },
            "verify_cost_ratio": out["verify"]["time_ms"] / out["one"]["time_ms"],
            **out,
        }

    # -- 2. acceptance rules ------------------------------------------------------------
    def probs(self, r: PairRequest) -> tuple[np.ndarray, np.ndarray, object, list[int]]:
        from ..common import next_token_probs

        key = ("probs", r.pair, r.prompt)
        if key not in self.cache:
            target, draft, tname = self.pair(r.pair)
            ids = self.encode(target, tname, r.prompt)
            self.cache[key] = (next_token_probs(target, ids), next_token_probs(draft, ids), target, ids)
        return self.cache[key]

    def shown_tokens(self, p: np.ndarray, q: np.ndarray, top: int) -> list[int]:
        """The `top` tokens with the most p + q, in order of p."""
        ids = np.argsort(-(p + q))[:top]
        return [int(i) for i in sorted(ids, key=lambda i: -p[i])]

    def bars(self, model, shown: list[int], **dists: np.ndarray) -> list[dict]:
        rows = [
            {"token": self.show(model, t), "id": t, **{k: float(v[t]) for k, v in dists.items()}}
            for t in shown
        ]
        rest = np.ones(len(next(iter(dists.values()))), dtype=bool)
        rest[shown] = False
        rows.append({"token": "others", "id": None, **{k: float(v[rest].sum()) for k, v in dists.items()}})
        return rows

    def dist(self, r: DistRequest) -> dict:
        p, q, model, ids = self.probs(r)
        shown = self.shown_tokens(p, q, r.top)
        residual = np.maximum(p - q, 0)
        residual /= residual.sum()
        return {
            "pair": r.pair,
            "prompt": model.tokenizer.decode(ids),
            "vocab": len(p),
            "alpha": acceptance_from_probs(p, q),
            "tv_pq": 0.5 * float(np.abs(p - q).sum()),
            "match_acceptance": float((p * q).sum()),
            "resample_from_p_tv": resample_from_target_tv(p, q),
            "tokens": self.bars(model, shown, p=p, q=q, residual=residual),
        }

    def round(self, r: RoundRequest) -> dict:
        """One k = 1 round through the engine's own verify_chain: x ~ q, u, the verdict, and on
        a rejection the residual and the token redrawn from it."""
        p, q, model, _ = self.probs(r)
        g = torch.Generator().manual_seed(r.seed)
        V = len(p)
        pt, qt = torch.from_numpy(p), torch.from_numpy(q)
        x = int(torch.multinomial(qt, 1, generator=g))
        u = torch.rand(1, 1, generator=g, dtype=torch.float64)
        noise = torch.empty(1, V, dtype=torch.float64).exponential_(generator=g)
        verdict = verify_chain(
            torch.tensor([[x]]), qt.view(1, 1, V), pt.view(1, 1, V).expand(1, 2, V), u, noise
        )
        accepted = bool(verdict.accepted_mask[0, 0])
        emitted = int(verdict.tokens[0, 0])
        residual = np.maximum(p - q, 0)
        residual /= residual.sum()
        shown = self.shown_tokens(p, q, 8)
        if emitted not in shown:
            shown = [*shown[:7], emitted]
        return {
            "draft_token": self.show(model, x),
            "draft_id": x,
            "q": float(q[x]),
            "p": float(p[x]),
            "accept_prob": float(min(1.0, p[x] / q[x])),
            "uniform": float(u),
            "accepted": accepted,
            "emitted_token": self.show(model, emitted),
            "emitted_id": emitted,
            "residual": None if accepted else self.bars(model, shown, residual=residual),
        }

    def sample(self, r: SampleRequest) -> dict:
        from ..rules import draw
        from ..stats import chi2_pvalue, noise_tvs, tv

        p, q, model, _ = self.probs(r)
        g = torch.Generator().manual_seed(r.seed)
        n = r.draws
        extra: dict = {}
        if r.rule == "accept-if-equal":
            x, y = draw(q, n, g), draw(p, n, g)
            acceptance = float((x == y).double().mean())
            counts = np.bincount(y.numpy(), minlength=len(p)).astype(np.float64)  # the output is y
        elif r.rule == "invariant":
            # one Exp(1) vector E per draw, shared: the target's token argmax p/E, the draft's guess
            # argmax q/E (verify_invariant's rule); the output never depends on q
            pt, qt = torch.from_numpy(p), torch.from_numpy(q)
            counts, hits = np.zeros(len(p)), 0
            for start in range(0, n, 4096):
                E = torch.empty(min(4096, n - start), len(p), dtype=torch.float64).exponential_(generator=g)
                y, x = (pt / E).argmax(-1), (qt / E).argmax(-1)
                hits += int((x == y).sum())
                counts += np.bincount(y.numpy(), minlength=len(p))
            acceptance = hits / n
            tv_pq = 0.5 * float(np.abs(p - q).sum())
            extra = {
                "closed_form": invariant_acceptance(p, q),
                "bound": invariant_bound(tv_pq),
                "one_minus_tv": 1 - tv_pq,
            }
        else:
            # x ~ q kept with probability min(1, p/q); a rejection redrawn from p (wrong) or from
            # norm(max(0, p - q)) (verify_chain's rule, vectorised here: 100,000 draws through
            # verify_chain itself take ~10 s on two cores; `specdecode lab rules` does that)
            x = draw(q, n, g)
            pt, qt = torch.from_numpy(p), torch.from_numpy(q)
            ok = torch.rand(n, generator=g, dtype=torch.float64) * qt[x] < pt[x]
            acceptance = float(ok.double().mean())
            redraw_from = p if r.rule == "resample-from-p" else np.maximum(p - q, 0)
            rejected = int((~ok).sum())
            out = x.clone()
            if rejected:
                out[~ok] = draw(redraw_from / redraw_from.sum(), rejected, g)
            counts = np.bincount(out.numpy(), minlength=len(p)).astype(np.float64)
        key = ("noise", r.pair, r.prompt, n)
        if key not in self.cache:
            noise = noise_tvs(p, n, sims=100, seed=r.seed)
            self.cache[key] = (float(noise.mean()), float(np.quantile(noise, 0.99)))
        noise_mean, noise_p99 = self.cache[key]
        distance = tv(counts, p)
        shown = self.shown_tokens(p, q, 8)
        freq = counts / n
        return {
            "rule": r.rule,
            "draws": n,
            "acceptance": acceptance,
            "tv": distance,
            "noise_tv_mean": noise_mean,
            "noise_tv_p99": noise_p99,
            "within_noise": distance <= noise_p99,
            "chi2_p": chi2_pvalue(counts, p),
            "tokens": self.bars(model, shown, p=p, observed=freq),
            **extra,
        }

    # -- 3. replay ----------------------------------------------------------------------
    def replay(self, r: ReplayRequest) -> dict:
        from ...core.sampling import SamplingParams
        from ...engine import SpeculativeGenerator

        target, draft, tname = self.pair(r.pair)
        ids = self.encode(target, tname, r.prompt)
        gen = SpeculativeGenerator(target, draft=draft, k=r.k)
        params = SamplingParams(temperature=1.0, max_new_tokens=r.max_tokens, seed=r.seed, ignore_eos=True)
        rounds, length = [], len(ids)
        for event in gen.stream([ids], params):
            for rec in event.records():
                d = rec.to_dict()
                length += len(d["emitted_token_ids"])
                d["draft_tokens"] = [self.show(target, t) for t in d["draft_token_ids"]]
                d["emitted_tokens"] = [self.show(target, t) for t in d["emitted_token_ids"]]
                d["cache_length"] = length
                rounds.append(d)
        tokens = sum(len(d["emitted_token_ids"]) for d in rounds)
        return {
            "pair": r.pair,
            "k": r.k,
            "prompt": target.tokenizer.decode(ids),
            "prompt_tokens": len(ids),
            "rounds": rounds,
            "tokens": tokens,
            "tokens_per_round": tokens / len(rounds),
        }

    # -- 4. formula vs measured ---------------------------------------------------------
    def formula(self, r: FormulaRequest) -> dict:
        """Leviathan et al.'s closed forms (specdecode.theory) at α, c, and the curve over k."""
        from ...core.theory import expected_speedup, optimal_k

        best = optimal_k(r.alpha, r.c)
        return {
            **r.model_dump(),
            "tokens_per_round": expected_tokens_per_round(r.alpha, r.k),
            "speedup": expected_speedup(r.alpha, r.k, r.c),
            "optimal_k": best,
            "optimal_speedup": expected_speedup(r.alpha, best, r.c),
            "curve": [
                {
                    "k": k,
                    "tokens_per_round": expected_tokens_per_round(r.alpha, k),
                    "speedup": expected_speedup(r.alpha, k, r.c),
                }
                for k in range(1, 17)
            ],
        }

    def measured(self, r: MeasuredRequest) -> dict:
        if r.pair not in MEASURED_PAIRS:
            raise SpecDecodeError(f"unknown pair {r.pair!r}; choose one of {', '.join(MEASURED_PAIRS)}")
        key = ("measured", r.pair, r.k)
        if key in self.cache:
            return self.cache[key]
        from ...core.sampling import SamplingParams
        from ...engine.stats import GenerationStats

        tname, method, dname = MEASURED_PAIRS[r.pair]
        gen = self.generator(tname, dname.rsplit("/", 1)[1] if dname else method, r.k)
        target = self.model(tname)
        prompts = (
            [PROMPTS[tname]]
            if tname != "smollm2-135m"
            else [
                [{"role": "user", "content": "What is speculative decoding?"}],
                [{"role": "user", "content": "Write a short poem about the sea."}],
            ]
        )
        seeds = 3
        jobs = [(pr, s) for pr in prompts for s in range(seeds)]
        t0 = time.perf_counter()
        results = gen.generate(
            [pr for pr, _ in jobs],
            [SamplingParams(temperature=1.0, max_new_tokens=48, seed=s, ignore_eos=True) for _, s in jobs],
        )
        st = GenerationStats.merge([x.stats for x in results], time.perf_counter() - t0)
        alpha = st.acceptance_rate
        pos = st.per_position_acceptance
        out = {
            "pair": r.pair,
            "k": r.k,
            "temperature": 1.0,
            "runs": len(jobs),
            "tokens": st.new_tokens,
            "alpha": alpha,
            # the fraction of rounds whose position i was accepted (vLLM's convention), what the
            # formula's single α predicts for it (α^i), and the rate given position i - 1 passed
            "per_position_acceptance": pos,
            "formula_per_position": [alpha ** (i + 1) for i in range(len(pos))],
            "conditional_acceptance": [a / b if b else 0.0 for a, b in zip(pos, [1.0, *pos])],
            "tokens_per_forward": st.tokens_per_forward,
            "formula_tokens_per_forward": expected_tokens_per_round(alpha, r.k),
            "vocab": target.vocab_size,
        }
        self.cache[key] = out
        return out

    # -- 5. live generation -------------------------------------------------------------
    def generator(self, target: str, method: str, k: int):
        from ...core.sampling import SamplingParams
        from ...engine import SpeculativeGenerator

        if target not in GENERATE_TARGETS:
            raise SpecDecodeError(f"unknown model {target!r}; choose one of {', '.join(GENERATE_TARGETS)}")
        if method != "none" and method not in GENERATE_TARGETS[target]:
            raise SpecDecodeError(
                f"{target} has no drafter {method!r}; choose one of {', '.join(GENERATE_TARGETS[target])}"
            )
        key = (target, method, k)
        if key not in self.generators:
            from ...opener import method_heads

            model = self.model(target)
            # the real model runs in bf16: batch-invariant kernels keep greedy speculative output
            # bit-identical to target-only decoding (docs/batch-invariance.md)
            options = {"batch_invariant": target == "smollm2-135m"}
            if method == "none":
                gen = SpeculativeGenerator(model, **options)
            elif method in DRAFT_MODELS:
                family = target.split("/")[0]
                gen = SpeculativeGenerator(model, draft=self.model(f"{family}/{method}"), k=k, **options)
            else:
                heads = method_heads(target, method, None)
                gen = SpeculativeGenerator(model, k=k, method=method, heads=heads, **options)
            # one short run first, so one-time costs do not land in the first timed run
            gen.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, ignore_eos=True))
            self.generators[key] = gen
        return self.generators[key]

    def generate_prompt(self, r: GenerateRequest) -> tuple:
        """The generator and the prompt's ids (the real model's through its chat template);
        SpecDecodeError when either is wrong, before anything streams."""
        spec = self.generator(r.target, r.method, r.k)
        text = r.prompt or PROMPTS[r.target]
        prompt = [{"role": "user", "content": text}] if r.target == "smollm2-135m" else text
        ids = spec.encode(prompt)
        if len(ids) > 256:
            raise SpecDecodeError(f"the prompt has {len(ids)} tokens; the lab takes at most 256")
        spec.check_request(ids, r.max_tokens)
        return spec, ids

    def generate(self, r: GenerateRequest) -> Iterator[dict]:
        """Events: one per round of the speculative run ('speculative'), then of target-only
        decoding ('target') when asked, then 'done' with the speed-up."""
        from ...core.sampling import SamplingParams

        spec, ids = self.generate_prompt(r)
        base = self.generator(r.target, "none", r.k) if r.baseline else None
        model = spec.target
        params = SamplingParams(temperature=r.temperature, max_new_tokens=r.max_tokens, seed=r.seed)
        summary = {}
        for phase, gen in (("speculative", spec), ("target", base)):
            if gen is None:
                continue
            t0 = time.perf_counter()
            tokens, drafted, accepted, rounds = 0, 0, 0, 0
            for event in gen.stream([ids], params):
                for rec in event.records():
                    rounds += 1
                    # tested: up to and including the first rejection (greedy rounds draw no uniforms)
                    drafted += min(len(rec.draft_token_ids), sum(rec.accepted) + 1)
                    accepted += sum(rec.accepted)
                    how = rec.how if phase == "speculative" else ["target"] * len(rec.emitted_token_ids)
                    tokens += len(rec.emitted_token_ids)
                    elapsed = time.perf_counter() - t0
                    yield {
                        "phase": phase,
                        "round": rounds,
                        "tokens": [
                            {"text": self.show(model, t), "how": h}
                            for t, h in zip(rec.emitted_token_ids, how)
                        ],
                        "total_tokens": tokens,
                        "tokens_per_forward": tokens / rounds,
                        "acceptance": accepted / drafted if drafted else None,
                        "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
                    }
            seconds = time.perf_counter() - t0
            summary[phase] = {
                "tokens": tokens,
                "rounds": rounds,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
            }
        done = {"phase": "done", **summary}
        if "target" in summary:
            done["speedup"] = summary["speculative"]["tokens_per_s"] / summary["target"]["tokens_per_s"]
        yield done
