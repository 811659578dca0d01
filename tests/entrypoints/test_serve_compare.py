"""benchmarks/serve_compare.py without servers: its report (tables, ratios, figure, strict
JSON) from synthetic results, the web-stack links it gives our server, and the stopping of a
process tree."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_compare.py"


@pytest.fixture(scope="module")
def sc():
    return load_script(SCRIPT)


def _result(tput: float, itl: float, n: int = 10) -> dict:
    r = {"num_prompts": n, "completed": n, "failed": 0, "duration_s": 2.0,
         "request_throughput": n / 2, "output_throughput": tput,
         "total_token_throughput": 2 * tput, "total_input_tokens": 1000, "errors": [],
         "server_counters": {"prefix_cache_hits_total": 250.0,
                             "prefix_cache_queries_total": 1000.0}}  # fmt: skip
    for metric, base in (("ttft", 50.0), ("tpot", itl), ("itl", itl), ("e2el", 900.0)):
        r |= {f"mean_{metric}_ms": base, f"median_{metric}_ms": base, f"p99_{metric}_ms": 2 * base}
    return r


def test_report_from_synthetic_results(sc, tmp_path):
    runs = [{"engine": e, "rate": rate, "num_prompts": 10, "result": _result(t, i)}
            for e, t, i in (("ours", 1000.0, 8.0), ("vllm", 2000.0, 4.0))
            for rate in (8.0, float("inf"))]  # fmt: skip
    runs.append({"engine": "vllm", "rate": 64.0, "num_prompts": 10, "skipped": "5 s left"})
    prefix = [{"prefix_caching": on, "conversations": 4, "turns": 3, "concurrency": 2,
               "shared_prefix_len": 40, "input_len": 10, "output_len": 6,
               "result": _result(500.0, 5.0, 12)} for on in (True, False)]  # fmt: skip
    prefix[1]["result"]["server_counters"] = {}
    data = {"meta": {"argv": ["--out", "x"], "started": "now", "notes": {}, "model": "m"},
            "engines": {"ours": {"startup_s": 5.0}, "vllm": {"error": "RuntimeError: a\nb"}},
            "runs": runs, "prefix": prefix}  # fmt: skip
    args = sc.parse_args(["--out", str(tmp_path)])
    s = sc.Session(args)
    s.data = data
    s.write()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(sc.FILES)
    md = (tmp_path / "serve_compare.md").read_text()
    assert "| 8 | ours | 10 / 0 | 5.00 | 1,000 | 50.0 / 50.0 / 100.0 |" in md
    assert "| inf | vllm | 10 / 0 | 5.00 | 2,000 |" in md
    assert "| 64 | vllm | skipped: 5 s left |" in md
    assert "- rate 8: 0.50x; 2.00x; 2.00x" in md and "- rate inf: 0.50x; 2.00x; 2.00x" in md
    assert "| on | 12 / 0 |" in md and "| 25.0% of 1,000 |" in md
    assert "- engine vllm: error RuntimeError: a\n" in md  # first line only, all under Errors
    assert (tmp_path / "serve_compare.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "serve_compare.json").read_text())  # strict: no Infinity
    assert {r["rate"] for r in saved["runs"]} == {8.0, 64.0, "inf"}
    assert sc.markdown(saved) == sc.markdown(data | {"meta": saved["meta"]})


def test_rates_prompts_and_budget_estimates(sc, tmp_path):
    args = sc.parse_args(["--out", str(tmp_path), "--rates", "8,inf", "--duration", "10"])
    assert args.rate_list == [8.0, float("inf")]
    assert [sc.prompts_for(args, r) for r in args.rate_list] == [80, 512]
    assert sc.engine_estimate(args, "vllm") > sc.engine_estimate(args, "ours") > 30
    with pytest.raises(SystemExit):
        sc.parse_args(["--out", str(tmp_path), "--engines", "ours,sglang"])


def test_web_stack_links_leave_vllm_out(sc, tmp_path):
    site = tmp_path / "site"
    for name in ("fastapi", "fastapi-0.136.3.dist-info", "pydantic_core", "vllm",
                 "vllm-0.26.0.dist-info", "torch", "httpx2", "bin", "gguf"):  # fmt: skip
        (site / name).mkdir(parents=True)
    (site / "typing_extensions.py").write_text("")
    linked = sc.link_serve_deps(site, tmp_path / "deps")
    assert linked == ["fastapi", "fastapi-0.136.3.dist-info", "gguf", "pydantic_core",
                      "typing_extensions.py"]  # fmt: skip
    assert (tmp_path / "deps" / "fastapi").resolve() == site / "fastapi"
    assert sc.vllm_version(str(site)) == "0.26.0"


def test_stop_kills_the_whole_process_tree(sc, tmp_path):
    """A server whose child ignores the leader's exit: stop() kills it too."""
    script = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", script])
    server = sc.Server("t", [], {}, 0, tmp_path / "log")
    server.proc = proc
    server.known = [(proc.pid, sc._stat(proc.pid)[1])]
    deadline = time.monotonic() + 10
    while len(sc.descendants(proc.pid)) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    child = sc.descendants(proc.pid)
    assert len(child) == 1
    info = server.stop(grace=5)
    assert info["still_alive"] == [] and proc.returncode is not None
    assert sc._alive(child) == []
