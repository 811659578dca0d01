"""GPU time of the fused sampler's race alone, as a decode step launches it: bfloat16 logits
[B, 128,256], int32 keys, temperature 0.6, no greedy row, no top-k/top-p/min-p (the split race
and its merge at these batches). Each call replayed from a CUDA graph (triton's
do_bench_cudagraph, median), so the Python launcher's time is left out; beside the floor, the
logits read once at 4.24 TB/s. Run it with PYTHONPATH on two trees to compare kernels, or with
--accurate-log to time the race with libdevice's logf as its outer log instead of the hardware's
lg2.approx (sampling.FAST_LOG; kernels/sampling.py's doc, "Noise").

    PYTHONPATH=src python3 benchmarks/sampler_race.py [--batches 1,8,64,128,256] [--json PATH]
        [--accurate-log]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton.testing

from llm_inference.kernels import sampling

V = 128_256
BANDWIDTH = 4.24e12  # bytes/s, the H200's measured copy rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64,128,256")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--accurate-log",
        action="store_true",
        help="the race's outer log by libdevice's logf, not lg2.approx (sampling.FAST_LOG)",
    )
    args = p.parse_args()
    sampling.FAST_LOG = not args.accurate_log  # before the first launch compiles the race
    rows = {}
    print("| batch | race us | floor us |\n|---:|---:|---:|")
    for b in [int(x) for x in args.batches.split(",")]:
        gen = torch.Generator(device="cuda").manual_seed(b)
        logits = torch.randn(b, V, device="cuda", generator=gen).to(torch.bfloat16)
        keys = torch.randint(0, 2**31, (b,), device="cuda", generator=gen, dtype=torch.int32)
        temperature = torch.full((b,), 0.6, device="cuda")
        race = functools.partial(sampling.sample, logits, keys, temperature)
        race()  # compile outside the graph
        ms = triton.testing.do_bench_cudagraph(race, rep=200, return_mode="median")
        floor_us = b * V * 2 / BANDWIDTH * 1e6
        rows[b] = {"us": ms * 1e3, "floor_us": floor_us}
        print(f"| {b} | {ms * 1e3:.1f} | {floor_us:.1f} |")
    # after the table, so that the output's last lines hold both
    log = "lg2.approx (FAST_LOG)" if sampling.FAST_LOG else "libdevice logf (--accurate-log)"
    print(f"race's outer log: {log}")
    if args.json:
        with open(args.json, "w") as f:
            info = {"device": torch.cuda.get_device_name(), "fast_log": sampling.FAST_LOG}
            json.dump({**info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
