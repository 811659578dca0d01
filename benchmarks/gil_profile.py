"""Which thread of which process holds the GIL, and doing what: a py-spy record, summarized.

`py-spy record --gil --threads --subprocesses --format raw --rate RATE` samples, RATE times a
second, the thread of each process that holds its GIL (a process whose GIL nobody holds gives no
sample). Over SECONDS of recording, a process's samples / (RATE x SECONDS) is the share of the
time its Python code ran: near 1, that process is bound by its one interpreter, whatever the
machine's cores. For each process and thread this prints that share, then the functions with
the most samples, by their own time (the frame that ran) and inclusive (anywhere on the
stack); a function's share of its process's samples is where its interpreter time went.

    python3 benchmarks/gil_profile.py PYSPY_RAW.txt --seconds 20 --rate 250 [--top 25]

serve_compare.py --py-spy records each measured run of a server (its processes: the front end,
the engine core, workers) and writes this summary beside the record.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_LINE = re.compile(r":\d+\)")  # a frame's line number: functions are counted whole
# --subprocesses: the stack starts with each process from the recorded one down to the
# sampled one, 'process PID:"COMMAND LINE";' (a command line may hold ';')
_PROCESS = re.compile(r'process (\d+):"(.*?)";(?=thread |process )')


def summarize(path: str, seconds: float, rate: float, top: int = 20) -> str:
    """The summary of one raw py-spy record (see the module docstring) as text."""
    threads: Counter = Counter()  # (process, thread) -> samples
    processes: Counter = Counter()
    own: dict[str, Counter] = {}  # process -> (thread, function) -> samples it ran
    inclusive: dict[str, Counter] = {}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            proc = "the process"
            while m := _PROCESS.match(stack):
                proc, stack = f"pid {m[1]} ({m[2][:70]})", stack[m.end() :]
            rest = stack.split(";")
            thread = rest[0].split(": ", 1)[-1]
            calls = [_LINE.sub(")", fr) for fr in rest[1:]] or ["(no Python frame)"]
            threads[proc, thread] += n
            processes[proc] += n
            own.setdefault(proc, Counter())[thread, calls[-1]] += n
            inc = inclusive.setdefault(proc, Counter())
            for call in dict.fromkeys(calls):  # each function once per sample
                inc[thread, call] += n
    possible = seconds * rate
    out = [f"{path}: {sum(processes.values())} samples over {seconds:.1f} s at {rate:g}/s"]
    for proc, total in processes.most_common():
        out.append(f"\n## {proc}: the GIL held {total / possible:.0%} of the time")
        for (p, thread), n in threads.most_common():
            if p == proc:
                out.append(f"  thread {thread}: {n / possible:.0%}")
        for title, counts in (("own time", own[proc]), ("inclusive", inclusive[proc])):
            out.append(f"  top functions, {title} (share of this process's samples):")
            shown = [(key, n) for key, n in counts.most_common()
                     if title == "own time" or n < threads[proc, key[0]]][:top]  # fmt: skip
            for (thread, call), n in shown:  # (inclusive: not the threads' roots)
                out.append(f"    {n / total:6.1%}  [{thread}] {call}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="py-spy record --format raw output")
    p.add_argument("--seconds", type=float, required=True, help="how long it recorded")
    p.add_argument("--rate", type=float, default=100.0, help="its --rate (samples a second)")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    print(summarize(args.path, args.seconds, args.rate, args.top))


if __name__ == "__main__":
    main()
