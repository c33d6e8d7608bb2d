# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
import collections
import re
import sys

# children of a given frame name (inclusive)
target = sys.argv[2]
kids = collections.Counter()
total = 0
tgt = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    total += n
    names = [re.sub(r":\d+\)", ")", f) for f in stack.split(";")]
    if target in names:
        i = len(names) - 1 - names[::-1].index(target)
        tgt += n
        kids[names[i + 1] if i + 1 < len(names) else "<self>"] += n
print(f"{target}: {100 * tgt / total:.1f}%")
for k, n in kids.most_common(25):
    print(f"  {100 * n / total:5.1f}% {k[:140]}")
