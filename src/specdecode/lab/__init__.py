"""The lab: every experiment of the two source lessons, rerun on our models.

Each experiment is a module with run(cfg, ...) -> LabResult; `specdecode lab NAME` prints its
tables, --json gives every figure, --plot saves its figure, and `lab report` runs them all."""

from __future__ import annotations

from .common import LabConfig, LabResult, Table

EXPERIMENTS = ("roofline", "rules", "greedy", "replay", "formula", "speedup", "lesson2", "methods")

__all__ = ["EXPERIMENTS", "LabConfig", "LabResult", "Table", "run_experiment"]


def run_experiment(name: str, cfg: LabConfig, **options) -> LabResult:
    """Run one experiment by name; options go to its run()."""
    import importlib
    import time

    if name not in EXPERIMENTS:
        from ..errors import SpecDecodeError

        raise SpecDecodeError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    module = importlib.import_module(f".{name}", __name__)
    t0 = time.perf_counter()
    result = module.run(cfg, **options)
    result.seconds = time.perf_counter() - t0
    return result
