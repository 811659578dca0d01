"""Programmatic dependent launch (PDL, Hopper and newer), for the kernels of a decode step.

At batch 1 a decode step is a chain of ~11 small Triton kernels per layer, and each boundary
costs the next kernel's launch and ramp-up after the previous one has drained. With PDL
(`launch_pdl=True`) a kernel may be scheduled while the one before it finishes. Every kernel
that takes the `PDL` flag here waits (`gdc_wait`: the previous kernel complete, its memory
visible) before it reads or writes anything, then lets its own dependents launch
(`gdc_launch_dependents`): only the launch overlaps, never memory traffic, so results are
bit for bit those without PDL. Kernels launched without PDL (cuBLAS, torch) keep ordinary
stream order around them.

The engine option `pdl` (None: on wherever it is supported, `resolve`) is applied by the model
runner of each process (`configure`); `benchmarks/pdl_chain.py` measures what it saves, and
`results/session5_2026-11-30_h200x2` what it saves per decode step.
"""

from __future__ import annotations

import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without them (not CUDA's): PDL stays off
    gdc_launch_dependents = gdc_wait = None

_enabled = False


def configure(enabled: bool) -> None:
    """Turn PDL on or off for the kernels launched by this process from now on."""
    global _enabled
    if enabled and gdc_wait is None:
        raise ValueError(f"pdl=True: this Triton ({triton.__version__}) has no gdc_wait")
    _enabled = bool(enabled)


def resolve(requested: bool | None, device) -> bool:
    """Whether the kernels on `device` launch with PDL: `requested` None means wherever it is
    supported (a CUDA GPU of compute capability 9.0+ and a Triton with `gdc_wait`); True where
    it is not raises ValueError saying why."""
    import torch

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
        raise ValueError(f"pdl=True {why}")
    return bool(requested)


def enabled() -> bool:
    return _enabled


def launch_kwargs() -> dict:
    """Extra launch options for a kernel with a `PDL` flag (pass `PDL=enabled()` too)."""
    return {"launch_pdl": True} if _enabled else {}


@triton.jit
def wait_then_release():
    """First thing in a PDL kernel: wait for the previous kernel, then let the next launch."""
    gdc_wait()
    gdc_launch_dependents()


__all__ = ["configure", "enabled", "launch_kwargs", "resolve", "wait_then_release"]
