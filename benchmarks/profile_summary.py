"""Summarise a py-spy `--format raw` profile (collapsed stacks): self and inclusive time per frame.

    python benchmarks/profile_summary.py profile.txt
"""

from __future__ import annotations

import collections
import sys


def main(path: str) -> None:
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            own[frames[-1]] += n
            for frame in set(frames):
                incl[frame] += n
    print(f"samples {total}")
    print("self time:")
    for frame, n in own.most_common(25):
        print(f"{100 * n / total:6.1f}%  {frame}")
    print("inclusive:")
    for frame, n in incl.most_common(40):
        print(f"{100 * n / total:6.1f}%  {frame}")


if __name__ == "__main__":
    main(sys.argv[1])
