"""specdecode: exact speculative decoding.

from specdecode import load, SpeculativeGenerator, SamplingParams
gen = specdecode.open("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")  # formats measured, cached
target = load("three-kingdoms/target")
gen = SpeculativeGenerator(target, draft=load("three-kingdoms/draft-64"), k=4)
gen.generate(["孔明曰：「"], SamplingParams(temperature=1.0, max_new_tokens=64, seed=0))

The core needs only torch, tokenizers, safetensors and numpy; the lab, bench, train and the
transformers adapter import their libraries when used (extras: specdecode[lab,bench,train,hf]).
"""

from .core.config import SpecConfig
from .core.sampling import SamplingParams, logits_to_probs
from .drafters import DRAFTERS, Drafter
from .engine import Generation, SpeculativeGenerator
from .engine.emit import GenerationResult, RoundEvent
from .engine.policy import CostModel
from .engine.stats import GenerationStats
from .engine.verify import verify_chain, verify_greedy
from .errors import SpecDecodeError
from .models import load
from .opener import open  # noqa: A004, F401 (specdecode.open, like gzip.open; not in __all__)

__version__ = "0.1.0"

__all__ = [
    "DRAFTERS",
    "CostModel",
    "Drafter",
    "Generation",
    "GenerationResult",
    "GenerationStats",
    "RoundEvent",
    "SamplingParams",
    "SpecConfig",
    "SpecDecodeError",
    "SpeculativeGenerator",
    "load",
    "logits_to_probs",
    "verify_chain",
    "verify_greedy",
]
