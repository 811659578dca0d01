import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Everything the tests load is local; without this transformers probes the hub (slow offline).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from helpers import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint with tokenizer, shared by the session (read-only)."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"))
