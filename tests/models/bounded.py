"""Run checkpoint loads in a subprocess under an address-space limit and a time limit, and
classify how each ended: a model whose every tensor has the expected shape, one
CheckpointError, or anything else (another exception, a crash, a timeout, memory)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
# The address space a load may take beyond what the subprocess's imports mapped (torch's
# libraries: about 0.5 GB with the CPU build, several GB with a CUDA build, so the limit is set
# after them): a load of the tiny checkpoints needs under 0.1 GB more; 1.5 GB leaves a wide
# margin and still stops a runaway allocation early.
LOAD_ADDRESS_SPACE = 3 << 29

_SCRIPT = r"""
import json, os, resource, sys, time, traceback
import torch
torch.set_num_threads(1)
from llm_inference.config import CheckpointError
from llm_inference.kernels import reference
from llm_inference.models.model_config import expected_shapes
from llm_inference.models import loader

with open("/proc/self/status") as f:
    mapped = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
limit = mapped + int(os.environ["LOAD_ADDRESS_SPACE"])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

seen = []
real_load_weights = loader.load_weights

def recording_load_weights(model, weights):
    def record():
        for name, tensor in weights:
            seen.append((name, tuple(tensor.shape)))
            yield name, tensor
    real_load_weights(model, record())

loader.load_weights = recording_load_weights

def check(kind, path):
    if kind == "config":
        loader.load_model_config(path)
        return {"outcome": "loaded"}
    seen.clear()
    model = loader.load_model(path, reference)
    # Every tensor the config implies was copied in exactly once, with exactly its shape.
    want = expected_shapes(model.config)
    got = {}
    for name, shape in seen:
        if name in want:
            got.setdefault(name, []).append(shape)
    bad = sorted(n for n in want if got.get(n) != [want[n]])
    return {"outcome": "loaded" if not bad else "misshaped", "detail": bad[:5]}

def run(kind, path):
    start = time.monotonic()
    try:
        result = check(kind, path)
    except CheckpointError as e:
        result = {"outcome": "CheckpointError", "detail": str(e)}
    except BaseException as e:
        result = {"outcome": type(e).__name__, "detail": traceback.format_exc()[-2000:]}
    result["seconds"] = time.monotonic() - start
    print(json.dumps(result), flush=True)

if len(sys.argv) > 1:
    for kind, path in json.loads(sys.argv[1]):
        run(kind, path)
else:  # a worker: one [kind, path] per line on stdin
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        run(*json.loads(line))
"""


def subprocess_env(load_address_space: int = LOAD_ADDRESS_SPACE) -> dict:
    """The environment of a test's subprocess: this checkout's package first, no hub, one
    thread, and the address space a bounded load may take beyond its imports."""
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "LOAD_ADDRESS_SPACE": str(load_address_space),
    }


def run_bounded(cases: list[tuple[str, str]], timeout: float) -> list[dict]:
    """Load each (kind, path) in one subprocess ("model": load_model and check every tensor's
    shape; "config": load_model_config); one result dict per case, in order. Cases the
    subprocess did not reach (it crashed or timed out) get outcome "crash" or "timeout"."""
    args = [sys.executable, "-c", _SCRIPT, json.dumps([[k, str(p)] for k, p in cases])]
    try:
        proc = subprocess.run(
            args, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
        )
        stdout, ended = proc.stdout, f"crash (exit {proc.returncode}): {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired as e:
        stdout, ended = (e.stdout or b"").decode(), f"timeout after {timeout} s"
    results = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    while len(results) < len(cases):
        results.append({"outcome": ended.split(" ")[0], "detail": ended})
    return results


class LoadWorker:
    """A long-lived bounded subprocess doing one load at a time (torch is imported once); a
    load that crashes it or runs past its timeout is reported and the worker restarted."""

    def __init__(self, load_address_space: int = LOAD_ADDRESS_SPACE):
        self.load_address_space = load_address_space
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT],
            env=subprocess_env(self.load_address_space),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        ready = self._read(120)
        assert ready == {"ready": True}, ready

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"outcome": "crash", "detail": "worker exited"}

    def check(self, kind: str, path: str | Path, timeout: float = 10.0) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps([kind, str(path)]) + "\n")
        self.proc.stdin.flush()
        result = self._read(timeout)
        if result is None or result.get("outcome") == "crash":
            self.close()
            return result or {"outcome": "timeout", "detail": f"no result after {timeout} s"}
        return result

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
