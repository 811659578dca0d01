"""Default-model load time: the first start (converting the GGUF into the cache) and a later
one (loading the cached safetensors), each a fresh Python process on the CPU, plus loading
the GGUF file directly (no cache) for comparison.

A load is what a start needs before its first token: `resolve_model(None)`, then our model
(config + weights, float32, CPU) and the tokenizer. The cache lives in a fresh temporary
XDG_CACHE_HOME, so the first run really converts. Each row gives the steps inside the process
and the whole process (interpreter, imports, exit). Prints a markdown table.

    PYTHONPATH=src python benchmarks/default_model_load.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = ("resolve", "model", "tokenizer")


def child(source: str) -> None:
    """One start, timed step by step; prints a JSON line."""
    t0 = time.perf_counter()
    import torch

    from llm_inference.kernels import reference
    from llm_inference.models.default_model import default_gguf_path, resolve_model
    from llm_inference.models.loader import load_model, load_tokenizer

    times = {"imports": time.perf_counter() - t0}
    t = time.perf_counter()
    path = resolve_model(None) if source == "default" else str(default_gguf_path())
    times["resolve"] = time.perf_counter() - t
    t = time.perf_counter()
    model = load_model(path, reference, device="cpu", dtype=torch.float32)
    times["model"] = time.perf_counter() - t
    t = time.perf_counter()
    tokenizer = load_tokenizer(path)
    times["tokenizer"] = time.perf_counter() - t
    assert model is not None and tokenizer.chat_template
    print(json.dumps(times))


def run_once(source: str, env: dict[str, str]) -> dict[str, float]:
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, "--child", source],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    times = json.loads(out.stdout.strip().splitlines()[-1])
    times["process"] = time.perf_counter() - t
    return times


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__} (CPU, {torch.get_num_threads()} threads)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="fresh caches to measure")
    ap.add_argument("--child", choices=["default", "gguf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    rows: dict[str, list[dict[str, float]]] = {"first": [], "cached": [], "gguf": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "XDG_CACHE_HOME": cache}
            rows["first"].append(run_once("default", env))
            rows["cached"].append(run_once("default", env))
            rows["gguf"].append(run_once("gguf", env))
    labels = {
        "first": "default model, first start (converts into the cache)",
        "cached": "default model, later start (cached safetensors)",
        "gguf": "the .gguf file given directly (no cache)",
    }
    print(f"machine: {machine()}")
    print(f"medians of {args.repeats} runs, seconds\n")
    cols = ("imports", *STEPS)
    print("| load | " + " | ".join(cols) + " | in-process total | whole process |")
    print("|---" * (len(cols) + 3) + "|")
    for key, runs in rows.items():
        med = {c: statistics.median(r[c] for r in runs) for c in (*cols, "process")}
        total = statistics.median(sum(r[c] for c in STEPS) for r in runs)
        cells = " | ".join(f"{med[c]:.2f}" for c in cols)
        print(f"| {labels[key]} | {cells} | {total:.2f} | {med['process']:.2f} |")


if __name__ == "__main__":
    main()
