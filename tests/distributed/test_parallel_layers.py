"""Each tensor-parallel layer, run as gloo ranks in spawned processes, equals its unsharded twin
(the same layer at one rank in this process); weights come from a safetensors file through
the loader's lazy slices, and no rank reads a whole sharded tensor. Also the distributed
greedy argmax (ties, broken rows), the gather helpers, and tensor-parallel sampling: every
rank ends with the tokens one rank samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tp_helpers import run_ranks

from llm_inference.distributed import parallel_state as ps
from llm_inference.kernels.reference import ReferenceOps
from llm_inference.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llm_inference.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from llm_inference.models.loader import LazySlice
from llm_inference.sample.sampler import STATUS_BAD, STATUS_EMPTY
from llm_inference.sampling_params import SamplingParams

H, HEADS, KV, D, INTER, V = 32, 4, 2, 8, 48, 37  # V: no world size divides it (padding)


def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "q": (HEADS * D, H), "k": (KV * D, H), "v": (KV * D, H), "o": (H, HEADS * D),
        "gate": (INTER, H), "up": (INTER, H), "down": (H, INTER), "col": (INTER, H),
        "emb": (V, H), "head": (V, H),
    }  # fmt: skip
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(5, H, generator=g),
        "xq": torch.randn(5, HEADS * D, generator=g),
        "xi": torch.randn(5, INTER, generator=g),
        "ids": torch.tensor([0, 36, 18, 19, 9, 10, 27, 30, 1]),
    }


class CountingSlice(LazySlice):
    """Records how many elements each narrow reads; whole reads are forbidden."""

    reads: list[tuple[str, int, int]] = []

    def __init__(self, name, sf_slice):
        super().__init__(sf_slice)
        self.name = name

    def narrow(self, dim, start, length):
        t = super().narrow(dim, start, length)
        full = 1
        for s in self.shape:
            full *= s
        CountingSlice.reads.append((self.name, t.numel(), full))
        return t

    def materialize(self):
        raise AssertionError(f"{self.name} read whole")


def run_layers(path: str) -> dict:
    """Build every parallel layer at the current rank/size, load it from `path`, run it."""
    ops = ReferenceOps()
    qkv = QKVParallelLinear(H, D, HEADS, KV, ops)
    o = RowParallelLinear(HEADS * D, H, ops)
    gate_up = MergedColumnParallelLinear(H, [INTER, INTER], ops)
    down = RowParallelLinear(INTER, H, ops)
    col = ColumnParallelLinear(H, INTER, ops)
    emb = VocabParallelEmbedding(V, H)
    head = ParallelLMHead(V, H, ops)
    CountingSlice.reads = []
    with safe_open(path, framework="pt") as sf:
        w = lambda n: CountingSlice(n, sf.get_slice(n))  # noqa: E731
        for sid in ("q", "k", "v"):
            qkv.weight_loader(qkv.weight, w(sid), sid)
        gate_up.weight_loader(gate_up.weight, w("gate"), 0)
        gate_up.weight_loader(gate_up.weight, w("up"), 1)
        for layer, name in ((o, "o"), (down, "down"), (col, "col"), (emb, "emb"), (head, "head")):
            layer.weight_loader(layer.weight, w(name))
    x = inputs()
    rank, size = ps.get_tp_rank(), ps.get_tp_size()
    q_in, i_in = x["xq"].shape[1] // size, x["xi"].shape[1] // size
    with torch.no_grad():
        return {
            "qkv": qkv(x["x"]),
            "o": o(x["xq"].narrow(1, rank * q_in, q_in)),  # row parallel: this rank's inputs
            "gate_up": gate_up(x["x"]),
            "gate_up_silu": gate_up.forward_silu_and_mul(x["x"]),
            "down": down(x["xi"].narrow(1, rank * i_in, i_in)),
            "col": col(x["x"]),
            "emb": emb(x["ids"]),
            "logits": head.compute_logits(x["x"]),
            "local_logits": head.compute_local_logits(x["x"]),
            "gathered": ps.gather_last_dim(head.compute_local_logits(x["x"])),
            "vocab_start": head.vocab_start,
            "reads": list(CountingSlice.reads),
            "sampled": {name: tp_sample(head, x["x"], rows) for name, rows in SAMPLE_SETS.items()},
        }


# Sample rows of each kind: plain greedy (distributed argmax), seeded, logprobs, min_tokens
# (gathered to rank 0, sampled, broadcast). One set of each path and one mixed.
SAMPLE_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, seed=3),
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[5]),
    SamplingParams(temperature=0.0),
]
SAMPLE_SETS = {"greedy": [0, 4], "gathered": [1, 2, 3], "mixed": [0, 1, 2, 3, 4]}


def tp_sample(head: ParallelLMHead, hidden: torch.Tensor, rows: list[int]) -> dict:
    """sample_tensor_parallel over `rows` of `hidden`, their inputs built as the runner does."""
    from llm_inference.kernels.reference import ReferenceOps
    from llm_inference.sample.sampler import Sampler
    from llm_inference.sample.staging import SamplingRows
    from llm_inference.sample.tensor_parallel import sample_tensor_parallel

    state = SamplingRows(len(SAMPLE_PARAMS), V)
    for r, p in enumerate(SAMPLE_PARAMS):
        state.add(r, p.replace(seed=p.seed or 0), [1, 2])
    num_outputs = [2] * len(rows)  # min_tokens=4 still active
    with torch.no_grad():
        out = sample_tensor_parallel(
            Sampler(ReferenceOps()), head.compute_local_logits(hidden[rows]), head.vocab_start,
            head.vocab_size, None, state.argmax_only(np.array(rows)),
            lambda ks: state.metadata([rows[k] for k in ks], [num_outputs[k] for k in ks], (),
                                      "cpu"),
        )  # fmt: skip
    first = ps.get_tp_rank() == 0
    return {
        "tokens": out.token_ids,
        "status": out.status if first else None,
        "logprobs": out.logprobs,
    }


def argmax_rows() -> torch.Tensor:
    """Rows of full logits: random, ties across and within shards, NaN, +inf, all -inf."""
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(9, V, generator=g)
    rows[1, [0, V - 1]] = 9.0  # tie between the first and the last shard
    rows[2, [20, 21, 36]] = 9.0  # ties inside a later shard
    rows[3] = 1.0  # all equal: token 0
    rows[4, 5] = float("nan")
    rows[5, 30] = float("inf")
    rows[6] = float("-inf")
    rows[7, 10] = float("-inf")  # one -inf: fine
    rows[8, [9, 10, 18, 19]] = 7.0  # ties at shard boundaries
    return rows


def rank_body(rank: int, world_size: int, path: str) -> dict:
    from llm_inference.sample.tensor_parallel import distributed_argmax

    out = run_layers(path)
    rows = argmax_rows()
    shard = -(-V // world_size)
    local = torch.full((rows.shape[0], shard), float("-inf"))
    part = rows[:, rank * shard : (rank + 1) * shard]
    local[:, : part.shape[1]] = part
    out["argmax"] = distributed_argmax(local, rank * shard)
    out["all_gather"] = ps.all_gather(torch.tensor([rank, 10 * rank]))
    return out


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("layers") / "w.safetensors"
    save_file(full_weights(), str(path))
    return str(path)


@pytest.fixture(scope="module")
def full(weights_file):
    assert ps.get_tp_size() == 1
    return run_layers(weights_file)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_layers_equal_unsharded_twins(world_size, weights_file, full):
    ranks = run_ranks(rank_body, world_size, weights_file)
    close = torch.testing.assert_close
    q, kv = HEADS * D // world_size, max(1, KV // world_size) * D
    replicas = max(1, world_size // KV)
    inter = INTER // world_size
    for rank, out in enumerate(ranks):
        # column parallel: this rank's slice of the output features
        close(out["col"], full["col"][:, rank * inter : (rank + 1) * inter])
        close(out["gate_up"][:, :inter], full["gate_up"][:, rank * inter : (rank + 1) * inter])
        close(out["gate_up"][:, inter:], full["gate_up"][:, INTER + rank * inter :][:, :inter])
        close(out["gate_up_silu"], full["gate_up_silu"][:, rank * inter : (rank + 1) * inter])
        fq, fk, fv = full["qkv"].split([HEADS * D, KV * D, KV * D], dim=-1)
        head = rank // replicas  # KV heads replicated when world_size > KV
        close(out["qkv"][:, :q], fq[:, rank * q : (rank + 1) * q])
        close(out["qkv"][:, q : q + kv], fk[:, head * kv : (head + 1) * kv])
        close(out["qkv"][:, q + kv :], fv[:, head * kv : (head + 1) * kv])
        # row parallel (one all-reduce) and vocabulary parallel: the whole output on every rank
        close(out["o"], full["o"])
        close(out["down"], full["down"])
        close(out["emb"], full["emb"], rtol=0, atol=0)
        close(out["logits"], full["logits"])
        start, local = out["vocab_start"], out["local_logits"]
        real = min(local.shape[1], V - start)
        close(local[:, :real], full["logits"][:, start : start + real])
        assert torch.isneginf(local[:, real:]).all()
        if rank == 0:
            close(out["gathered"][:, :V], full["logits"])
        else:
            assert out["gathered"] is None
        # no rank reads a whole sharded tensor (KV replicated: one head of two)
        assert {name for name, _, _ in out["reads"]} == set(full_weights())
        for name, read, whole in out["reads"]:
            assert read < whole, name
        assert out["all_gather"].tolist() == [[r, 10 * r] for r in range(world_size)]
        # every rank ends with the same tokens (what one rank samples), whichever the path
        for name, rows in SAMPLE_SETS.items():
            got, want = out["sampled"][name], full["sampled"][name]
            assert got["tokens"].tolist() == want["tokens"].tolist(), name
            if rank == 0:
                assert got["status"].tolist() == want["status"].tolist(), name
            if 2 not in rows:
                assert got["logprobs"] is None
            elif rank == 0:  # the logprobs of the row that asked, on rank 0 only
                lp, ref = got["logprobs"][rows.index(2)], want["logprobs"][rows.index(2)]
                assert lp.token_id == ref.token_id
                assert lp.logprob == pytest.approx(ref.logprob, abs=1e-5)
            else:
                assert got["logprobs"] is None
        # greedy across shards: torch.argmax of the full row, lowest index on ties
        rows = argmax_rows()
        tokens, status = (t.tolist() for t in out["argmax"])  # tensors, the same on all ranks
        good = [k for k, s in enumerate(status) if s >= 0]
        assert good == [0, 1, 2, 3, 7, 8]
        want = rows.argmax(dim=-1).tolist()
        assert [tokens[k] for k in good] == [status[k] for k in good] == [want[k] for k in good]
        assert status[4] == status[5] == STATUS_BAD and status[6] == STATUS_EMPTY
        assert tokens[6] == 0  # all -inf: the raw argmax, as the Sampler's sync=False path
        assert tokens[1] == 0 and tokens[2] == 20 and tokens[8] == 9


def test_loader_reads_only_the_rank_slices(tiny_ckpt, monkeypatch):
    """load_model at rank 1 of 2 (no process group needed to build and load): every sharded
    parameter equals its slice of the checkpoint, and no sharded tensor is read whole."""
    from safetensors.torch import load_file

    from llm_inference.models import loader

    whole = []
    monkeypatch.setattr(
        loader.LazySlice, "materialize", lambda self: whole.append(self.shape) or self._slice[:]
    )
    monkeypatch.setattr(ps, "_TP_RANK", 1)
    monkeypatch.setattr(ps, "_TP_SIZE", 2)
    model = loader.load_model(tiny_ckpt, ReferenceOps())
    ckpt = load_file(str(next(tiny_ckpt.glob("*.safetensors"))))
    assert all(len(s) == 1 for s in whole), whole  # only the norm weights are read whole
    layer = model.layers[1]
    q = ckpt["model.layers.1.self_attn.q_proj.weight"]
    k = ckpt["model.layers.1.self_attn.k_proj.weight"]
    qkv = layer.self_attn.qkv_proj.weight
    assert torch.equal(qkv[: q.shape[0] // 2], q[q.shape[0] // 2 :])
    assert torch.equal(qkv[q.shape[0] // 2 :][: k.shape[0] // 2], k[k.shape[0] // 2 :])
    down = ckpt["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(layer.mlp.down_proj.weight, down[:, down.shape[1] // 2 :])
    emb = ckpt["model.embed_tokens.weight"]
    shard = model.embed_tokens.shard_size
    real = emb.shape[0] - shard
    assert torch.equal(model.embed_tokens.weight[:real], emb[shard:])
    assert not model.embed_tokens.weight[real:].any()
