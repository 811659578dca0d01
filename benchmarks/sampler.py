"""Sampling step on the GPU: the PyTorch path against the fused Triton kernel (kernels/sampling.py).

Batch 1, 64 and 256 at V=128,256 float32 logits, temperature 0.6 alone and with top-p 0.9 and
top-k 50, every row seeded. Times `Sampler.forward` (penalties off; the host sync that checks
for broken rows and the float32 copy of the logits included, as the engine pays them) by CUDA
events, median of 50 calls after 5
warm-up calls, and prints one markdown row per case beside the floor: B*V*4 bytes read once at
4.2 TB/s (H200 HBM3e).

    PYTHONPATH=src python benchmarks/sampler.py
"""

from __future__ import annotations

import statistics

import torch

from llm_inference.kernels import reference, triton_ops
from llm_inference.sample.sampler import Sampler, SamplingMetadata
from llm_inference.sampling_params import SamplingParams

V = 128_256
BATCHES = [1, 64, 256]
CASES = {
    "T=0.6": SamplingParams(temperature=0.6),
    "T=0.6 top-p 0.9": SamplingParams(temperature=0.6, top_p=0.9),
    "T=0.6 top-k 50": SamplingParams(temperature=0.6, top_k=50),
    "T=0.6 top-k 50 top-p 0.9": SamplingParams(temperature=0.6, top_k=50, top_p=0.9),
}
HBM_BYTES_PER_S = 4.2e12


def median_ms(fn, warmup: int = 5, reps: int = 50) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    assert torch.cuda.is_available(), "benchmarks/sampler.py needs a CUDA GPU"
    print(f"{torch.cuda.get_device_name()}, V={V}, float32 logits\n")
    print("| batch | sampling | torch ms | triton ms | speedup | floor ms |")
    print("|---:|---|---:|---:|---:|---:|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch_path, triton_path = Sampler(reference), Sampler(triton_ops)
    for B in BATCHES:
        logits = torch.randn(B, V, device="cuda", generator=gen) * 3
        for name, params in CASES.items():
            md = SamplingMetadata.build(
                [params] * B, [[]] * B, [[]] * B, list(range(B)), (1,), V, "cuda"
            )
            t_torch = median_ms(lambda: torch_path(logits, md))  # noqa: B023
            t_triton = median_ms(lambda: triton_path(logits, md))  # noqa: B023
            floor = B * V * 4 / HBM_BYTES_PER_S * 1e3
            print(f"| {B} | {name} | {t_torch:.3f} | {t_triton:.3f} | "
                  f"{t_torch / t_triton:.1f}x | {floor:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
