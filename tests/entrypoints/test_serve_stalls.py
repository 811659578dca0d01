"""benchmarks/serve_stalls.py on made-up streams: long gaps found, and told apart as shared (every
stream stalled at once, as a slow step would) or alone (one stream held back)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_stalls.py"


def _script():
    return load_script(SCRIPT)


def _streams() -> list[dict]:
    """Four streams of 10 ms gaps from t=100 s; all four stall 200 ms together after their
    5th chunk, and then stream 3 alone for 80 ms while the others go on."""
    streams = []
    for i in range(4):
        itl = [0.01] * 4 + [0.2] + ([0.01] * 2 + [0.08] + [0.01] * 2 if i == 3 else [0.01] * 12)
        streams.append({"start": 100.0, "ttft": 0.05, "itl": itl, "output_len": len(itl) + 1})
    return streams


def test_shared_and_lone_stalls():
    found = _script().stalls(_streams(), 0.05)
    assert [round(s["ms"]) for s in found] == [200, 200, 200, 200, 80]
    assert all(s["shared"] and s["stalled"] == 4 and s["running"] == 4 for s in found[:4])
    lone = found[4]
    assert (lone["stream"], lone["stalled"], lone["shared"]) == (3, 1, False)


def test_command_line(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"requests": _streams()}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert out.startswith("5 of 61 gaps over 50 ms; 4 shared")
    assert "| 200.0 | " in out and "| 80.0 | 3 | 4 | 1 |" in out


def test_pause_log(tmp_path):
    """A 150 ms generation-2 collection inside the shared stall overlaps its four gaps, and a
    slow step of the core too, a compile the lone one's; a pause before the run is left out."""
    path, log = tmp_path / "r.json", tmp_path / "pauses.log"
    path.write_text(json.dumps({"requests": _streams()}))
    log.write_text(
        "50.0 7 gc2 300.0 core\n100.25 7 gc2 150.00 core\n"
        "100.305 8 gc0 2.00 MainProcess\n100.38 7 compile:_merge 20.0 core\n"
        "100.25 7 core_step 150.00 core\n"
    )
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--pause-log", str(log)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "| 7 core | gc2 | 1 | 150.0 | 150.0 |" in out
    assert "| 8 MainProcess | gc0 | 1 | 2.0 | 2.0 |" in out
    assert "| 7 core | compile:_merge | 1 | 20.0 | 20.0 |" in out
    assert "| 7 core | core_step | 1 | 150.0 | 150.0 |" in out
    assert "5 of 5 long gaps overlap a pause, 1 a compile, 4 a slow step of the engine core." in out
