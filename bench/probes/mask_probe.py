"""Temporary probe: what a step's host-written 1 MB mask costs the GPU (managed-memory migration?)."""
import logging
logging.basicConfig(level=logging.INFO)
import time
import numpy as np
import mlx.core as mx
rows, words, vocab = 64, 4008, 128256
logits = mx.random.normal((rows, vocab)).astype(mx.bfloat16); mx.eval(logits)
cols = mx.arange(vocab, dtype=mx.uint32); word, bit = cols >> 5, cols & 31
def draw(m):
    allowed = ((m[:, word] >> bit) & 1).astype(mx.bool_)
    return mx.argmax(mx.where(allowed, logits, -1e9), axis=-1)
buf = mx.array(np.full((rows, words), 0xFFFFFFFF, dtype=np.uint32)); mx.eval(buf)
host = np.asarray(memoryview(buf)).view(np.int32)
dev = mx.array(np.full((rows, words), 0xFFFFFFFF, dtype=np.uint32)) + 0; mx.eval(dev)
rng = np.random.default_rng(0)
vals = [rng.integers(-2**31, 2**31, size=(rows, words)).astype(np.int32) for _ in range(4)]
def timeit(name, fn, n=30):
    ts = []
    for i in range(n):
        mx.synchronize(); t0 = time.perf_counter(); fn(i); t1 = time.perf_counter(); ts.append(t1 - t0)
    ts = sorted(ts[5:]); print(f"{name}: median {1e3*ts[len(ts)//2]:.3f} ms, min {1e3*ts[0]:.3f}")
def in_place(i):
    host[:] = vals[i % 4]; mx.eval(draw(buf))
def in_place_nowrite(i):
    mx.eval(draw(buf))
def fresh(i):
    mx.eval(draw(mx.array(vals[i % 4].view(np.uint32))))
def device_resident(i):
    mx.eval(draw(dev))
for f in (device_resident, in_place_nowrite, in_place, fresh, in_place, device_resident):
    timeit(f.__name__, f)


from mlxq.worker.engine.mask_buffer import MaskBuffer
from mlxq.worker.engine import host_pages
mb = MaskBuffer(rows, words); print("advised:", mb.pages.advised if mb.pages else None, "driver v2:", getattr(host_pages._driver, "_v2", None))
plain = MaskBuffer(rows, words); plain.pages.release() if plain.pages else None
def advised(i):
    mb.host[:] = vals[i % 4]; mx.eval(draw(mb.array))
def released(i):
    plain.host[:] = vals[i % 4]; mx.eval(draw(plain.array))
for f in (advised, released, advised, released, device_resident):
    timeit(f.__name__, f)
mb.host[:] = vals[1]; g1 = np.array(draw(mb.array)); mb.host[:] = vals[2]; g2 = np.array(draw(mb.array))
r1 = np.array(draw(mx.array(vals[1].view(np.uint32)))); r2 = np.array(draw(mx.array(vals[2].view(np.uint32))))
print("advised buffer sees host writes:", (g1 == r1).all(), (g2 == r2).all())
