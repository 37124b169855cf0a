"""Summarise pyspy_during.sh's collapsed stacks: per process, each thread's share of the samples and the functions that
take the most of them, inclusive and as leaf. py-spy records only threads that are running (no --idle), and its
"Samples" count is of such thread-samples, not of sampling rounds; with --nonblocking on a busy host it also falls
behind its rate. So these are shares of where a process spends its CPU, not of wall time: for how busy each process
is, read pyspy_during.sh's ps.txt (top).

    python bench/gpu/pyspy_top.py OUTDIR/[A-Z]*.txt [--top 15]
"""

import argparse
import collections
import os
import re


def frame_name(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: lines of one function count together."""
    m = re.match(r"(.*) \((.*?):\d+\)$", frame)
    return f"{m.group(1)} ({os.path.basename(m.group(2))})" if m else frame


def summarise(path: str, top: int) -> str:
    threads: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        threads[frames[0]] += n
        for f in dict.fromkeys(frame_name(f) for f in frames[1:]):
            inclusive[f] += n
        leaf[frame_name(frames[-1])] += n
    total = sum(threads.values())
    out = [f"== {os.path.basename(path)}: {total} samples of running threads"]
    out += [f"  {t[:70]}: {100 * n / max(total, 1):.0f}% of them" for t, n in threads.most_common(8)]
    out.append("  inclusive:")
    out += [f"    {100 * n / max(total, 1):5.1f}%  {f[:110]}" for f, n in inclusive.most_common(top)]
    out.append("  leaf:")
    out += [f"    {100 * n / max(total, 1):5.1f}%  {f[:110]}" for f, n in leaf.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    for path in args.files:
        print(summarise(path, args.top))


if __name__ == "__main__":
    main()
