from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from helpers import tiny_pair

hf_logging.disable_progress_bar()


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
