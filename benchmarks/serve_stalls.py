"""Where served streams stall: from a `bench serve --save-detailed --json` file (ours or run
against vLLM), the long gaps between a stream's chunks, and whether streams stall together (a
step, the engine core or the server's front end holding everyone) or alone (one stream's chunks
held back while the others flow).

For each gap over `--threshold-ms`, its wall-clock interval; a gap is "shared" when at least
half of the streams running at its midpoint are inside a long gap of their own at that instant.
Prints the count of long gaps, the share of them that are shared, and the longest ones with how
many streams were stalled with them; `--png` plots every gap against the time it ended.
`--pause-log` reads the server's pause log (the file named by LLM_INFERENCE_PAUSE_LOG while it
ran): each process's GC collections and Triton compiles during the run, and how many long gaps
overlap a pause.

    python3 benchmarks/serve_stalls.py RESULT.json [--threshold-ms 50] [--png gaps.png]
        [--pause-log pauses.log]
"""

from __future__ import annotations

import argparse
import bisect
import json
import os


def gaps(requests: list[dict]) -> list[tuple[float, float, int]]:
    """(start, end, stream) of every gap between two chunks of a stream, in wall-clock seconds."""
    out = []
    for i, r in enumerate(requests):
        t = r["start"] + r["ttft"]
        for gap in r["itl"]:
            out.append((t, t + gap, i))
            t += gap
    return out


def stalls(requests: list[dict], threshold_s: float) -> list[dict]:
    """The gaps over the threshold, longest first, each with the number of streams running at
    its midpoint and of those inside a long gap then."""
    every = gaps(requests)
    long = sorted((g for g in every if g[1] - g[0] > threshold_s), key=lambda g: g[0] - g[1])
    spans = [(r["start"] + r["ttft"], r["start"] + r["ttft"] + sum(r["itl"])) for r in requests]
    starts = sorted(g[0] for g in long)
    by_start = sorted(long)
    out = []
    for a, b, stream in long:
        mid = (a + b) / 2
        running = sum(s <= mid <= e for s, e in spans)
        # long gaps that began before mid and end after it
        stalled = sum(e > mid for s, e, _ in by_start[: bisect.bisect_right(starts, mid)])
        out.append({"ms": (b - a) * 1e3, "start": a, "end": b, "stream": stream,
                    "running": running,
                    "stalled": stalled, "shared": stalled * 2 >= running})  # fmt: skip
    return out


def pauses_in(path: str, since: float, until: float) -> list[tuple[float, float, str, str]]:
    """(start, end, "pid name", what) of the logged pauses that ended in [since, until]."""
    out = []
    if not os.path.exists(path):  # no pause was long enough to be logged
        return out
    for line in open(path):
        end, pid, what, ms, name = line.split()
        end = float(end)
        if since <= end <= until:
            out.append((end - float(ms) / 1e3, end, f"{pid} {name}", what))
    return out


def pause_report(found: list[dict], pauses: list[tuple[float, float, str, str]]) -> list[str]:
    """Per process and kind of pause: how many, total and longest ms; then the long gaps that
    overlap any pause, a compile, and a slow step of the engine core."""
    lines = ["| process | pause | count | total ms | longest ms |", "|---|---|---:|---:|---:|"]
    by_key: dict[tuple[str, str], list[float]] = {}
    for a, b, process, what in pauses:
        by_key.setdefault((process, what), []).append((b - a) * 1e3)
    for (process, what), ms in sorted(by_key.items()):
        lines.append(f"| {process} | {what} | {len(ms)} | {sum(ms):.1f} | {max(ms):.1f} |")

    def overlap(s: dict, kinds: str) -> bool:
        return any(a < s["end"] and s["start"] < b for a, b, _, w in pauses if w.startswith(kinds))

    hit, compiles, steps = (sum(overlap(s, kind) for s in found)
                            for kind in ("", "compile", "core_step"))  # fmt: skip
    lines.append(f"\n{hit} of {len(found)} long gaps overlap a pause, {compiles} a compile, "
                 f"{steps} a slow step of the engine core.")  # fmt: skip
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result")
    p.add_argument("--threshold-ms", type=float, default=50.0)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--png", default=None)
    p.add_argument("--pause-log", default=None,
                   help="the LLM_INFERENCE_PAUSE_LOG file of the run")  # fmt: skip
    args = p.parse_args()
    requests = json.load(open(args.result))["requests"]
    found = stalls(requests, args.threshold_ms / 1e3)
    n = sum(len(r["itl"]) for r in requests)
    shared = sum(s["shared"] for s in found)
    print(f"{len(found)} of {n} gaps over {args.threshold_ms:g} ms; "
          f"{shared} shared (half or more of the running streams stalled with them)")  # fmt: skip
    print("| gap ms | stream | streams running | stalled with it |\n|---:|---:|---:|---:|")
    for s in found[: args.top]:
        print(f"| {s['ms']:.1f} | {s['stream']} | {s['running']} | {s['stalled']} |")
    if args.pause_log:
        every = gaps(requests)
        since = min(r["start"] for r in requests)
        pauses = pauses_in(args.pause_log, since, max(g[1] for g in every))
        print("\n".join(pause_report(found, pauses)))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        every = gaps(requests)
        t0 = min(g[0] for g in every)
        plt.figure(figsize=(9, 4))
        plt.scatter([g[1] - t0 for g in every], [(g[1] - g[0]) * 1e3 for g in every], s=2)
        plt.xlabel("time since the first chunk (s)")
        plt.ylabel("gap between a stream's chunks (ms)")
        plt.yscale("log")
        plt.grid(True, alpha=0.3)
        plt.tight_layout()
        plt.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
