"""Model families: models trained together on one corpus with one tokenizer.

The three-kingdoms shapes reproduce the lesson's parameter counts exactly (3,688,704 /
1,066,112 / 332,352 at vocab 2,048): Llama blocks with tied embeddings and an MLP width of
8/3 * dim rounded up to a multiple of 16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def mlp_width(dim: int) -> int:
    return 16 * math.ceil(8 * dim / 3 / 16)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dim: int
    layers: int
    head_dim: int = 32
    # hybrid models: the layers that are gated delta-rule linear attention (train/hybrid.py)
    linear_layers: tuple[int, ...] = ()
    # trained by a plain `specdecode train --family F`; False: only when named in --models
    default: bool = True

    @property
    def heads(self) -> int:
        return max(1, self.dim // self.head_dim)

    def num_parameters(self, vocab: int) -> int:
        """Parameters of this shape with tied embeddings (embedding + blocks + final norm)."""
        d, i = self.dim, mlp_width(self.dim)
        gates = len(self.linear_layers) * (2 * self.heads * d + self.heads)  # α, β projections
        return vocab * d + self.layers * (4 * d * d + 3 * d * i + 2 * d) + d + gates


@dataclass(frozen=True)
class Family:
    name: str
    vocab: int
    models: tuple[ModelSpec, ...]  # the first is the target
    file_glob: str  # which files of a corpus directory to read
    steps: int
    seq_len: int
    batch_size: int
    lr: float
    demo_prompt: str

    @property
    def target(self) -> ModelSpec:
        return self.models[0]

    @property
    def default_models(self) -> tuple[ModelSpec, ...]:
        """What a plain `specdecode train --family F` trains (not the ones only --models names)."""
        return tuple(m for m in self.models if m.default)


FAMILIES: dict[str, Family] = {
    "three-kingdoms": Family(
        name="three-kingdoms",
        vocab=2048,
        models=(
            ModelSpec("target", 256, 4),
            ModelSpec("draft-128", 128, 4),
            ModelSpec("draft-64", 64, 4),
            # the target's shape with 3 of its 4 layers linear attention: a hybrid target for the
            # same drafts (trained only when asked: --models hybrid)
            ModelSpec("hybrid", 256, 4, linear_layers=(0, 1, 2), default=False),
        ),
        file_glob="*.txt",
        steps=1000,
        seq_len=256,
        batch_size=16,
        lr=3e-3,
        demo_prompt="孔明曰：「",
    ),
    "python-code": Family(
        name="python-code",
        vocab=4096,
        models=(ModelSpec("target", 320, 6), ModelSpec("draft", 128, 2)),
        file_glob="*.py",
        steps=700,
        seq_len=256,
        batch_size=16,
        lr=2e-3,
        demo_prompt="def fibonacci(n):\n",
    ),
}
