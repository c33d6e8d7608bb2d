"""Temporary probe: does MLX CUDA's async_eval return before earlier work on the stream finishes?"""
import time
import mlx.core as mx
big = mx.random.normal((8192, 8192)); mx.eval(big)
def chain(n):
    y = big
    for _ in range(n):
        y = (y @ big) * 1e-4
    return y
for n in (1, 50, 200):
    mx.synchronize()
    a = chain(n); t0 = time.perf_counter(); mx.async_eval(a); t1 = time.perf_counter()
    b = mx.arange(10) + 1; mx.async_eval(b); t2 = time.perf_counter()
    c = chain(1); mx.async_eval(c); t3 = time.perf_counter()
    mx.eval(a, b, c); t4 = time.perf_counter()
    print(f"chain {n}: async_eval(chain) {1e3*(t1-t0):.2f} ms, then tiny {1e3*(t2-t1):.2f} ms, then one matmul {1e3*(t3-t2):.2f} ms, all done at {1e3*(t4-t0):.1f} ms")
# many small graphs in a row while the GPU is busy
mx.synchronize()
a = chain(300); mx.async_eval(a); t0 = time.perf_counter()
for i in range(40):
    x = mx.arange(10) * i; mx.async_eval(x)
t1 = time.perf_counter(); mx.eval(a); t2 = time.perf_counter()
print(f"40 tiny async_evals behind a 300-matmul chain: {1e3*(t1-t0):.2f} ms; chain done at {1e3*(t2-t0):.1f} ms")
