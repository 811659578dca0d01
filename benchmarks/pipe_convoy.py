"""How late a thread gets a process's messages while another thread of its process runs Python.

The server's front end reads the engine core's steps on a thread (engine/async_llm.py) while
its event loop's thread writes the streams. Each time the reading thread comes back from a
blocking read it needs the GIL again, and while the other thread runs Python it waits for it
up to the switch interval (5 ms). `multiprocessing.Connection.recv` reads a message in as many
pieces as the socket hands over, and waits for the GIL again after each.

Here a child process sends a message of `--kb` KiB (a timestamp and padding) every
`--period-ms`; the parent's reading thread takes each one, by `Connection.recv` or by
`core_process.recv_message` (the header, then the body, each in one MSG_WAITALL read), and
notes how long after its sending it was read, while the parent's main thread alternates
`--busy-ms` of pure-Python work with `--idle-ms` of sleep (an event loop under load). Printed:
the median, p99 and largest lateness of each way.

    PYTHONPATH=src python3 benchmarks/pipe_convoy.py [--kb 512] [--seconds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llm_inference.engine.core_process import recv_message  # noqa: E402


def sender(conn, kb: int, period: float, seconds: float) -> None:
    pad = os.urandom(kb * 1024)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        conn.send((time.monotonic(), pad))
        time.sleep(period)
    conn.send(None)


def run(way: str, args) -> list[float]:
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=sender, args=(child, args.kb, args.period_ms / 1e3, args.seconds)
    )
    proc.start()
    late: list[float] = []
    done = threading.Event()

    def reader() -> None:
        sock = None
        if way == "waitall":
            import socket

            sock = socket.socket(fileno=os.dup(parent.fileno()))
        while True:
            msg = parent.recv() if sock is None else recv_message(sock)
            if msg is None:
                break
            late.append((time.monotonic() - msg[0]) * 1e3)
        done.set()

    t = threading.Thread(target=reader)
    t.start()
    while not done.is_set():  # the busy event loop
        stop = time.perf_counter() + args.busy_ms / 1e3
        x = 0
        while time.perf_counter() < stop:
            x += sum(range(100))
        time.sleep(args.idle_ms / 1e3)
    t.join()
    proc.join()
    return late


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kb", type=int, default=512)
    p.add_argument("--period-ms", type=float, default=10.0)
    p.add_argument("--busy-ms", type=float, default=10.0)
    p.add_argument("--idle-ms", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    print(f"messages of {args.kb} KiB every {args.period_ms} ms; the main thread busy "
          f"{args.busy_ms} ms, idle {args.idle_ms} ms; lateness in ms")  # fmt: skip
    for way in ("Connection.recv", "waitall"):
        late = sorted(run(way, args))
        p99 = late[int(0.99 * (len(late) - 1))]
        print(f"{way:>16}: {len(late)} messages, median {statistics.median(late):.2f}, "
              f"p99 {p99:.2f}, max {late[-1]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
