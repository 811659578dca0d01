"""The sampler's inputs on the worker: one row per request of the input batch (which hands the
rows out, executor/input_batch.py), and their staging into a step's buffers.

Each row keeps its SamplingParams, its prompt and output token ids, and the numbers of the
staged path in numpy arrays: greedy rows hold neutral values (temperature 1, top-k off, that is
vocab_size, top-p 1, min-p 0), and the seed is kept hashed (`seed_hash`). A step's sample rows
take one of two ways to the sampler, chosen by their `SamplingParams.sampling_path`:

- every row STAGED: `stage` writes their numbers and noise keys into the step's host arrays
  (`SamplingArrays`), which go to the device with the rest of the step's inputs in one copy,
  and returns the `SamplingFlags` the sampler needs on the host (`SamplingArrays.as_metadata`);
- otherwise `metadata` builds the rows' tensors from their parameters and token lists
  (`SamplingMetadata.build`), on the host, each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import numpy as np
import torch

from llm_inference.sample.metadata import SamplingMetadata, noise_keys_np, seed_hash
from llm_inference.sampling_params import SamplingParams, SamplingPath

T = TypeVar("T", torch.Tensor, np.ndarray)


@dataclass(frozen=True)
class SamplingFlags:
    """What the sampler must know on the host about a staged step's sample rows."""

    all_greedy: bool
    all_random: bool
    any_top_k: bool
    max_top_k: int  # 0 if no row has top-k
    any_top_p: bool
    any_min_p: bool


@dataclass
class SamplingArrays(Generic[T]):
    """A step's staged sampler inputs, entry i for sample row i: device tensors, or the numpy
    views of their host copy (both views into the input buffers' one int32 array)."""

    keys: T  # int32: the noise key's 32 bits, from the seed and the output count
    greedy: T  # int32: 1 on greedy rows, else 0
    top_k: T  # int32: vocab_size where top-k is off
    temperature: T  # float32: 1.0 on greedy rows
    top_p: T  # float32: 1.0 where off
    min_p: T  # float32: 0.0 where off

    FLOATS: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "min_p")

    def as_metadata(
        self: SamplingArrays[torch.Tensor],
        n: int,
        flags: SamplingFlags,
        vocab_size: int,
        canonical: bool,
    ) -> SamplingMetadata:
        """The SamplingMetadata of the first `n` rows, as staged on the device (`flags`: what
        `SamplingRows.stage` returned). `canonical` converts to the dtypes `build` gives (bool
        greedy, int64 keys and top-k), which the PyTorch sampler needs; the fused sampler
        reads the int32 arrays as they are."""
        keys, greedy, top_k = self.keys[:n], self.greedy[:n], self.top_k[:n]
        if canonical:
            keys, greedy, top_k = keys.long() & 0xFFFFFFFF, greedy.bool(), top_k.long()
        return SamplingMetadata(
            path=SamplingPath.STAGED,
            vocab_size=vocab_size,
            temperature=self.temperature[:n],
            greedy=greedy,
            all_greedy=flags.all_greedy,
            all_random=flags.all_random,
            noise_keys=keys,
            top_k=top_k if flags.any_top_k else None,
            max_top_k=flags.max_top_k,
            top_p=self.top_p[:n] if flags.any_top_p else None,
            min_p=self.min_p[:n] if flags.any_min_p else None,
        )


class SamplingRows:
    """Per-row sampling state, `max_num_reqs` rows; see the module docstring."""

    def __init__(self, max_num_reqs: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.prompt_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.output_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]  # appended to
        self.path = np.zeros(max_num_reqs, dtype=np.int8)  # SamplingPath
        self.greedy = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.seed_hash = np.zeros(max_num_reqs, dtype=np.uint64)

    def add(self, row: int, p: SamplingParams, prompt_token_ids: list[int]) -> None:
        V, greedy = self.vocab_size, p.greedy
        self.params[row] = p
        self.prompt_ids[row] = list(prompt_token_ids)
        self.output_ids[row] = []
        self.path[row] = p.sampling_path
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_k[row] = V if greedy or not 0 < p.top_k < V else p.top_k
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.seed_hash[row] = seed_hash(p.seed or 0)

    def remove(self, row: int) -> None:
        self.params[row] = None
        self.prompt_ids[row] = self.output_ids[row] = []

    def stage(
        self, rows: np.ndarray, num_outputs: np.ndarray, out: SamplingArrays[np.ndarray]
    ) -> SamplingFlags | None:
        """Write the inputs of the sample rows `rows` (in order; `num_outputs`: each one's
        output tokens before this sample) into `out`; None, writing nothing, unless every row
        is STAGED."""
        n = len(rows)
        if not n or (self.path[rows] != SamplingPath.STAGED).any():
            return None
        greedy, top_k = self.greedy[rows], self.top_k[rows]
        out.keys[:n] = noise_keys_np(self.seed_hash[rows], num_outputs).view(np.int32)
        out.greedy[:n] = greedy
        out.top_k[:n] = top_k
        out.temperature[:n] = self.temperature[rows]
        top_p, min_p = out.top_p[:n], out.min_p[:n]
        top_p[:] = self.top_p[rows]
        min_p[:] = self.min_p[rows]
        num_greedy = int(greedy.sum())
        on_k = top_k < self.vocab_size
        return SamplingFlags(
            all_greedy=num_greedy == n,
            all_random=num_greedy == 0,
            any_top_k=bool(on_k.any()),
            max_top_k=int(top_k[on_k].max()) if on_k.any() else 0,
            any_top_p=bool((top_p < 1.0).any()),
            any_min_p=bool((min_p > 0.0).any()),
        )

    def argmax_only(self, rows: np.ndarray) -> np.ndarray:
        """Per row of `rows`: whether its token is the argmax of its raw logits (greedy and
        STAGED: nothing changes its logits)."""
        return (self.greedy[rows] == 1) & (self.path[rows] == SamplingPath.STAGED)

    def metadata(
        self, rows: list[int], num_outputs: list[int], eos_token_ids: tuple[int, ...], device
    ) -> SamplingMetadata:
        """The sampling inputs of `rows`, in that order, built from their parameters and token
        lists (`num_outputs`: as for `stage`, in-flight samples counted)."""
        params = [self.params[r] for r in rows]
        return SamplingMetadata.build(
            params,
            [self.prompt_ids[r] for r in rows],
            [self.output_ids[r] for r in rows],
            [p.seed for p in params],
            eos_token_ids,
            self.vocab_size,
            device,
            num_output_tokens=num_outputs,
        )
