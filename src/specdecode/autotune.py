"""dtype="auto": each model on the weight format that runs fastest on this machine, measured.

The fastest format is not what a rule of thumb says: on an AVX-512 BF16 CPU a bf16 verification of
8 tokens costs about one bf16 step while a w8a8 step is 2.3x cheaper; on an AVX2 CPU bf16 has no
native kernel at all (benchmarks/NOTES.md). So at first use on a machine the projections of the
model's own shapes are timed in every candidate format: each layer's q|k|v, o, gate|up and down
and the LM head, at 1 row (a step, a draft token) and k + 1 rows (a verification), through the
same Linear classes and the same batch-invariant padding the model will run. The projections are
where a decoder's time goes (they read every weight); attention, norms and sampling cost the same
in every format and are left out, so the figures rank formats rather than predict a forward.
Enough copies of a layer are timed that they do not fit in the CPU's caches. Each time is the
fastest of several passes, and the two leading formats of each model are timed twice more,
interleaved, keeping each one's fastest (RETIMES): other work only ever adds time.

Prompts are another matter: a prefill feeds PREFILL_ROWS rows at once, where the formats rank
differently (AMD EPYC, avx512_bf16: the 0.5B draft's int4 step is the cheapest, 17.6 ms against
w8a8's 28.6, but its prompt tokens/s are 193 against w8a8's 455), so each format's seconds per
prompt token (`tp`) are timed too. A draft model whose step format is much slower on prompts
than the fastest format (PREFILL_GAIN) gets a second copy in that format for its prefills only
(`Choice.draft_prefill`): a draft's precision never changes the output, so its prompt may run on
other weights than its steps; the target's never does (a prompt's keys and values must be the
bits its own steps would write: the prefix cache and chunked prefill rely on it).

The choice (target: the cheapest verification round per token it yields, plus PROMPT_WEIGHT
prompt tokens per generated token, whether or not a drafter runs: one target format per machine
and model, so adding --draft never changes the text; draft: the cheapest step) rests on
measurements cached as JSON under $SPECDECODE_CACHE/calibration, one file per model (the target's
apart from the draft's, so target-only and speculative runs read the same one), keyed by the
model's shapes, the CPU, torch's version and thread count, k and invariance;
`specdecode models --calibrate` measures again. A format that fails here (no kernel, a kernel
whose row-invariance probe fails) is left out and said so in the table.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import SpecDecodeError
from .formats import FORMATS
from .paths import cpu_name

# candidates a measurement weighs (q4_k and q8_0 run the int4 / int8 kernels of the GGUF's own
# blocks: pin them with --dtype; fp16 has no fast CPU kernel)
TARGET_CANDIDATES = ("fp32", "bf16", "w8a8", "int8", "int4", "kq")
DRAFT_CANDIDATES = ("fp32", "bf16", "w8a8", "int8", "int4", "kq", "kq4", "kq3")
CACHED_BYTES = 320e6  # time enough layer copies to read at least this much (past any L3 cache)
HEAD_SLICE = 8  # the LM head is timed over 1/8 of its rows and scaled (its cost is linear in rows)
ALPHA = 0.8  # the acceptance a choice assumes before anything is measured (theory.py's formula)
VERSION = 5  # bump when the measurement changes: cached choices of another version are redone
# the two leading formats of each model are timed RETIMES more times, interleaved, each keeping
# its fastest: on a VM whose memory slows for seconds at a time (an AVX2-only EPYC: the 1.5B's kq
# T(5) 52.6-71.2 ms in three passes a minute apart, and a cached 104.7 that chose w8a8, 40% slower
# a step: benchmarks/NOTES.md, issue 53) one pass is not a measurement to keep for good
RETIMES = 2
LEADERS = 2
PREFILL_ROWS = 64  # the rows of a prefill chunk whose projections `tp` times
PREFILL_GAIN = 1.5  # a draft gets a prefill copy when the fastest prompt format is this much faster
# prompt tokens a target's choice counts per generated token (a chat turn's prompt and answer are of
# a size): a format cheap per step but slow on prompts (int4: 44 ms a step, 64 prompt tok/s) loses
# to one a little dearer per step and 3.5x faster on prompts (w8a8: 48 ms, 225)
PROMPT_WEIGHT = 1.0


@dataclass(frozen=True)
class Shapes:
    """What a format's cost depends on: the projections of one layer, the layer count, the head."""

    hidden: int
    qkv_out: int
    attn_in: int
    inter: int
    layers: int
    vocab: int
    # the kq blocks of a matrix whose width is no multiple of 256: a GGUF's own (Q5_0 in
    # llama.cpp's k-quant mixes), else float weights rounded to Q8_0
    narrow: str = "q8_0"

    @staticmethod
    def of(config, narrow: str = "q8_0") -> Shapes:
        c = config
        return Shapes(
            c.hidden_size,
            (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
            c.num_heads * c.head_dim,
            c.intermediate_size,
            c.num_layers,
            c.vocab_size,
            narrow,
        )

    def layer_matrices(self) -> list[tuple[int, int]]:
        """(out, in) of q|k|v, o, gate|up, down."""
        return [
            (self.qkv_out, self.hidden),
            (self.hidden, self.attn_in),
            (2 * self.inter, self.hidden),
            (self.hidden, self.inter),
        ]

    @property
    def layer_params(self) -> int:
        return sum(o * i for o, i in self.layer_matrices())


@dataclass
class FormatCosts:
    """Seconds of a forward's projections in one format: t1 for one new token, tk for k + 1, tp
    per prompt token of a PREFILL_ROWS-token prefill (the layers only: a prompt needs no logits)."""

    format: str
    t1: float | None = None
    tk: float | None = None
    error: str | None = None
    tp: float | None = None


@dataclass
class Choice:
    """The formats a generator runs with and why."""

    target: str
    draft: str | None
    k: int
    invariant: bool
    how: str  # measured | cached | pinned | default
    target_costs: list[FormatCosts] = field(default_factory=list)
    draft_costs: list[FormatCosts] = field(default_factory=list)
    cache: str | None = None
    seconds: float = 0.0
    draft_prefill: str | None = None  # the draft's prompts in this format (a second copy), or None

    def cost(self, costs: list[FormatCosts], fmt: str | None) -> FormatCosts | None:
        return next((c for c in costs if c.format == fmt and c.error is None), None)

    def predicted(self) -> dict:
        """Projection-only milliseconds of the chosen formats and the round they predict."""
        t, d = self.cost(self.target_costs, self.target), self.cost(self.draft_costs, self.draft)
        out = {}
        if t is not None:
            out |= {"target_t1_ms": round(t.t1 * 1e3, 2), "target_tk_ms": round(t.tk * 1e3, 2)}
        if d is not None:
            out |= {"draft_t1_ms": round(d.t1 * 1e3, 2)}
            if t is not None:
                out["draft_cost_ratio"] = round(d.t1 / t.t1, 3)
        return out

    def prefix_threshold(self) -> float | None:
        """The prefix policy's stop threshold from the chosen formats' measured costs: a draft
        step plus one more verified row, (T(k+1) - T(1)) / k, over a target step T(1), within
        [0.1, 0.9] (engine/policy.py PrefixPolicy); None without both costs."""
        t, d = self.cost(self.target_costs, self.target), self.cost(self.draft_costs, self.draft)
        if t is None or d is None or not t.t1 or not t.tk or not d.t1:
            return None
        row = max(0.0, (t.tk - t.t1) / self.k)
        return round(min(0.9, max(0.1, (d.t1 + row) / t.t1)), 2)

    def line(self) -> str:
        """One line for stderr: what was chosen, measured or cached, and how to redo it."""
        p = self.predicted()
        what = f"target {self.target}"
        if "target_t1_ms" in p:
            what += (
                f" (projections T(1) {p['target_t1_ms']:.0f} ms, T({self.k + 1}) {p['target_tk_ms']:.0f} ms)"
            )
        if self.draft is not None:
            what += f", draft {self.draft}"
            if "draft_t1_ms" in p:
                what += f" ({p['draft_t1_ms']:.1f} ms a step, c {p['draft_cost_ratio']:.2f})"
            if self.draft_prefill is not None:
                step = self.cost(self.draft_costs, self.draft)
                fast = self.cost(self.draft_costs, self.draft_prefill)
                what += f" with its prompts on a {self.draft_prefill} copy ({step.tp / fast.tp:.1f}x faster)"
        inv = "batch-invariant forward" if self.invariant else "plain forward (not batch-invariant)"
        how = {
            "measured": f"measured here in {self.seconds:.0f} s",
            "cached": "measured earlier on this machine (`specdecode models --calibrate` measures again)",
            "pinned": "as asked",
            "default": "default for this model and device",
        }[self.how]
        return f"specdecode: formats: {what}; {inv}; {how}"

    def summary(self) -> dict:
        """The choice in a few fields (--json stats, the server's start-up)."""
        return {
            "target": self.target,
            "draft": self.draft,
            "draft_prefill": self.draft_prefill,
            "batch_invariant": self.invariant,
            "how": self.how,
            **self.predicted(),
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["predicted"] = self.predicted()
        d["prefix_threshold"] = self.prefix_threshold()
        return d

    @staticmethod
    def from_dict(d: dict) -> Choice:
        d = dict(d)
        d.pop("predicted", None)
        d.pop("prefix_threshold", None)
        d["target_costs"] = [FormatCosts(**c) for c in d.get("target_costs", [])]
        d["draft_costs"] = [FormatCosts(**c) for c in d.get("draft_costs", [])]
        return Choice(**d)


def _layer_linears(shapes: Shapes, fmt: str, out_in: list[tuple[int, int]], gen):
    """Random projections of these (out, in) shapes in `fmt`, built the way load() builds them."""
    import torch

    from .models.linear import Linear
    from .models.quant import KERNEL_KINDS, QUANT_KINDS, DynamicInt8Linear, QuantLinear, QWeight

    spec = FORMATS[fmt]
    made = []
    for out, inp in out_in:
        if spec.quant is None:
            w = torch.randn(out, inp, generator=gen).mul_(0.02).to(getattr(torch, spec.activations))
            made.append(Linear(w))
            continue
        if spec.quant in KERNEL_KINDS:  # random blocks of the format a load gives this width
            from .models.kernel_linear import KernelLinear, random_blocks

            narrow = {"kq4": "q4_0", "kq3": "q3_0"}.get(spec.quant, shapes.narrow)
            seed = int(torch.randint(1 << 30, (1,), generator=gen))
            made.append(KernelLinear(random_blocks(out, inp, seed, narrow)))
            continue
        bits, group = QUANT_KINDS[spec.quant]
        scales = (torch.rand(out, generator=gen) * 1e-3 + 1e-4).to(torch.bfloat16).float()
        if bits == 8:
            q = torch.randint(-127, 128, (out, inp), generator=gen, dtype=torch.int8)
            qw = QWeight(8, q, scales)
            made.append(DynamicInt8Linear(qw, onednn=None) if spec.quant == "w8a8" else QuantLinear(qw))
        else:
            padded = -(-inp // group) * group
            q = torch.randint(0, 16, (out, padded), generator=gen, dtype=torch.uint8)
            s = (torch.rand(out, padded // group, generator=gen) * 1e-3 + 1e-4).to(torch.bfloat16).float()
            made.append(QuantLinear(QWeight(4, q, s, torch.zeros_like(s), group, inp)))
    return made


def _time_rows(linears: list, rows: int, dtype, invariant: bool, repeats: int) -> float:
    """The fastest of `repeats` passes of `rows` rows through every linear (at least 0.1 s of
    passes: other work on the machine only ever adds time, so the minimum is the kernel's)."""
    import torch

    xs = {lin.in_features: torch.randn(rows, lin.in_features).to(dtype) for lin in linears}
    with torch.inference_mode():
        for lin in linears:  # warm: packing caches, the invariance probe
            lin(xs[lin.in_features], invariant=invariant)
        times: list[float] = []
        while len(times) < repeats or (sum(times) < 0.1 and len(times) < 200):
            t0 = time.perf_counter()
            for lin in linears:
                lin(xs[lin.in_features], invariant=invariant)
            times.append(time.perf_counter() - t0)
    return min(times)


def measure(
    shapes: Shapes, fmt: str, k: int, invariant: bool, repeats: int = 5, with_tk: bool = True
) -> FormatCosts:
    """The projections' seconds of one forward in `fmt` at 1 and k + 1 rows (see the module doc)."""
    import torch

    from .models.quant import part_kind

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, FORMATS[fmt].activations)
    try:
        layer_bytes = shapes.layer_params * FORMATS[fmt].bytes_per_weight
        copies = int(min(shapes.layers, max(1, -(-CACHED_BYTES // layer_bytes))))
        # each projection in the format a load gives it (kq3: gate|up in Q3_0, the rest as kq4)
        parts = list(zip(("qkv", "o", "gate_up", "down"), shapes.layer_matrices())) * copies
        layers = [lin for part, m in parts for lin in _layer_linears(shapes, part_kind(fmt, part), [m], gen)]
        head_rows = max(16, shapes.vocab // HEAD_SLICE)
        head = _layer_linears(shapes, part_kind(fmt, "head"), [(head_rows, shapes.hidden)], gen)
        if FORMATS[fmt].quant == "w8a8":  # each shape's int8 kernel per row count, as a load chooses it
            from .models.quant import choose_int8_kernels

            choose_int8_kernels(layers + head, rows=(1, k + 1, PREFILL_ROWS))
        scale_layers, scale_head = shapes.layers / copies, shapes.vocab / head_rows
        out = FormatCosts(fmt)
        for rows in (1, k + 1) if with_tk else (1,):
            t = _time_rows(layers, rows, dtype, invariant, repeats) * scale_layers
            t += _time_rows(head, rows, dtype, invariant, repeats) * scale_head
            if rows == 1:
                out.t1 = t
            else:
                out.tk = t
        out.tp = _time_rows(layers, PREFILL_ROWS, dtype, invariant, 2) * scale_layers / PREFILL_ROWS
        return out
    except (RuntimeError, NotImplementedError, SpecDecodeError) as e:
        return FormatCosts(fmt, error=str(e).splitlines()[0][:160])


def _kernel_build(formats: tuple) -> str | None:
    """Our kernel's build key when kq is among the formats measured (a changed kernel is measured
    anew), else None."""
    if "kq" not in json.dumps(formats):
        return None
    from . import kernels

    return kernels.build_id()


def _key(target: Shapes, draft: Shapes | None, k: int, invariant: bool, formats: tuple) -> str:
    import torch

    blob = json.dumps(
        [
            VERSION,
            asdict(target),
            asdict(draft) if draft else None,
            k,
            invariant,
            formats,
            cpu_name(),
            torch.__version__,
            torch.get_num_threads(),
            _kernel_build(formats),
        ],
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def calibration_dir() -> Path:
    from .models.zoo import cache_dir

    return cache_dir() / "calibration"


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round emits at per-token acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def choose(
    target: Shapes,
    draft: Shapes | None,
    *,
    k: int,
    invariant: bool,
    speculative: bool,
    name: str = "model",
    target_formats: tuple[str, ...] = TARGET_CANDIDATES,
    draft_formats: tuple[str, ...] = DRAFT_CANDIDATES,
    recalibrate: bool = False,
    progress=None,
) -> Choice:
    """Measure (or read the cached measurement of) every candidate format and pick the target's
    and the draft's. Targets rank by a verification round (T(k+1) over the tokens a round yields
    at ALPHA) whether or not the run is speculative (`speculative` is kept for callers; it no
    longer changes the choice): the same prompt gives the same text with and without a drafter.
    The draft's format is the cheapest step (its precision never changes the output, only a
    little of its acceptance)."""
    t0 = time.perf_counter()
    jobs = [("target", target, f) for f in target_formats]
    jobs += [("target", target, "again")] * (RETIMES * min(LEADERS, len(target_formats)))
    jobs += [("draft", draft, f) for f in (draft_formats if draft else ())]
    jobs += [("draft", draft, "again")] * (RETIMES * min(LEADERS, len(draft_formats)) if draft else 0)
    done = [0]

    def step(label: str) -> None:
        if progress is not None:
            progress(done[0], len(jobs), label)
        done[0] += 1

    # the target's costs are cached on their own (keyed by the target alone), so a target-only run
    # and a speculative one read the same measurement and choose the same target format
    target_costs, t_how, path = _costs(
        "target", target, target_formats, k, invariant, name, recalibrate, step
    )
    draft_costs, d_how = [], t_how
    if draft is not None:
        draft_costs, d_how, _ = _costs("draft", draft, draft_formats, k, invariant, name, recalibrate, step)
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    how = "cached" if (t_how, d_how) == ("cached", "cached") else "measured"
    choice = Choice("", None, k, invariant, how, target_costs, draft_costs, path, time.perf_counter() - t0)
    return _pick(choice, speculative)


def _costs(who, shapes, formats, k, invariant, name, recalibrate, step) -> tuple[list, str, str | None]:
    """(one model's FormatCosts per format, 'cached' or 'measured', the cache file): read from
    the cache unless asked to measure again, else measured and written there."""
    key = _key(shapes, None, k, invariant, (who, formats))
    path = calibration_dir() / f"{name.replace('/', '_')}-{who}-{key}.json"
    if not recalibrate and path.exists():
        try:
            costs = [FormatCosts(**c) for c in json.loads(path.read_text())["costs"]]
            for _ in range(len(formats) + RETIMES * min(LEADERS, len(formats))):
                step(f"{who} (cached)")
            return costs, "cached", str(path)
        except (ValueError, TypeError, KeyError):
            pass  # unreadable: measure again
    costs = []
    for fmt in formats:
        step(f"{who} {fmt}")
        costs.append(measure(shapes, fmt, k, invariant, with_tk=who == "target"))
    ok = sorted((c for c in costs if c.error is None), key=lambda c: _score(who, c, k))
    lead = ok[:LEADERS]
    for _ in range(RETIMES):
        for c in lead:
            step(f"{who} {c.format} again")
            _keep_fastest(c, measure(shapes, c.format, k, invariant, with_tk=who == "target"))
    for _ in range(RETIMES * (min(LEADERS, len(formats)) - len(lead))):
        step(f"{who} (nothing to time again)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"shapes": asdict(shapes), "costs": [asdict(c) for c in costs]}, indent=1))
    except OSError as e:
        print(f"specdecode: cannot cache the format choice in {path}: {e.strerror}", file=sys.stderr)
        return costs, "measured", None
    return costs, "measured", str(path)


def _score(who: str, c: FormatCosts, k: int) -> float:
    """What _pick ranks a model's formats by: the target's verification round per token it
    yields plus its prompt share, the draft's step."""
    return c.tk / expected_tokens(ALPHA, k) + _prompt_share(c) if who == "target" else c.t1


def _keep_fastest(c: FormatCosts, again: FormatCosts) -> None:
    """c's times, each the faster of c's and `again`'s (other work only ever adds time)."""
    if again.error is not None:
        return
    for name in ("t1", "tk", "tp"):
        new = getattr(again, name)
        if new is not None:
            old = getattr(c, name)
            setattr(c, name, new if old is None else min(old, new))


def _pick(choice: Choice, speculative: bool) -> Choice:
    ok_t = [c for c in choice.target_costs if c.error is None]
    ok_d = [c for c in choice.draft_costs if c.error is None]
    if not ok_t:
        raise SpecDecodeError("no weight format ran on this machine; pass --dtype fp32")
    best_d = min(ok_d, key=lambda c: c.t1) if ok_d else None
    # one target format per machine and model, with or without a drafter (so adding a drafter
    # never changes the text): the cheapest verification round per token it yields, k draft steps
    # included (the same for every target format), plus its prompt share
    best_t = min(ok_t, key=lambda c: _score("target", c, choice.k))
    choice.target = best_t.format
    choice.draft = best_d.format if best_d else None
    choice.draft_prefill = None
    timed = [c for c in ok_d if c.tp is not None]
    if best_d is not None and best_d.tp is not None and timed:
        fast = min(timed, key=lambda c: c.tp)
        if fast.format != best_d.format and best_d.tp > PREFILL_GAIN * fast.tp:
            choice.draft_prefill = fast.format
    return choice


def _prompt_share(c: FormatCosts) -> float:
    """A generated token's share of prompt seconds (PROMPT_WEIGHT prompt tokens; 0 if not timed)."""
    return PROMPT_WEIGHT * (c.tp or 0.0)


def best_step(choice: Choice) -> str | None:
    """The measured format with the cheapest step (target-only decoding's best), if measured."""
    ok = [c for c in choice.target_costs if c.error is None]
    return min(ok, key=lambda c: c.t1).format if ok else None


def table(choice: Choice) -> list[str]:
    """The measured table as text lines (models --calibrate, docs)."""
    k = choice.k
    lines = [
        f"{'format':<10} {'T(1) ms':>9} {f'T({k + 1}) ms':>9} {f'T({k + 1})/T(1)':>11} {'prompt tok/s':>12}"
        "  (target: projections)"
    ]
    for c in choice.target_costs:
        mark = " <- chosen" if c.format == choice.target else ""
        if c.error:
            lines.append(f"{c.format:<10} {'-':>9} {'-':>9} {'-':>11} {'-':>12}  {c.error}")
        else:
            ms = f"{c.t1 * 1e3:>9.1f} {c.tk * 1e3:>9.1f} {c.tk / c.t1:>11.2f}"
            lines.append(f"{c.format:<10} {ms} {_rate(c):>12}{mark}")
    if choice.draft_costs:
        lines.append(f"{'format':<10} {'T(1) ms':>9} {'prompt tok/s':>12}  (draft: projections)")
        for c in choice.draft_costs:
            mark = " <- chosen" if c.format == choice.draft else ""
            if c.format == choice.draft_prefill:
                mark += " <- its prompts"
            t1, rate = ("-", "-") if c.error else (f"{c.t1 * 1e3:.1f}", _rate(c))
            lines.append(f"{c.format:<10} {t1:>9} {rate:>12}{mark}" + (f"  {c.error}" if c.error else ""))
    return lines


def _rate(c: FormatCosts) -> str:
    """Prompt tokens a second through the projections (a ranking, not a prefill's speed)."""
    return f"{1 / c.tp:.0f}" if c.tp else "-"
