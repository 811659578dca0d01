"""The custom (symmetric-memory) all-reduce of distributed/custom_all_reduce.py.

On the CPU: the routing rule (which messages it takes, which go to NCCL); its set-up's
agreement across ranks and fallback (gloo ranks with a stand-in implementation); gloo ranks
(no custom all-reduce, the plain gloo sum); the `disable_custom_all_reduce` plumbing from the
engine arguments and the CLI to the worker's `init_distributed`, and its choice of the fused
all-reduce + RMSNorm. On 2+ GPUs: against NCCL for
several sizes and dtypes, eagerly and in a CUDA graph replayed with changing inputs, with the
messages above the threshold, in float16 or misaligned going to NCCL; a wrong sum at set-up
falls back to NCCL."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import traceback

import pytest
import torch
import torch.distributed as dist
from tp_helpers import run_ranks, spawn_ranks

from llm_inference import kernels
from llm_inference.distributed import custom_all_reduce as car
from llm_inference.distributed import parallel_state as ps
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.entrypoints import cli
from llm_inference.executor import worker_process

KiB, MiB = car.KiB, car.MiB

# ---- routing (pure) -------------------------------------------------------------------------


def _t(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


ROUTES = [
    # (tensor, max_bytes, one_shot_max_bytes, expected)
    (_t((1, 3072)), 8 * MiB, 8 * MiB, car.ONE_SHOT),  # 6 KB: a decode step at batch 1
    (_t((256, 3072)), 8 * MiB, 8 * MiB, car.ONE_SHOT),  # 1.5 MB
    (_t((1024, 4096)), 8 * MiB, 8 * MiB, car.ONE_SHOT),  # exactly max_bytes
    (_t((1025, 4096)), 8 * MiB, 8 * MiB, car.NCCL),  # one row more
    (_t((4096, 3072)), 8 * MiB, 8 * MiB, car.NCCL),  # 24 MB prefill
    (_t((64, 3072)), 8 * MiB, 256 * KiB, car.TWO_SHOT),  # 384 KB above the one-shot limit
    (_t((8, 3072), torch.float32), 8 * MiB, 8 * MiB, car.ONE_SHOT),
    (_t((8, 3072), torch.float16), 8 * MiB, 8 * MiB, car.NCCL),  # no float16 kernels
    (_t((8, 3072), torch.int32), 8 * MiB, 8 * MiB, car.NCCL),
    (_t((3072, 8)).t(), 8 * MiB, 8 * MiB, car.NCCL),  # not contiguous
    (_t((0, 3072)), 8 * MiB, 8 * MiB, car.NCCL),  # empty
    (_t((3,)), 8 * MiB, 8 * MiB, car.NCCL),  # 6 bytes: not a multiple of 4
    (_t((2, 3072))[1], 8 * MiB, 8 * MiB, car.ONE_SHOT),  # offset 6144 bytes: aligned
    (_t((2, 3074))[1], 8 * MiB, 8 * MiB, car.NCCL),  # offset 6148 bytes: not 16-aligned
]


@pytest.mark.parametrize("x,max_bytes,one_shot,expected", ROUTES)
def test_routing(x, max_bytes, one_shot, expected):
    assert car.algorithm(x, max_bytes, one_shot) == expected


def test_default_limits_cover_decode_and_leave_prefill_to_nccl():
    """At TP 2 every decode all-reduce of the 3B model (hidden 3072, batch up to 256) takes a
    symmetric-memory path (one-shot up to batch 64, two-shot at 256: 1.5 MB, where it was
    measured faster); a 4,096-token prefill chunk goes to NCCL."""
    route = functools.partial(
        car.algorithm, max_bytes=car.MAX_BYTES[2], one_shot_max_bytes=car.ONE_SHOT_MAX_BYTES[2]
    )
    for batch in (1, 8, 64):
        assert route(_t((batch, 3072))) == car.ONE_SHOT, batch
    assert route(_t((256, 3072))) == car.TWO_SHOT
    assert route(_t((64, 3072), torch.float32)) == car.ONE_SHOT  # 768 KB
    assert route(_t((256, 3072), torch.float32)) == car.TWO_SHOT
    assert route(_t((4096, 3072))) == car.NCCL
    for world, limit in car.MAX_BYTES.items():
        assert limit % 16 == 0 and car.ONE_SHOT_MAX_BYTES[world] <= limit


def test_fused_norm_takes_few_rows_only(monkeypatch):
    """parallel_state.all_reduce_add_rms_norm sends steps of up to FUSED_NORM_MAX_ROWS rows
    that the custom all-reduce can fuse to the fused kernel; more rows, or ones it cannot
    take, to the all-reduce then the RMSNorm."""
    fused = []

    class Comm:
        def can_fuse_norm(self, x, residual):
            return x.dtype == torch.bfloat16

        def all_reduce_add_rms_norm(self, x, residual, weight, eps, index):
            fused.append((x.shape[0], index))
            return x, residual

    class Ops:
        @staticmethod
        def rms_norm(x, weight, eps, residual):
            return x, residual

    monkeypatch.setattr(ps, "_TP_SIZE", 2)
    monkeypatch.setattr(ps, "_CUSTOM_ALL_REDUCE", Comm())
    monkeypatch.setattr(ps, "all_reduce", lambda x: x)
    limit = ps.FUSED_NORM_MAX_ROWS
    for rows, dtype in ((1, torch.bfloat16), (limit, torch.bfloat16), (limit + 1, torch.bfloat16),
                        (1, torch.float16)):  # fmt: skip
        x = torch.zeros(rows, 8, dtype=dtype)
        ps.all_reduce_add_rms_norm(x, x.clone(), torch.ones(8), 1e-5, Ops, index=rows)
    assert fused == [(1, 1), (limit, limit)]


# ---- set-up agreement and fallback (gloo ranks, a stand-in implementation) -----------------


class FakeComm:
    """Stands in for CustomAllReduce on gloo ranks: sums with gloo, and on rank 1 (only)
    fails the way `fault` says."""

    max_bytes = 4 * KiB

    def __init__(self, device, fault, fused_norm=False):
        self.bad = fault if dist.get_rank() == 1 else ""
        if self.bad == "init" or (fused_norm and self.bad == "fused"):
            raise RuntimeError("no symmetric memory here\nsecond line")
        self.closed = False
        self.fused_norm = False  # (with the fused fault only: no check of the fused kernel)

    def rendezvous(self):
        if self.bad == "rendezvous":
            raise RuntimeError("rendezvous failed")

    def algorithm(self, x):
        return car.algorithm(x, self.max_bytes, self.max_bytes)

    def all_reduce(self, x, algo=None):
        dist.all_reduce(x)
        if self.bad == "wrong":
            x.view(-1)[-1] += 1
        return x

    def close(self):
        self.closed = True


def _create(rank, world_size, fault):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        comm = car.create(torch.device("cpu"), functools.partial(FakeComm, fault=fault))
    return comm is not None, err.getvalue()


@pytest.mark.parametrize("fault", ["init", "rendezvous", "wrong"])
def test_failure_on_one_rank_falls_back_on_every_rank(fault):
    (ok0, err0), (ok1, err1) = run_ranks(_create, 2, fault)
    assert not ok0 and not ok1
    assert err1 == ""  # rank 0 alone prints, one line
    lines = err0.splitlines()
    assert len(lines) == 1 and "custom all-reduce off" in lines[0] and "rank 1" in lines[0]
    why = {"init": "RuntimeError: no symmetric memory here", "rendezvous": "rendezvous failed"}
    assert why.get(fault, "differs from NCCL") in lines[0]


def test_working_implementation_is_kept_quietly():
    assert run_ranks(_create, 2, "") == [(True, ""), (True, "")]


def _create_fused(rank, world_size, fault):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        comm = car.create(torch.device("cpu"), functools.partial(FakeComm, fault=fault), True)
    return comm is not None, err.getvalue()


def test_fused_norm_failure_keeps_the_plain_custom_all_reduce():
    (ok0, err0), (ok1, err1) = run_ranks(_create_fused, 2, "fused")
    assert ok0 and ok1 and err1 == ""
    lines = err0.splitlines()
    assert len(lines) == 1 and "fused all-reduce + RMSNorm off (rank 1" in lines[0]


def _gloo_all_reduce(rank, world_size):
    x = torch.full((4, 3072), float(rank + 1), dtype=torch.bfloat16)
    ps.all_reduce(x)
    return ps.get_custom_all_reduce() is None, x.unique().tolist()


def test_gloo_ranks_have_no_custom_all_reduce():
    assert run_ranks(_gloo_all_reduce, 2) == [(True, [3.0]), (True, [3.0])]


# ---- the engine argument, down to init_distributed ------------------------------------------


def _init_kwargs(tiny_ckpt, monkeypatch, **engine_kw) -> dict:
    """The keyword arguments a TP=2 worker's join_group passes to init_distributed."""
    seen = {}
    monkeypatch.setattr(worker_process, "init_distributed", lambda *a, **kw: seen.update(kw))
    threads = torch.get_num_threads()
    try:
        args = EngineArgs(tiny_ckpt, device="cpu", tensor_parallel_size=2, **engine_kw)
        config = args.create_engine_config()
        assert worker_process.join_group(config, 1, 2, 0) == torch.device("cpu")
    finally:
        torch.set_num_threads(threads)
    return seen


def test_flag_reaches_the_workers_init_distributed(tiny_ckpt, monkeypatch):
    for flag in (False, True):
        kw = _init_kwargs(tiny_ckpt, monkeypatch, disable_custom_all_reduce=flag)
        assert kw["use_custom_all_reduce"] is not flag
    default = EngineArgs(tiny_ckpt, device="cpu").create_engine_config()
    assert not default.parallel.disable_custom_all_reduce
    with pytest.raises(ValueError, match="disable_custom_all_reduce"):
        EngineArgs(tiny_ckpt, device="cpu", disable_custom_all_reduce="yes").create_engine_config()


def test_kernel_backend_reaches_init_distributed(tiny_ckpt, monkeypatch):
    """The fused all-reduce + RMSNorm is a Triton kernel: the worker passes the resolved
    kernel backend, from which (and the device and the environment) init_distributed decides
    it."""
    assert _init_kwargs(tiny_ckpt, monkeypatch)["kernel_backend"] == "reference"
    monkeypatch.setattr(kernels, "resolve_backend", lambda backend, device_type: "triton")
    assert _init_kwargs(tiny_ckpt, monkeypatch)["kernel_backend"] == "triton"


def test_init_distributed_fuses_the_norm_with_triton_unless_switched_off(monkeypatch):
    """On CUDA (stood in for: no process group, no device), the custom all-reduce is created
    with the fused norm for the Triton kernels unless LLM_INFERENCE_FUSED_ALL_REDUCE_NORM=0,
    never for the reference kernels."""
    created = []
    for name, value in (("_TP_RANK", 0), ("_TP_SIZE", 1), ("_CUSTOM_ALL_REDUCE", None)):
        monkeypatch.setattr(ps, name, value)  # restored afterwards
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(car, "create", lambda device, fused_norm: created.append(fused_norm))
    name = "LLM_INFERENCE_FUSED_ALL_REDUCE_NORM"
    for backend, value, want in (("triton", None, True), ("triton", "1", True),
                                 ("triton", "0", False), ("reference", None, False)):  # fmt: skip
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        ps.init_distributed(0, 2, 0, "cuda:0", kernel_backend=backend)
        assert created.pop() is want, (backend, value)
    ps.init_distributed(0, 2, 0, "cuda:0", use_custom_all_reduce=False, kernel_backend="triton")
    assert created == []


def test_cli_flag():
    parser = cli.build_parser()
    assert not parser.parse_args(["generate", "hi"]).disable_custom_all_reduce
    args = parser.parse_args(["generate", "hi", "--disable-custom-all-reduce"])
    assert cli._engine_kwargs(args)["disable_custom_all_reduce"] is True
    bench = parser.parse_args(["bench", "latency", "--disable-custom-all-reduce"])
    assert bench.disable_custom_all_reduce


# ---- on 2 GPUs ------------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

# As on the target machines: no NVLink multicast (the custom all-reduce never uses it).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


def _gpu_rank_main(rank, world_size, port, conn, body, fused_norm=False):
    """Rank `rank` on cuda:rank: init_distributed (NCCL and the custom all-reduce for the
    Triton kernels, with `fused_norm` its fused all-reduce + RMSNorm, its set-up output
    captured), then `body(rank, that output)`, whose result goes back over `conn`."""
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    os.environ["LLM_INFERENCE_FUSED_ALL_REDUCE_NORM"] = "1" if fused_norm else "0"
    try:
        torch.cuda.set_device(rank)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            ps.init_distributed(
                rank, world_size, port, torch.device("cuda", rank), kernel_backend="triton"
            )  # fmt: skip
        conn.send_bytes(pickle.dumps((True, body(rank, err.getvalue()))))
    except BaseException:
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
    os._exit(0)  # no destroy_process_group: it can hang after captured NCCL work


def run_gpu_ranks(body, world_size=2, timeout=180.0, fused_norm=False) -> list:
    """`body(rank, set-up stderr)` on `world_size` GPU ranks; their results in rank order."""
    return spawn_ranks(_gpu_rank_main, world_size, (body, fused_norm), timeout)


@contextlib.contextmanager
def counting_nccl():
    """Counts the all-reduces that reach torch.distributed (NCCL) inside the block."""
    orig, count = dist.all_reduce, [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return orig(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield count
    finally:
        dist.all_reduce = orig


def _data(shape, dtype, rank, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    return torch.randn(shape, generator=g, device="cuda").to(dtype)


def _check(got, want, dtype):
    if dtype == torch.float32:  # two ranks: a + b is one rounding, whatever the order
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def _eager(rank, err):
    comm = ps.get_custom_all_reduce()
    assert comm is not None and err == "", f"custom all-reduce not set up: {err}"
    sums = []
    for dtype in car.DTYPES:
        largest = comm.max_bytes // torch.empty((), dtype=dtype).element_size()
        for shape in [(1, 3072), (8, 3072), (64, 3072), (256, 3072), (2,), (4100,), (largest,)]:
            x = _data(shape, dtype, rank, seed=1)
            ref = x.clone()
            dist.all_reduce(ref)
            assert comm.algorithm(x) != car.NCCL, (shape, dtype)
            with counting_nccl() as nccl:
                y = ps.all_reduce(x)
            assert y is x and nccl[0] == 0, (shape, dtype)
            _check(x, ref, dtype)
            sums.append(x.double().sum().item())
    # To NCCL: just above the limit, float16, at an offset not 16-byte aligned. (Not a
    # non-contiguous tensor: NCCL refuses those; the routing test covers it.)
    for x in [
        _data((comm.max_bytes // 2 + 8,), torch.bfloat16, rank, 2),
        _data((8, 3072), torch.float16, rank, 3),
        _data((2, 3074), torch.bfloat16, rank, 4)[1],
    ]:
        ref = x.clone()
        dist.all_reduce(ref)
        with counting_nccl() as nccl:
            ps.all_reduce(x)
        assert nccl[0] == 1 and torch.equal(x, ref)
    return sums


@pytest.mark.cuda
@two_gpus
def test_eager_matches_nccl_and_routes_the_rest_to_nccl():
    a, b = run_gpu_ranks(_eager)
    assert a == b  # both ranks hold the same sums


def _layer(x):
    """Two dependent all-reduces, as o_proj then down_proj."""
    y = ps.all_reduce(x * 1.0)
    return ps.all_reduce(y * 0.5 + 1.0)


def _graph(rank, err):
    assert ps.get_custom_all_reduce() is not None, f"custom all-reduce not set up: {err}"
    sums = []
    for dtype in car.DTYPES:
        for shape in [(1, 3072), (256, 3072)]:
            static = _data(shape, dtype, rank, seed=0)
            _layer(static)  # warm-up, eagerly
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with counting_nccl() as nccl, torch.cuda.graph(graph):
                result = _layer(static)
            assert nccl[0] == 0
            for step in range(5):  # new inputs before every replay
                x = _data(shape, dtype, rank, seed=10 + step)
                static.copy_(x)
                graph.replay()
                dist.all_reduce(x)
                x = x * 0.5 + 1.0
                dist.all_reduce(x)
                _check(result, x, dtype)
                sums.append(result.double().sum().item())
    return sums


@pytest.mark.cuda
@two_gpus
def test_cuda_graph_replays_match_nccl():
    a, b = run_gpu_ranks(_graph)
    assert a == b


class _WrongOnRank1(car.CustomAllReduce):
    def all_reduce(self, x, algo=None):
        super().all_reduce(x, algo)
        if dist.get_rank() == 1:
            x.view(-1)[0] += 1
        return x


def _wrong_sum_at_set_up(rank, err):
    ps.get_custom_all_reduce().close()  # set up by init_distributed; redo it, broken
    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        comm = car.create(torch.device("cuda", rank), _WrongOnRank1)
    return comm is None, out.getvalue()


@pytest.mark.cuda
@two_gpus
def test_wrong_sum_at_set_up_falls_back_to_nccl():
    (off0, err0), (off1, err1) = run_gpu_ranks(_wrong_sum_at_set_up)
    assert off0 and off1 and err1 == ""
    assert "custom all-reduce off" in err0 and "rank 1" in err0 and "differs" in err0


def _norm_chain(x, residual, weight, fused: bool):
    """Four partial sums normed in a row, as in two decoder layers (index 0..3), each norm's
    output scaled into the next partial sum; by the fused kernel (called directly: the engine
    routes only few rows to it, parallel_state.FUSED_NORM_MAX_ROWS, but it takes any number up
    to its capacity), or NCCL then the RMSNorm kernel."""
    from llm_inference.kernels import rms_norm

    comm = ps.get_custom_all_reduce()
    for i in range(4):
        if fused:
            h, residual = comm.all_reduce_add_rms_norm(x, residual, weight, 1e-5, i)
        else:
            summed = x.clone()
            dist.all_reduce(summed)
            h, residual = rms_norm.rms_norm(summed, weight, 1e-5, residual)
        x = h * 0.5
    return x, residual


def _fused(rank, err):
    comm = ps.get_custom_all_reduce()
    assert comm is not None and comm.fused_norm and err == "", f"not set up: {err}"
    sums = []
    for dtype in car.FUSED_DTYPES:
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for rows in (1, min(256, car.FUSED_HALF_BYTES // (3072 * dtype.itemsize))):
            weight = _data((3072,), dtype, 0, seed=5)  # the same on both ranks
            x, res = _data((rows, 3072), dtype, rank, 6), _data((rows, 3072), dtype, 0, 7)
            assert comm.can_fuse_norm(x, res)
            want = _norm_chain(x, res.clone(), weight, fused=False)
            with counting_nccl() as nccl:
                got = _norm_chain(x, res.clone(), weight, fused=True)  # eagerly
            assert nccl[0] == 0
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, **tol)
            static_x, static_res = x.clone(), res.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                result = _norm_chain(static_x, static_res, weight, fused=True)
            for step in range(4):  # new inputs before every replay
                x, res = _data(x.shape, dtype, rank, 20 + step), _data(x.shape, dtype, 0, 30 + step)
                static_x.copy_(x)
                static_res.copy_(res)
                graph.replay()
                want = _norm_chain(x, res, weight, fused=False)
                for a, b in zip(result, want):
                    torch.testing.assert_close(a, b, **tol)
                sums.append(result[0].double().sum().item())
    return sums


@pytest.mark.cuda
@two_gpus
def test_fused_all_reduce_norm_matches_nccl_then_rms_norm():
    """The fused all-reduce + residual add + RMSNorm (its start-up check passed: set up with
    no message) against NCCL and the RMSNorm kernel: four calls in a row alternating buffer
    halves, 1 and 256 rows, every fused dtype, eagerly and replayed from a CUDA graph with new
    inputs; both ranks end with the same results."""
    a, b = run_gpu_ranks(_fused, fused_norm=True)
    assert a == b
