"""A rank's torch profiler: `LLM.start_profile()` / `LLM.stop_profile()` run it on every rank
(in the worker processes too, where the parent's profiler cannot see), as vLLM's do.

On CUDA it sums the GPU kernels; on the CPU, the operators. `stop()` returns the rank's
summary, {"rank", "device", "total_ms", "kernels": {name: {"ms", "calls"}}}. Given a folder, it
also records the host side (operators and launches, on CUDA) and writes a Chrome trace,
`rank{r}.json` (chrome://tracing or Perfetto), where the gaps between kernels can be read."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class RankProfiler:
    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self._prof = None
        self._trace_dir: Path | None = None

    def start(self, trace_dir: str | None = None) -> None:
        if self._prof is not None:
            raise RuntimeError("the profiler is already running; stop_profile() first")
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # earlier steps stay out of the record
        self._trace_dir = Path(trace_dir) if trace_dir else None
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        if cuda and self._trace_dir is not None:
            activities.append(ProfilerActivity.CPU)
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def stop(self) -> dict:
        if self._prof is None:
            raise RuntimeError("the profiler is not running; start_profile() first")
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # every launched kernel is in the record
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        kernels: dict[str, dict] = {}
        for e in prof.events():
            if e.device_type != kind:
                continue
            k = kernels.setdefault(e.name, {"ms": 0.0, "calls": 0})
            # a kernel's own time on the GPU; an operator's time without its children on the CPU
            k["ms"] += (e.device_time if cuda else e.self_cpu_time_total) / 1e3
            k["calls"] += 1
        if self._trace_dir is not None:
            self._trace_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self._trace_dir / f"rank{self.rank}.json"))
        kernels = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["ms"]))
        return {
            "rank": self.rank,
            "device": str(self.device),
            "total_ms": sum(k["ms"] for k in kernels.values()),
            "kernels": kernels,
        }
