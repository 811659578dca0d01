"""Tensor-parallel workers as Ray actors (`distributed_executor_backend="ray"`), so that one
engine spans the nodes of a Ray cluster. It offers what `MultiprocWorkers` offers the
executor: `submit`, `collective_rpc`, `pids`, `shutdown`.

Ray: this process joins the cluster `RAY_ADDRESS` names, else the one `ray start` runs on this
machine, else starts a local one (`ray.init()` decides); a Ray this class started or joined is
left at shutdown, one the caller had joined is kept.

Placement: a placement group of one bundle per rank ({"GPU": 1} on CUDA, {"CPU": 1} on the
CPU), packed onto as few nodes as possible, one actor per bundle. Rank 0's actor reports its
node's IP and a port free there: the rendezvous every rank joins (`init_distributed`: NCCL on
CUDA, gloo on the CPU), reachable from every node. On CUDA each actor sees every GPU Ray gave
the engine's actors on its node (CUDA_VISIBLE_DEVICES, set before CUDA starts) and takes its
own, so that NCCL and the custom all-reduce find their peers on a node.

Calls: `submit` sends `method(*args)` to every actor and returns at once; Ray runs an actor's
calls in the order one caller sent them, so steps pipeline as over the worker pipes. A step's
reply is sent once its tokens are on the host (a Ray reply cannot be a future): the engine
schedules step n+1 while the ranks run step n, but a rank starts step n+1 after step n's copy.
A step sent in two calls (structured outputs: `execute_model(sample=False)`, then
`sample_tokens`) runs as one there: its forward waits for the step before's copy.

Failure: replies are awaited in slices of POLL_S; an actor that dies fails its calls
(RayActorError) and one that raises sends its traceback: either is a `WorkerError` naming the
rank (a death first: its peers' errors in a collective follow from it), and the workers are
unusable after it (the other ranks may wait in a collective).
Shutdown kills the actors and removes the placement group (also at interpreter exit or when
collected), so nothing keeps running.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

from llm_inference.config import EngineConfig
from llm_inference.executor.multiproc import WorkerError, check_heads_divide, check_usable

POLL_S = 0.5
ERROR_GRACE_S = 2.0  # after a rank raises, how long the others get to reply (or be found dead)
PLACEMENT_TIMEOUT_S = 120.0  # how long the cluster gets to find the bundles


class RankActor:
    """A rank in a Ray actor: joins the group, builds its `Worker`, runs the calls."""

    def node(self) -> tuple[str, list[str], int]:
        """This actor's node IP, the GPU ids Ray gave it, and a port free on its node."""
        import ray

        from llm_inference.distributed.parallel_state import free_port

        gpus = [str(g) for g in ray.get_gpu_ids()]
        return ray.util.get_node_ip_address(), gpus, free_port()

    def start(self, config, rank: int, world_size: int, host: str, port: int, gpus, local):
        """Join the group at host:port as `rank`, on GPU `local` of `gpus` (CUDA) or the CPU's
        share of threads; build the Worker. Returns this process's id."""
        import torch

        from llm_inference.distributed.parallel_state import init_distributed
        from llm_inference.executor.worker import Worker

        if config.device.startswith("cuda"):
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)  # the bundle's one CPU
        init_distributed(
            rank, world_size, port, device, host=host,
            use_custom_all_reduce=not config.parallel.disable_custom_all_reduce,
            kernel_backend=config.kernel_backend,
        )  # fmt: skip
        self.worker = Worker(config, rank, device)
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        from llm_inference.executor.pending import PendingOutput

        result = getattr(self.worker, method)(*args)
        return result.result() if isinstance(result, PendingOutput) else result


class RayCall:
    """A call sent to every actor; `result()` waits for the replies (in rank order) or raises
    its WorkerError. It may be called again."""

    def __init__(self, workers: RayWorkers, method: str, refs: list) -> None:
        self._workers, self.method, self.refs = workers, method, refs
        self._results: list[Any] | None = None

    def result(self, timeout: float | None = None) -> list[Any]:
        if self._results is None:
            self._results = self._workers._wait(self, timeout)
        return self._results


class RayWorkers:
    """One Ray actor per rank (module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = n = config.parallel.tensor_parallel_size
        check_heads_divide(config.model, n)
        own_ray = not ray.is_initialized()
        if own_ray:
            ray.init()
        cuda = config.device.startswith("cuda")
        self._pg = placement_group([{"GPU": 1} if cuda else {"CPU": 1}] * n, strategy="PACK")
        self.actors: list = []
        self._unusable: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self.actors, self._pg, own_ray)
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                kind = "GPU" if cuda else "CPU"
                raise WorkerError(
                    f"the Ray cluster did not find {n} bundles of 1 {kind} in "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s (ray status shows its resources)"
                )
            actor_class = ray.remote(num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0)(
                RankActor
            )
            for rank in range(n):
                strategy = PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=rank
                )
                self.actors.append(actor_class.options(scheduling_strategy=strategy).remote())
            nodes = self._wait(self._submit("node", [(a, ()) for a in self.actors]))
            host, _, port = nodes[0]
            by_node: dict[str, list[str]] = {}
            for ip, gpus, _ in nodes:
                by_node.setdefault(ip, []).extend(gpus)
            starts = []
            for rank, (actor, (ip, gpus, _)) in enumerate(zip(self.actors, nodes)):
                visible = sorted(by_node[ip])  # any order the node's actors share
                local = visible.index(gpus[0]) if cuda else 0
                starts.append((actor, (config, rank, n, host, port, visible, local)))
            self.pids = self._wait(self._submit("start", starts))
        except BaseException:
            self._unusable = "start-up failed"
            self.shutdown()
            raise

    # ---- calls ----------------------------------------------------------------------------

    def _submit(self, method: str, per_actor: list) -> RayCall:
        return RayCall(self, method, [getattr(a, method).remote(*args) for a, args in per_actor])

    def submit(self, method: str, *args: Any) -> RayCall:
        """Send `method(*args)` to every rank's Worker and return at once; each rank runs it
        after the calls sent before."""
        check_usable(self._closed, self._unusable)
        return self._submit("call", [(a, (method, *args)) for a in self.actors])

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call `method(*args)` on every rank's Worker; the results in rank order."""
        return self.submit(method, *args).result(timeout)

    def _wait(self, call: RayCall, timeout: float | None = None) -> list[Any]:
        """Every rank's reply to `call`, or a WorkerError: a dead rank's at once, else (after
        ERROR_GRACE_S for the others, whose error may be a peer's death seen through a
        collective) the lowest rank's that raised."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: rank for rank, ref in enumerate(call.refs)}
        results: list[Any] = [None] * len(call.refs)
        raised: dict[int, RayTaskError] = {}
        owing, grace_end = list(call.refs), None
        give_up = None if timeout is None else time.monotonic() + timeout
        while owing:
            ready, owing = ray.wait(owing, num_returns=len(owing), timeout=POLL_S)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except RayTaskError as e:
                    raised[rank] = e
                    grace_end = grace_end or time.monotonic() + ERROR_GRACE_S
                except RayActorError as e:
                    self._unusable = f"worker rank {rank} died"
                    raise WorkerError(
                        f"tensor-parallel worker rank {rank} (a Ray actor) died during "
                        f"{call.method}; the engine cannot continue:\n{e}"
                    ) from None
            now = time.monotonic()
            if raised and (not owing or now > grace_end):
                rank = min(raised)
                self._unusable = f"rank {rank} raised in {call.method}"
                raise WorkerError(f"tensor-parallel worker rank {rank} raised in "
                                  f"{call.method}:\n{raised[rank]}")  # fmt: skip
            if owing and give_up is not None and now > give_up:
                self._unusable = f"{call.method} timed out"
                raise WorkerError(f"tensor-parallel workers did not answer {call.method} "
                                  f"within {timeout} s")  # fmt: skip
        return results

    # ---- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill every actor and free the placement group; safe to call more than once."""
        self._closed = True
        self._finalizer()


def _stop(actors: list, pg, own_ray: bool) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    if not ray.is_initialized():
        return
    for actor in actors:
        ray.kill(actor)
    actors.clear()
    remove_placement_group(pg)
    if own_ray:
        ray.shutdown()
