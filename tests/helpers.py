"""Test helpers: tiny random Llama checkpoints written by transformers, with a small tokenizer;
the comparisons and process-table checks several test folders share."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Hello world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Unicode: café, naïve, 日本語, emoji 🙂.",
    "def main():\n    print('hello')\n",
]


@functools.lru_cache(maxsize=1)
def _tokenizer_template():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = (
        "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
    )
    return fast


def tiny_config(**overrides):
    from transformers import LlamaConfig

    tok = _tokenizer_template()
    kw = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def make_checkpoint(
    folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """Write a random tiny LlamaForCausalLM (float32) plus tokenizer to `folder`; return it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**overrides)).eval()
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kw)
    _tokenizer_template().save_pretrained(folder)
    return Path(folder)


def make_sharp_checkpoint(folder: Path, factor: float = 4.0, **overrides) -> Path:
    """The model of the CUDA tests (GQA 4, head_dim 64, 3 layers unless overridden) with its LM
    head scaled by `factor`: a random model's next-token distribution is then peaked, so
    near-ties, where half-precision rounding may legitimately flip the argmax, are rare."""
    from safetensors.torch import load_file, save_file

    shape = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, num_hidden_layers=3)  # fmt: skip
    folder = make_checkpoint(folder, **{**shape, **overrides})
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] *= factor
    save_file(tensors, path)
    return folder


def hf_model(folder: Path, dtype=torch.float32):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def chat_prompt_ids(folder, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn through the checkpoint's chat template, as token ids
    (what LLM.chat sends)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    conversations = [[{"role": "user", "content": q}] for q in questions]
    texts = [
        tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        for c in conversations
    ]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def explode_on_step(core) -> None:
    """An AsyncLLM `core_setup` (a module-level function: a core process imports it): every
    step of the core raises RuntimeError("kernel exploded")."""

    def boom():
        raise RuntimeError("kernel exploded")

    core.step = boom


def slow_steps(core) -> None:
    """An AsyncLLM `core_setup`: every step of the core takes 80 ms longer."""
    import time

    step = core.step

    def slow():
        time.sleep(0.08)
        return step()

    core.step = slow


NEVER_COMPILES = "never"  # a spec whose grammar text holds it fails in `slow_steps_failing_grammar`


def slow_steps_failing_grammar(core) -> None:
    """An AsyncLLM `core_setup`: steps slowed as `slow_steps` slows them, and xgrammar's compile
    of every spec whose grammar text holds NEVER_COMPILES raises RuntimeError("xgrammar ran out
    of states"): a spec that parsed in the front end failing in the core."""
    from llm_inference.structured_output import manager

    slow_steps(core)
    real = manager.compile_grammar

    def compile_grammar(compiler, key):
        if NEVER_COMPILES in key[1]:
            raise RuntimeError("xgrammar ran out of states")
        return real(compiler, key)

    manager.compile_grammar = compile_grammar


def report_gc_freeze(core) -> None:
    """An AsyncLLM `core_setup`: the core's stats() also report how many objects the cyclic GC
    holds frozen where the core runs (gc.get_freeze_count())."""
    import gc

    stats = core.stats
    core.stats = lambda: {**stats(), "gc_frozen": gc.get_freeze_count()}


def assert_greedy_close(fast, ref, near_tie: float, who: str = "the fast path") -> None:
    """Greedy outputs of two numerically different paths (`ref` asked for logprobs=5): where a
    sequence first differs the reference must have found the two tokens nearly tied (gap under
    `near_tie`); at least half the sequences identical and 75% of the tokens before any
    difference."""
    exact, agreed = 0, 0
    for f, r in zip(fast, ref):
        a, b = f.token_ids, r.token_ids
        j = next((i for i in range(len(a)) if a[i] != b[i]), None)
        agreed += len(a) if j is None else j
        if j is None:
            exact += 1
            continue
        top = r.outputs[0].logprobs[j].top
        assert a[j] in top, f"{who} picked {a[j]} outside the reference top-5 at step {j}"
        gap = top[b[j]] - top[a[j]]
        assert gap < near_tie, f"first difference at step {j} with log-prob gap {gap:.3f}"
    assert exact >= len(fast) // 2, f"only {exact} identical sequences"
    assert agreed >= 0.75 * sum(len(o.token_ids) for o in fast)


# ---- the process table (/proc): what the process tests check -------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def child_processes(parent: int | None = None) -> list[tuple[int, str]]:
    """Children of `parent` (this process by default), zombies included, except
    multiprocessing's resource tracker (one per parent, started by any spawn; not a worker)."""
    parent = os.getpid() if parent is None else parent
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is None or st[1] != parent:
            continue
        cmd = _cmdline(int(name))
        if "resource_tracker" in cmd:
            continue
        out.append((int(name), f"[{st[0]}] {cmd}"))
    return out


def is_running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of `pids` runs; return those still running at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if is_running(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class _Compiles(list):
    def __init__(self) -> None:
        super().__init__()
        self.specializations: list[str] = []

    @property
    def details(self) -> str:
        """Every compile's specialization, a line each: a string, so that pytest prints an
        assert's message whole (it shortens the repr of anything else)."""
        return "\n".join(self.specializations)


@contextlib.contextmanager
def triton_compiles():
    """The names of the Triton kernels compiled (in-memory cache misses, loads from the disk
    cache included) while the block runs, in a list the block can read after it; its `details`
    give each compile's specialization as Triton describes it (for an assert's message)."""
    import triton

    names = _Compiles()
    old = triton.knobs.runtime.jit_post_compile_hook

    def hook(*args, **kw):
        names.append(kw["fn"].name)
        names.specializations.append(str(kw.get("repr", "")))

    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old


def load_script(path, name: str | None = None):
    """A script (benchmarks/*.py) as a module, without running its main. With `name`, loaded
    once under that name in sys.modules (before it runs: a dataclass in it looks itself up
    there), for a file whose own name others share (a conftest.py)."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    if name is not None:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def answers(outs) -> list[list[tuple]]:
    """Each RequestOutput's completions as (token ids, text, finish reason): what two runs
    compare."""
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


# FP8 on the GPU (torch._scaled_mm, Triton's float8_e4m3fn) needs compute capability 8.9+.
needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 needs CUDA compute capability 8.9+",
)
# bfloat16 KV caches, and FP8 ones
FP8_CACHES = pytest.mark.parametrize(
    "fp8", [False, pytest.param(True, marks=needs_fp8)], ids=["bf16_cache", "fp8_cache"]
)


def random_prompts(lengths=(1, 7, 33, 120, 250, 64)) -> list[list[int]]:
    """Token-id prompts of these lengths in the tests' tokenizer's ids (seeded: the same ones
    every call)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in lengths]


def error_after_killing(pid: int, call, timeout: float = 10.0) -> Exception:
    """SIGKILL `pid`, then run `call()` on a thread: the one exception it raised, which it must
    do within `timeout` seconds (a hang, or no error, fails the test)."""
    errors = []

    def run():
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    os.kill(pid, signal.SIGKILL)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the call hung after process {pid} was killed"
    assert len(errors) == 1, errors
    return errors[0]
