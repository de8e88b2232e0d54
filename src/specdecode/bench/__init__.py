"""The benchmark harness: our engine against Hugging Face transformers on the bundled models
(`specdecode bench`), and the scaling study (`specdecode bench --scaling`)."""

from .harness import BenchConfig, forward_costs, run_bench, save

__all__ = ["BenchConfig", "forward_costs", "run_bench", "save"]
