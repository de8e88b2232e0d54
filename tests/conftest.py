import os
from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from helpers import tiny_pair

hf_logging.disable_progress_bar()

# the weights a load packs stay out of the user's cache (kernels/store.py): tests/test_store.py
# turns the store on, in a temporary cache, where it tests it
os.environ.setdefault("SPECDECODE_WEIGHT_CACHE", "0")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest workers on this 2-core machine: one torch thread each (and in
    # the CLI subprocesses they start), or the workers' OpenMP threads spin against each other
    import torch

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session")
def pair_dir(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft) checkpoint directories: a random 2-layer GQA Llama and a noisy copy."""
    return tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="session")
def vocab16_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft) directories for the distribution tests: vocab 16 (so 2-token joints have
    256 cells), init std 0.5 (peaked enough to accept, spread enough to reject), draft noise 0.15."""
    from helpers import noisy_copy
    from specdecode.models.init import init_model

    root = tmp_path_factory.mktemp("v16")
    t = init_model(root / "t", vocab=16, layers=2, dim=32, heads=2, seed=5, init_std=0.5)
    return t, noisy_copy(t, root / "d", noise=0.15, seed=6)


@pytest.fixture(scope="session")
def trained64(pair_dir, tmp_path_factory) -> dict:
    """Drafters trained briefly for the vocab-64 pair's target (each once per session): EAGLE by
    train-heads on a small corpus, EAGLE-3 by distill-data + train-heads over 48 of 64 tokens
    (its `eagle3_data` too)."""
    from helpers import train_tiny_eagle, train_tiny_eagle3

    root = tmp_path_factory.mktemp("trained64")
    eagle = train_tiny_eagle(pair_dir[0], root, [f"the cat sat on the mat {i}." for i in range(3000)], 32)
    prompts = [[(3 * i + j * j) % 64 for j in range(2 + i % 7)] for i in range(12)]
    data, eagle3 = train_tiny_eagle3(pair_dir[0], root, prompts, draft_vocab=48)
    return {"eagle": eagle, "eagle3": eagle3, "eagle3_data": data}


@pytest.fixture(scope="session")
def trained16(vocab16_dirs, tmp_path_factory) -> dict:
    """The same for the vocab-16 distribution-test target (EAGLE-3 over 12 of its 16 tokens)."""
    from helpers import train_tiny_eagle, train_tiny_eagle3

    root = tmp_path_factory.mktemp("trained16")
    eagle = train_tiny_eagle(vocab16_dirs[0], root, [f"ab{i % 7}c" for i in range(20000)], 16)
    prompts = [[(5 * i + j) % 16 for j in range(3 + i % 4)] for i in range(16)]
    _, eagle3 = train_tiny_eagle3(vocab16_dirs[0], root, prompts, draft_vocab=12, tokens=16)
    return {"eagle": eagle, "eagle3": eagle3}
