from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from helpers import tiny_pair

hf_logging.disable_progress_bar()


@pytest.fixture(scope="session")
def pair_dir(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft) checkpoint directories: a random 2-layer GQA Llama and a noisy copy."""
    return tiny_pair(tmp_path_factory.mktemp("pair"))
