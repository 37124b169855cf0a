"""Summarise pyspy_during.sh's collapsed stacks: per process, each thread's share of the sampled time on a CPU (py-spy
records only running threads; the .log beside each file gives the sampling rounds), and the functions that take the
most of those samples, inclusive and as leaf.

    python bench/gpu/pyspy_top.py OUTDIR/*.txt [--top 15]
"""

import argparse
import collections
import os
import re


def frame_name(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: lines of one function count together."""
    m = re.match(r"(.*) \((.*?):\d+\)$", frame)
    return f"{m.group(1)} ({os.path.basename(m.group(2))})" if m else frame


def rounds(path: str) -> int | None:
    """py-spy's 'Samples: N' (sampling rounds) from the .log beside the stacks."""
    log = os.path.splitext(path)[0] + ".log"
    m = re.search(r"Samples: (\d+)", open(log).read()) if os.path.exists(log) else None
    return int(m.group(1)) if m else None


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
    total, r = sum(threads.values()), rounds(path)
    out = [f"== {os.path.basename(path)}: {total} samples on a CPU over {r or '?'} rounds"]
    out += [f"  {t[:70]}: {100 * n / r:.0f}% of the time" if r else f"  {t[:70]}: {n} samples"
            for t, n in threads.most_common(8)]
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
