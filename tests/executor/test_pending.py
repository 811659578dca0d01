"""PendingOutput: a step's sampled tokens on their way to the host.

CPU: the tokens are read in place, rows that did not sample get none. CUDA (skipped without
it): the copy goes into TokenSlots' persistent pinned buffers, reused in turn; a slot whose
previous owner has not been read yet is emptied into that owner first, even while its copy
is still queued behind other GPU work, so no step ever reads another step's tokens.
"""

from __future__ import annotations

import pytest
import torch

from llm_inference.executor.pending import PendingOutput, TokenSlots
from llm_inference.sample.sampler import STATUS_BAD, SamplerOutput


def _out(tokens: torch.Tensor) -> SamplerOutput:
    return SamplerOutput(tokens, None, tokens.clone())  # status: the token itself (no error)


def test_pending_on_cpu_reads_rows():
    pending = PendingOutput.launch(["a", "b", "c"], [0, 2], _out(torch.tensor([5, 7])))
    out = pending.result()
    assert out.request_ids == ["a", "b", "c"] and out.sampled_token_ids == [[5], [], [7]]
    assert pending.result() is out


def test_pending_reports_bad_status():
    bad = SamplerOutput(torch.tensor([1, 2]), None, torch.tensor([1, STATUS_BAD]))
    pending = PendingOutput.launch(["a", "b"], [0, 1], bad)
    for _ in range(2):  # the same error each time it is asked
        with pytest.raises(ValueError, match="NaN"):
            pending.result()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned token slots need CUDA")
def test_token_slots_reused_without_mixing_steps():
    slots = TokenSlots(rows=8)
    n_steps = 3 * TokenSlots.SLOTS + 1
    want, pendings = [], []
    for step in range(n_steps):
        n = 1 + step % 8
        tokens = torch.arange(n, device="cuda") + 100 * step
        if step % 3 == 0:
            torch.cuda._sleep(5_000_000)  # the copy queued well behind the host
        pendings.append(
            PendingOutput.launch([f"r{i}" for i in range(n)], list(range(n)), _out(tokens), slots)
        )
        want.append([[t] for t in tokens.tolist()])
        if step % 2:  # some steps read at once, the others only after their slot is reused
            assert pendings[-1].result().sampled_token_ids == want[-1]
    for step, pending in enumerate(pendings):
        assert pending.result().sampled_token_ids == want[step], step

    # Wider than the slots: a buffer of its own.
    tokens = torch.arange(12, device="cuda")
    wide = PendingOutput.launch([str(i) for i in range(12)], list(range(12)), _out(tokens), slots)
    assert wide.result().sampled_token_ids == [[t] for t in range(12)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned token slots need CUDA")
def test_token_slot_buffers_are_the_same_memory():
    slots = TokenSlots(rows=4)
    ptrs = []
    for step in range(2 * TokenSlots.SLOTS):
        pending = PendingOutput.launch(["a"], [0], _out(torch.tensor([step], device="cuda")), slots)
        ptrs.append(pending._host.data_ptr())
        assert pending.result().sampled_token_ids == [[step]]
    assert ptrs[: TokenSlots.SLOTS] == ptrs[TokenSlots.SLOTS :]
    assert len(set(ptrs)) == TokenSlots.SLOTS
