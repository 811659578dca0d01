"""The requests `bench throughput` and `bench serve` send (and benchmarks/vllm_throughput.py gives
vLLM): a `Workload` draws each request's prompt and max output tokens from a dataset and a seed,
and says how they are sampled (temperature, top-p, top-k; always `ignore_eos`).

- `uniform`: lengths uniform in [L(1 - r), L(1 + r)] for L = `--input-len` / `--output-len` and
  r = `--range-ratio`; without a length, [100, 1024] (bench throughput's workload since the
  start, nano-vllm's: its results stay comparable).
- `fixed`: every prompt `--input-len` tokens, every output `--output-len`.
- `lognormal`: lengths from a lognormal with median `--input-len` / `--output-len` and log-space
  standard deviation `--sigma` (at 1.0, half the draws lie within a factor 2 of the median and
  the mean is 1.65 times it: a long tail), clipped to [1, 8 x median] (2% of the draws).
- `sharegpt`: the conversations of a ShareGPT JSON file (`--dataset-path`), read as vLLM's
  benchmark reads them: the first human turn is the prompt, the token count of the gpt reply
  after it is max_tokens; pairs with a side under 4 tokens, a prompt over 1,024 or both over
  2,048 tokens are skipped; shuffled with the seed, the first `--num-prompts` kept (repeated if
  fewer). Tokens are counted with the tokenizer the bench gives.

The synthetic datasets' prompts are random ids in [0, vocab), the bench's vocabulary (bench
serve decodes them to text). Lengths without `--input-len` / `--output-len` are 256 / 128 (a
chat's prompt and reply) but for `uniform`'s range. Standard library only: parsers import this.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from dataclasses import dataclass

DATASETS = ("uniform", "fixed", "lognormal", "sharegpt")
UNIFORM_RANGE = (100, 1024)
DEFAULT_LENS = (256, 128)
LOGNORMAL_CAP = 8  # times the median
SHAREGPT_MIN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int
    text: str | None = None  # sharegpt: the prompt as written, which bench serve sends


@dataclass(frozen=True)
class Workload:
    """`num_prompts` requests of a dataset (fields named as the flags), checked on creation."""

    dataset: str = "uniform"
    num_prompts: int = 256
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float = 0.0
    sigma: float = 1.0
    dataset_path: str | None = None
    seed: int = 0
    temperature: float = 0.6
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        for flag, n in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if n is not None and n < 1:
                raise ValueError(f"{flag} must be at least 1, got {n}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if not 0 < self.sigma < math.inf:
            raise ValueError(f"--sigma (the lognormal's log-space spread) must be > 0, got "
                             f"{self.sigma}")  # fmt: skip
        if self.dataset == "sharegpt" and self.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path, a ShareGPT JSON file")
        if self.dataset != "sharegpt" and self.dataset_path is not None:
            raise ValueError(f"--dataset-path is read by --dataset sharegpt, not {self.dataset}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"--top-k must be -1 (off) or at least 1, got {self.top_k}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def requests(
        self, vocab: int, tokenizer=None, n: int | None = None, rng: random.Random | None = None
    ) -> list[Request]:
        """`n` requests (default `num_prompts`) drawn with `rng` (default: seeded with `seed`);
        synthetic prompt ids in [0, vocab). Prompt lengths, then ids, then output lengths are
        drawn: the order of the first throughput workload, so `uniform` draws the same."""
        n = n or self.num_prompts
        rng = rng or random.Random(self.seed)
        if self.dataset == "sharegpt":
            return sharegpt(self.dataset_path, n, rng, tokenizer)
        ins = self._lengths(rng, n, 0)
        prompts = [[rng.randrange(vocab) for _ in range(k)] for k in ins]
        return [Request(p, k) for p, k in zip(prompts, self._lengths(rng, n, 1))]

    def _length(self, side: int) -> int | None:
        length = (self.input_len, self.output_len)[side]
        return length if length or self.dataset == "uniform" else DEFAULT_LENS[side]

    def _range(self, side: int) -> tuple[int, int]:
        """uniform's [lo, hi]."""
        length, r = self._length(side), self.range_ratio
        if length is None:
            return UNIFORM_RANGE
        return max(1, int(length * (1 - r))), max(1, int(length * (1 + r)))

    def _lengths(self, rng: random.Random, n: int, side: int) -> list[int]:
        if self.dataset == "uniform":
            lo, hi = self._range(side)
            return [rng.randint(lo, hi) for _ in range(n)]
        median = self._length(side)
        if self.dataset == "fixed":
            return [median] * n
        mu, cap = math.log(median), LOGNORMAL_CAP * median
        return [min(cap, max(1, round(rng.lognormvariate(mu, self.sigma)))) for _ in range(n)]

    def describe(self, prompt_lens: list[int], max_tokens: list[int]) -> dict:
        """The workload as a bench reports it: the dataset's parameters, resolved, and the mean
        prompt and output lengths of its requests (so a reader knows the mix)."""
        d: dict = {"dataset": self.dataset, "num_prompts": self.num_prompts, "seed": self.seed}
        if self.dataset == "sharegpt":
            d["dataset_path"] = self.dataset_path
        elif self.dataset == "uniform":
            d["input_range"], d["output_range"] = list(self._range(0)), list(self._range(1))
        else:
            d["input_len"], d["output_len"] = self._length(0), self._length(1)
        if self.dataset == "lognormal":
            d["sigma"] = self.sigma
        return d | {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "mean_prompt_len": sum(prompt_lens) / len(prompt_lens),
            "mean_output_len": sum(max_tokens) / len(max_tokens),
        }  # fmt: skip


def sharegpt(path: str, n: int, rng: random.Random, tokenizer) -> list[Request]:
    """`n` requests from a ShareGPT file (module docstring), prompt ids as `tokenizer` encodes
    the prompt for the model; the reply counted without special tokens."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--dataset-path {path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset-path {path} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f'--dataset-path {path}: a ShareGPT file is a list of {{"conversations": '
                         f"[...]}}, this one is a JSON {type(data).__name__}")  # fmt: skip
    pairs = [pair for entry in data if (pair := _first_exchange(entry))]
    rng.shuffle(pairs)
    kept = []
    for prompt, reply in pairs:
        ids = tokenizer(prompt).input_ids
        n_out = len(tokenizer(reply, add_special_tokens=False).input_ids)
        n_in = len(ids)
        if (
            min(n_in, n_out) >= SHAREGPT_MIN
            and n_in <= SHAREGPT_MAX_PROMPT
            and (n_in + n_out <= SHAREGPT_MAX_TOTAL)
        ):
            kept.append(Request(ids, n_out, prompt))
            if len(kept) == n:
                break
    if not kept:
        raise ValueError(
            f"--dataset-path {path}: no usable conversation among {len(data)} (wanted a human turn "
            f"then a gpt reply, each of {SHAREGPT_MIN}+ tokens, the prompt at most "
            f"{SHAREGPT_MAX_PROMPT} and both at most {SHAREGPT_MAX_TOTAL})"
        )
    return [kept[i % len(kept)] for i in range(n)]


def _first_exchange(entry) -> tuple[str, str] | None:
    """A ShareGPT conversation's first human turn and the gpt reply after it."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    prompt = None
    for turn in turns if isinstance(turns, list) else ():
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue
        if prompt is None and turn.get("from") == "human":
            prompt = turn["value"]
        elif prompt is not None and turn.get("from") == "gpt":
            return prompt, turn["value"]
    return None


def workload_line(w: dict) -> str:
    """What was sent, in one line: the dataset, the request count and mean lengths, sampling."""
    top_k = f", top-k {w['top_k']}" if w["top_k"] != -1 else ""
    return (
        f"workload: {w['dataset']}, {w['num_prompts']} requests, mean prompt "
        f"{w['mean_prompt_len']:.0f} and output {w['mean_output_len']:.0f} tokens, "
        f"temperature {w['temperature']}, top-p {w['top_p']}{top_k}"
    )


def add_workload_args(
    p: argparse.ArgumentParser, input_len: int | None = None, output_len: int | None = None,
    temperature: float = 0.6,
) -> None:  # fmt: skip
    """The dataset and sampling options, with a bench's own defaults (`--num-prompts` and
    `--seed` are the bench's)."""
    p.add_argument("--dataset", choices=DATASETS, default="uniform",
                   help="where requests come from (uniform, fixed, lognormal: random token ids; "
                   "sharegpt: a conversation file)")  # fmt: skip
    p.add_argument("--dataset-path", default=None, help="--dataset sharegpt: the JSON file")
    lens = "" if input_len else f" (default: {DEFAULT_LENS[0]}; uniform: {list(UNIFORM_RANGE)})"
    p.add_argument(
        "--input-len",
        "--random-input-len",
        type=int,
        default=input_len,
        help="prompt tokens: fixed's, uniform's center, lognormal's median" + lens,
    )
    lens = "" if output_len else f" (default: {DEFAULT_LENS[1]}; uniform: {list(UNIFORM_RANGE)})"
    p.add_argument(
        "--output-len",
        "--random-output-len",
        type=int,
        default=output_len,
        help="output tokens: fixed's, uniform's center, lognormal's median" + lens,
    )
    p.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="uniform: lengths in [len * (1 - r), len * (1 + r)]")  # fmt: skip
    p.add_argument("--sigma", type=float, default=1.0,
                   help="lognormal: the spread, the log-space standard deviation")  # fmt: skip
    p.add_argument("--temperature", type=float, default=temperature, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this mass")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens; -1: off")
