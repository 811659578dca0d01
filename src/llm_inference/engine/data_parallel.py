"""Data parallelism: N engine cores, each with its own tensor-parallel group, behind one front
end (`data_parallel_size=N`).

Each replica is an engine core process (`core_process.CoreClient`), whatever the executor: with
"mp" its workers are processes on this host (on CUDA replica i takes devices [i*TP, (i+1)*TP)),
with "ray" Ray actors in a placement group of its own, wherever the cluster has room. One kind
of replica serves both front ends: `DataParallelCore` has the methods of `CoreClient` that
AsyncLLM calls (its `readers()` are the N pipes) and those of `EngineCore` that `LLMEngine`
calls for `LLM` (`step()` returns the records of whichever replicas reported). The front end
keeps the text, the seeds and the n fan-out, so a request's tokens do not depend on its replica.

`Balancer` picks each request's replica (docstring there). A replica that fails or dies ends
the engine with an `EngineCoreError` naming it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import wait as wait_for

from llm_inference.config import EngineConfig
from llm_inference.core.outputs import EngineCoreOutput
from llm_inference.core.request import Request, RequestStatus
from llm_inference.engine.core_process import CoreClient, EngineCoreError

AFFINITY_ENTRIES = 65_536  # prompt prefixes remembered (least recently routed dropped first)


class Balancer:
    """Routes requests to replicas by load, keeping prefix affinity.

    A replica's load is the tokens of the requests sent to it and not yet seen finish: their
    prompts plus the tokens they have generated so far (the KV cache they hold or will hold).
    A request goes to the least loaded replica (the lowest index on a tie), except that one
    whose prompt starts with a full block (`block_size` tokens) that an earlier request sent
    to replica r started with goes to r (whose prefix cache may hold it), unless r carries
    clearly more load: more than twice the least loaded replica's plus this prompt, the most
    prefill a cache hit could save."""

    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.block_size = block_size
        self.load = [0] * num_replicas
        self.replica_of: dict[str, int] = {}  # core request id -> replica, until finished
        self._tokens: dict[str, int] = {}  # core request id -> the tokens it adds to the load
        self._affinity: dict[int, int] = {}  # hash of a first block -> replica, oldest first

    def route(self, request_id: str, prompt: list[int]) -> int:
        """The replica for a new request; counts its prompt in that replica's load."""
        least = min(range(len(self.load)), key=self.load.__getitem__)
        key = hash(tuple(prompt[: self.block_size])) if len(prompt) >= self.block_size else None
        i = self._affinity.pop(key, least)
        if self.load[i] > 2 * self.load[least] + len(prompt):
            i = least
        if key is not None:
            self._affinity[key] = i  # most recent last
            if len(self._affinity) > AFFINITY_ENTRIES:
                del self._affinity[next(iter(self._affinity))]
        self.replica_of[request_id] = i
        self._tokens[request_id] = len(prompt)
        self.load[i] += len(prompt)
        return i

    def on_records(self, records: list[EngineCoreOutput]) -> None:
        """Count the generated tokens; a finished request's tokens leave the load."""
        for r in records:
            i = self.replica_of.get(r.request_id)
            if i is not None:
                self.load[i] += len(r.new_token_ids)
                self._tokens[r.request_id] += len(r.new_token_ids)
        self.finished(r.request_id for r in records if r.finished)

    def finished(self, request_ids) -> None:
        """These requests leave the load (finished, aborted; unknown ids are ignored)."""
        for rid in request_ids:
            i = self.replica_of.pop(rid, None)
            if i is not None:
                self.load[i] -= self._tokens.pop(rid, 0)

    def has_requests(self) -> bool:
        return bool(self.replica_of)


class DataParallelCore:
    """N replicas (`CoreClient`s) behind one front end (module docstring). `setup` is passed
    to every replica."""

    def __init__(self, config: EngineConfig, setup=None) -> None:
        n, tp = config.parallel.data_parallel_size, config.parallel.tensor_parallel_size
        check_devices(config)
        self.replicas: list[CoreClient] = []
        self._own_ray = False
        if config.parallel.distributed_executor_backend == "ray":
            import ray

            if not ray.is_initialized():  # one Ray for all: the replicas join this one
                ray.init()
                self._own_ray = True
        configs = [replace(config, device=replica_device(config, i * tp)) for i in range(n)]
        with ThreadPoolExecutor(n) as pool:  # the replicas load their models at once
            starts = [pool.submit(CoreClient, c, setup) for c in configs]
        self.replicas = [s.result() for s in starts if s.exception() is None]
        failed = next((s.exception() for s in starts if s.exception() is not None), None)
        if failed is not None:
            self.shutdown()
            raise failed
        # The front end's limits: the tightest replica's (identical replicas agree).
        self.config = min(
            (r.config for r in self.replicas), key=lambda c: c.scheduler.max_model_len
        )
        self.balancer = Balancer(n, config.cache.block_size)

    def readers(self) -> list:
        """What `multiprocessing.connection.wait` waits on for results: every replica."""
        return self.replicas

    # ---- requests --------------------------------------------------------------------------

    def add_requests(self, requests: list[Request]) -> None:
        batches: list[list[Request]] = [[] for _ in self.replicas]
        for r in requests:
            batches[self.balancer.route(r.request_id, r.prompt_token_ids)].append(r)
        for replica, batch in zip(self.replicas, batches):
            if batch:
                replica.add_requests(batch)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        ids = list(request_ids)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            i = self.balancer.replica_of.get(rid)
            if i is not None:
                by_replica.setdefault(i, []).append(rid)
        self.balancer.finished(ids)
        for i, batch in by_replica.items():
            self.replicas[i].finish_requests(batch, status)

    # ---- results ---------------------------------------------------------------------------

    def recv(self, timeout: float | None = None) -> list[tuple]:
        """The results of the steps every replica ran since the last call, as
        `CoreClient.recv` (waiting up to `timeout` seconds for one; [] after it)."""
        ready = wait_for(self.replicas, timeout)
        steps = []
        for i, replica in enumerate(self.replicas):
            if replica in ready:
                try:
                    got = replica.recv(timeout=0)
                except Exception as e:
                    raise EngineCoreError(f"data-parallel replica {i} failed: {e}") from e
                for records, *_ in got:
                    self.balancer.on_records(records)
                steps += got
        return steps

    def step(self) -> list[EngineCoreOutput]:
        """For `LLMEngine.step`: the records of the next results to come, [] when no request
        is left."""
        while self.balancer.has_requests():
            steps = self.recv(timeout=None)
            if any(records for records, *_ in steps):
                return [r for records, *_ in steps for r in records]
        return []

    def has_unfinished_requests(self) -> bool:
        return self.balancer.has_requests()

    def stats(self) -> dict[str, int]:
        """The replicas' stats, summed."""
        total: dict[str, int] = {}
        for replica in self.replicas:
            for k, v in replica.stats().items():
                total[k] = total.get(k, 0) + v
        return total

    def replica_stats(self) -> list[dict[str, int]]:
        """Each replica's stats, in replica order (/metrics labels them)."""
        return [r.stats() for r in self.replicas]

    def is_alive(self) -> bool:
        return all(r.is_alive() for r in self.replicas)

    def kill(self) -> None:
        for r in self.replicas:
            r.kill()

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()
        if self._own_ray:
            import ray

            ray.shutdown()
            self._own_ray = False


def check_devices(config: EngineConfig) -> None:
    """Raise ValueError when the replicas' CUDA devices are not all visible (with "mp")."""
    n, tp = config.parallel.data_parallel_size, config.parallel.tensor_parallel_size
    last = replica_device(config, n * tp - 1)
    if last.startswith("cuda"):
        import torch

        if int(last.partition(":")[2]) >= torch.cuda.device_count():
            raise ValueError(
                f"data_parallel_size={n} x tensor_parallel_size={tp} needs CUDA devices up to "
                f"{last}, but only {torch.cuda.device_count()} are visible"
            )


def replica_device(config: EngineConfig, offset: int) -> str:
    """The first device of the replica whose ranks start `offset` devices after the
    config's: CUDA device index + offset (the Ray executor places its own), else the CPU."""
    if (
        not config.device.startswith("cuda")
        or config.parallel.distributed_executor_backend == "ray"
    ):
        return config.device
    index = int(config.device.partition(":")[2] or 0) + offset
    return f"cuda:{index}"
