"""What every lab experiment shares: its configuration (models, prompt, seed), its result
(tables, figures, checks, a paragraph on how to read it), and small measuring helpers."""

from __future__ import annotations

import io
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table as RichTable

from ..errors import SpecDecodeError

TARGET = "three-kingdoms/target"
DRAFTS = ("three-kingdoms/draft-64", "three-kingdoms/draft-128")
PROMPT = "孔明曰：「"
# the corpus is in simplified characters: 却说曹操 is the lessons' 卻說曹操
PROMPTS = ("孔明曰：「", "却说曹操", "玄德曰：「", "话说天下大势")
FAMILY_PROMPTS = {
    "three-kingdoms": PROMPTS,
    "python-code": ("def ", "import os\n", "class Test", "    return "),
}


def family_prompts(model_dir: Path) -> tuple[str, ...] | None:
    """The lab's prompts for the family a model was trained in (training.json), if known."""
    import json

    meta = Path(model_dir) / "training.json"
    if not meta.exists():
        return None
    return FAMILY_PROMPTS.get(json.loads(meta.read_text()).get("family"))


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    note: str = ""

    def rich(self) -> RichTable:
        t = RichTable(title=self.title, title_justify="left")
        for i, c in enumerate(self.columns):
            t.add_column(c, justify="left" if i == 0 else "right")
        for r in self.rows:
            t.add_row(*[_fmt(v) for v in r])
        return t

    def to_dict(self) -> dict:
        return {"title": self.title, "columns": self.columns, "rows": self.rows, "note": self.note}


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3g}"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.2f}"
    return str(v)


@dataclass
class LabResult:
    """One experiment's outcome: `data` holds every figure (the --json output), `checks` the
    claims the experiment tests, `figure` an optional matplotlib figure."""

    name: str
    title: str
    about: str
    reference: str
    tables: list[Table]
    data: dict
    checks: dict[str, bool] = field(default_factory=dict)
    figure: Any = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "experiment": self.name,
            "title": self.title,
            "seconds": self.seconds,
            "checks": self.checks,
            "data": self.data,
            "tables": [t.to_dict() for t in self.tables],
            "reference": self.reference,
        }

    def print(self, console: Console) -> None:
        console.rule(f"[bold]{self.title}")
        for t in self.tables:
            console.print(t.rich())
            if t.note:
                console.print(t.note, style="dim")
        for name, ok in self.checks.items():
            console.print(f"check {name}: " + ("[green]holds[/]" if ok else "[red]FAILS[/]"))
        console.print(f"lessons: {self.reference}", style="dim")

    def save_plot(self, path: str | Path) -> None:
        if self.figure is None:
            raise SpecDecodeError(f"experiment {self.name} draws no plot")
        try:
            self.figure.savefig(path, dpi=110, bbox_inches="tight")
        except OSError as e:
            raise SpecDecodeError(f"cannot write --plot file {path}: {e.strerror}") from None

    def png_bytes(self) -> bytes | None:
        if self.figure is None:
            return None
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        return buf.getvalue()


@dataclass
class LabConfig:
    """Which models and prompt an experiment runs on; models are loaded once and shared."""

    target: str = TARGET
    drafts: tuple[str, ...] = DRAFTS
    prompt: str = PROMPT
    prompts: tuple[str, ...] = PROMPTS
    seed: int = 0
    quick: bool = False
    progress: bool = True
    _models: dict = field(default_factory=dict, repr=False)

    def model(self, name: str):
        if name not in self._models:
            from ..models import load

            self._models[name] = load(name)
        return self._models[name]

    def check_pairs(self) -> None:
        t = self.model(self.target)
        for d in self.drafts:
            if self.model(d).vocab_size != t.vocab_size:
                raise SpecDecodeError(
                    f"draft {d} has vocabulary {self.model(d).vocab_size}, target {t.vocab_size}; "
                    "pass a draft trained with the target's tokenizer"
                )

    def track(self, items: Iterable, description: str, total: int | None = None) -> Iterator:
        if not self.progress:
            yield from items
            return
        from rich.progress import track

        yield from track(
            items, description=description, total=total, console=Console(stderr=True), transient=True
        )


def label(name: str) -> str:
    """Short display name: 'three-kingdoms/draft-64' -> 'draft-64', a path -> its last part."""
    return Path(str(name)).name


def plot_label(text: str, i: int) -> str:
    """Text for a plot: CJK glyphs are missing from matplotlib's bundled font, so a non-ASCII
    prompt is shown as 'prompt N' (the tables name it)."""
    return text if text.isascii() else f"prompt {i + 1}"


def encode(model, text: str) -> list[int]:
    if model.tokenizer is None:
        raise SpecDecodeError(f"{model.path} has no tokenizer; the lab needs text prompts")
    ids = model.tokenizer.encode(text)
    if not ids:
        raise SpecDecodeError(f"the prompt {text!r} encodes to no tokens")
    return ids


@torch.inference_mode()
def next_token_probs(model, ids: list[int]) -> np.ndarray:
    """The model's full next-token distribution at T = 1 after ids, in float64 [V]."""
    cache = model.new_cache(1, len(ids) + 1)
    logits = model.forward(torch.tensor([ids]), cache)[0][0, -1].double()
    return torch.softmax(logits, -1).numpy()


@torch.inference_mode()
def decode_step_seconds(model, context: int = 32, tokens: int = 1, reps: int = 30) -> float:
    """Median wall time of one cached forward of `tokens` positions after `context` tokens."""
    V = model.vocab_size
    ids = torch.randint(0, V, (1, context), generator=torch.Generator().manual_seed(0))
    step = torch.randint(0, V, (1, tokens), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(1, context + tokens + 1)
    model.forward(ids, cache)
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        model.forward(step, cache)
        times.append(time.perf_counter() - t0)
        cache.rewind(torch.tensor([context]))
    return float(np.median(times[3:]))


def cost_ratio(draft, target, rounds: int = 5) -> tuple[float, float]:
    """c = T(draft forward) / T(target forward), one-token cached steps, measured alternately so
    both see the same machine load; returns (c, target step seconds)."""
    ratios, steps = [], []
    for _ in range(rounds):
        t = decode_step_seconds(target, reps=10)
        d = decode_step_seconds(draft, reps=10)
        ratios.append(d / t)
        steps.append(t)
    return float(np.median(ratios)), float(np.median(steps))


def new_figure(*args, **kwargs):
    """A matplotlib figure with the non-interactive backend and a font that shows CJK if any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import font_manager

    names = {f.name for f in font_manager.fontManager.ttflist}
    cjk = [n for n in ("Noto Sans CJK SC", "WenQuanYi Zen Hei", "SimHei") if n in names]
    plt.rcParams["font.family"] = [*cjk, "DejaVu Sans"]
    fig, ax = plt.subplots(*args, **kwargs)
    return fig, ax
