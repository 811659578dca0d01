"""Programmatic dependent launch (PDL, Hopper and newer), for the kernels of a decode step.

At batch 1 a decode step is a chain of small Triton kernels per layer, and each boundary costs
the next kernel's launch and ramp-up after the previous one has drained. With PDL
(`launch_pdl=True`) a kernel may be scheduled while the one before it finishes. Every kernel
that takes the `PDL` flag here waits (`gdc_wait`: the previous kernel complete, its memory
visible) before it reads or writes anything, then lets its own dependents launch
(`gdc_launch_dependents`): only the launch overlaps, never memory traffic, so results are
bit for bit those without PDL. Kernels launched without PDL (cuBLAS, torch) keep ordinary
stream order around them.

Whether a process's kernels launch with PDL is a property of its Triton ops object
(triton_ops.TritonOps.pdl, from `resolve` at construction), which passes it to each launcher
(`pdl=`); nothing here is process-wide. `benchmarks/pdl_chain.py` measures what it saves.
"""

from __future__ import annotations

import torch
import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without them (not CUDA's): PDL stays off
    gdc_launch_dependents = gdc_wait = None


def resolve(requested: bool | None, device: torch.device | str) -> bool:
    """Whether the kernels on `device` launch with PDL: `requested` None means wherever it is
    supported (a CUDA GPU of compute capability 9.0+ and a Triton with `gdc_wait`); True where
    it is not raises ValueError saying why (envs.LLM_INFERENCE_PDL)."""
    device = torch.device(device)
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    why = None
    if cc is None:
        why = f"needs a CUDA device, not {device}"
    elif cc[0] < 9:
        why = (
            f"needs a GPU of compute capability 9.0 or newer (Hopper); {device} is {cc[0]}.{cc[1]}"
        )
    elif gdc_wait is None:
        why = f"needs a Triton with gdc_wait; this one ({triton.__version__}) has none"
    if requested is None:
        return why is None
    if requested and why:
        raise ValueError(f"LLM_INFERENCE_PDL=1 {why}")
    return bool(requested)


def launch_kwargs(pdl: bool) -> dict:
    """Extra launch options for a kernel with a `PDL` flag (pass `PDL=pdl` too)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_then_release():
    """First thing in a PDL kernel: wait for the previous kernel, then let the next launch."""
    gdc_wait()
    gdc_launch_dependents()


__all__ = ["launch_kwargs", "resolve", "wait_then_release"]
