"""The Triton sampling kernel under the CPU interpreter: the checks of sampler_triton_checks.py
run in two child processes started with TRITON_INTERPRET=1 (one per core), so the interpreter
is on before triton is imported there; each check reports its own result here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sampler_triton_checks as checks  # noqa: E402
from interpreter import run_checks  # noqa: E402

# The heaviest first, alternating between the two children: ~35 s each on this machine.
HEAVY = ["distribution_combined", "boundaries", "distribution_top_p", "distribution_top_k"]
NAMES = HEAVY + [name for name in checks.CHECKS if name not in HEAVY]


@pytest.fixture(scope="module")
def results() -> tuple[dict[str, str], str]:
    groups = [NAMES[0::2], NAMES[1::2]]  # one child per core
    return run_checks(HERE / "sampler_triton_checks.py", groups, 600, OMP_NUM_THREADS="1")


@pytest.mark.parametrize("name", NAMES)
def test_sampling_kernel_in_interpreter(results, name):
    status, log = results
    assert status.get(name) == "ok", log[-8000:]


@pytest.mark.parametrize("launcher", ["sample", "race_shard"])
def test_launchers_reject_bad_inputs(launcher):
    """The checks `sample` and `race_shard` share raise before any launch, naming the input."""
    import torch

    from llm_inference.kernels import sampling

    def call(logits, keys, temperature, greedy=None):
        if launcher == "sample":
            return sampling.sample(logits, keys, temperature, greedy)
        return sampling.race_shard(logits, keys, temperature, greedy, 0)

    x, keys, temp = torch.randn(3, 10), torch.zeros(3, dtype=torch.int64), torch.ones(3)
    for bad, name in (
        ((x[0], keys, temp), "logits"),
        ((x.long(), keys, temp), "logits"),
        ((x.t(), keys, temp), "logits"),
        ((x, keys[:2], temp), "keys"),
        ((x, keys.float(), temp), "keys"),
        ((x, keys, temp.double()), "temperature"),
        ((x, keys, temp, torch.zeros(3)), "greedy"),
    ):
        with pytest.raises(ValueError, match=name):
            call(*bad)
