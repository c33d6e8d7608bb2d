# ruff: noqa
# A temporary probe for bench/README.md's gateway section (issue 33, gwcpu); deleted in the next commit.
import atexit
import gc
import os
import signal
import sys
import time

if "serve" in sys.argv:
    stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    t = [0.0]

    def cb(phase, info):
        if phase == "start":
            t[0] = time.perf_counter()
        else:
            s = stats[info["generation"]]
            s[0] += 1
            s[1] += time.perf_counter() - t[0]

    gc.callbacks.append(cb)

    def dump(*a):
        with open(f"/tmp/gwprobe/gc-{os.getpid()}.txt", "w") as f:
            f.write(f"{stats} objects={len(gc.get_objects())} cpu={time.process_time()}\n")

    atexit.register(dump)
    signal.signal(signal.SIGUSR1, dump)
    import threading

    if os.environ.get("GWFREEZE"):
        threading.Timer(2.5, lambda: (gc.collect(), gc.freeze())).start()
    if os.environ.get("GWTHRESH"):
        gc.set_threshold(int(os.environ["GWTHRESH"]), 10, 10)
