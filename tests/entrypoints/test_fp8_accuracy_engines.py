"""benchmarks/fp8_accuracy_engines.py on the CPU with our engine and the tiny checkpoint: the
bf16 run against itself agrees exactly, the FP8 variants move the distributions a little, and
the top-K KL estimate is what it says on a case worked by hand. (Its vLLM side needs vLLM and
a GPU: run on the GPU machine.)"""

from __future__ import annotations

import math
from pathlib import Path

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_accuracy_engines.py"


def test_compare_worked_by_hand():
    fp8 = load_script(SCRIPT)
    ref = [(math.log(0.5), {1: math.log(0.5), 2: math.log(0.3)})]
    same = fp8.compare(ref, ref)
    assert same["top1_agreement"] == 1.0 and abs(same["kl_top_k"]) < 1e-12
    assert math.isclose(same["perplexity"], 2.0)
    # the variant's top: token 2 first (0.6), token 3 (0.1); token 1 missing: it gets 0.1
    var = [(math.log(0.1), {2: math.log(0.6), 3: math.log(0.1)})]
    got = fp8.compare(ref, var)
    want = 0.5 * math.log(0.5 / 0.1) + 0.3 * math.log(0.3 / 0.6) + 0.2 * math.log(0.2 / 0.3)
    assert got["top1_agreement"] == 0.0 and math.isclose(got["kl_top_k"], want)
    assert math.isclose(got["perplexity"], 10.0)


def test_ours_on_the_cpu(tiny_ckpt, tmp_path):
    fp8 = load_script(SCRIPT)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"the {w} of the model" for w in ("weights", "cache", "step")) * 40)
    res = fp8.main(["--engine", "ours", "--model", str(tiny_ckpt), "--text", str(text),
                    "--window", "64", "--positions", "150", "--device", "cpu"])  # fmt: skip
    v = res["variants"]
    assert v["bf16"]["positions"] >= 150
    assert v["bf16"]["top1_agreement"] == 1.0 and abs(v["bf16"]["kl_top_k"]) < 1e-9
    for name in ("fp8 weights", "fp8 KV cache", "fp8 weights + KV cache"):
        assert v[name]["positions"] == v["bf16"]["positions"]
        assert 0.5 <= v[name]["top1_agreement"] <= 1.0, (name, v[name])
        assert 0.0 < abs(v[name]["kl_top_k"]) < 0.5, (name, v[name])
        assert math.isfinite(v[name]["perplexity"])
