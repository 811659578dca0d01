"""benchmarks/gil_profile.py on a made-up py-spy record: each process's and thread's share of
the time holding its GIL, and where it went, with a child whose command line holds ';'."""

from __future__ import annotations

from pathlib import Path

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gil_profile.py"

SERVER = 'process 10:"python -m server"'
CORE = 'process 11:"python -c from x import y; y()"'  # spawn's command line has a ';'
RECORD = "\n".join([
    f"{SERVER};thread (10): MainThread;run (a.py:1);send (b.py:5) 60",
    f"{SERVER};thread (10): MainThread;run (a.py:1);dumps (c.py:9) 20",
    f"{SERVER};thread (12): reader;loop (d.py:3);decode (e.py:7) 40",
    f"{SERVER};{CORE};thread (11): MainThread;step (f.py:2) 50",
]) + "\n"  # fmt: skip


def test_shares_per_process_thread_and_function(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RECORD)
    text = load_script(SCRIPT).summarize(str(path), seconds=2.0, rate=100.0, top=5)
    # 200 possible samples: the server 120 (60%), its threads 80 and 40; the core 50 (25%)
    assert "## pid 10 (python -m server): the GIL held 60% of the time" in text
    assert "thread MainThread: 40%" in text and "thread reader: 20%" in text
    assert "## pid 11 (python -c from x import y; y()): the GIL held 25% of the time" in text
    assert "50.0%  [MainThread] send (b.py)" in text  # of the server's samples, lines merged
    assert "33.3%  [reader] decode (e.py)" in text
    # inclusive: a thread's root (run, in all of MainThread's samples) is left out, not shown
    inclusive = text.split("## pid 11")[0].split("inclusive")[1]
    assert "run (a.py)" not in inclusive and "send (b.py)" in inclusive
