"""The README's table of engine options is EngineArgs, field for field: the option list is
written once in code (engine/arg_utils.py), and the documentation may not drift from it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from llm_inference.engine.arg_utils import EngineArgs

README = Path(__file__).resolve().parents[1] / "README.md"
REMOVED_KNOBS = ("skinny_gemm", "pdl", "fused_all_reduce_norm", "mixed_cuda_graph_sizes")


def documented_options() -> list[str]:
    """The first column of the README's options table: `name` (`--flag`)."""
    rows = re.findall(r"^\| `(\w+)` \(`--", README.read_text(), flags=re.M)
    assert rows, "no options table in README.md"
    return rows


def test_readme_documents_every_engine_option_in_order():
    assert documented_options() == [f.name for f in dataclasses.fields(EngineArgs)]


def test_readme_names_no_removed_knob():
    text = README.read_text()
    for knob in REMOVED_KNOBS:
        assert knob not in text and knob.replace("_", "-") not in text, knob
