# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
import collections
import re
import sys

incl = collections.Counter()
self_ = collections.Counter()
total = 0
idle = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    total += n
    frames = stack.split(";")
    names = [re.sub(r":\d+\)", ")", f) for f in frames]
    leaf = names[-1]
    self_[leaf] += n
    for f in set(names):
        incl[f] += n
print("total", total)
key = sys.argv[2] if len(sys.argv) > 2 else "incl"
c = incl if key == "incl" else self_
for f, n in c.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 60):
    print(f"{100 * n / total:5.1f}% {f[:150]}")
