"""Temporary probe: can a CUDA kernel launched before the host writes an MLX array's memory wait for it?"""
import threading, time
import numpy as np
import mlx.core as mx

SRC = r'''
    __shared__ int ok;
    if (threadIdx.x == 0) {
        volatile const int* f = (volatile const int*)flag;
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        int good = 1;
        while (*f != want[0]) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            if (t - t0 > 2000000000ULL) { good = 0; break; }
        }
        __threadfence_system();
        ok = good;
    }
    __syncthreads();
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) {
        volatile const uint32_t* m = (volatile const uint32_t*)masks;
        out[i] = m[i];
    }
    if (i == 0) status[0] = ok;
'''
k = mx.fast.cuda_kernel(name="probe_wait", input_names=["flag", "want", "masks"], output_names=["out", "status"], source=SRC)
N = 64 * 4008
def host_array(shape, dtype, fill):
    a = mx.array(np.full(shape, fill, dtype=dtype)); mx.eval(a)
    return a, np.asarray(memoryview(a)).view(dtype)
flag, flag_h = host_array((1,), np.int32, 0)
masks, masks_h = host_array((N,), np.uint32, 7)
big = mx.random.normal((4096, 4096)); mx.eval(big)
for step in range(1, 8):
    want = mx.array([step], dtype=mx.int32)
    pre = big
    for _ in range(20):
        pre = pre @ big * 1e-3   # device work before the wait (~ms)
    out, status = k(inputs=[flag, want, masks], template=[("N", N)], grid=(N, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[(N,), (1,)], output_dtypes=[mx.uint32, mx.int32])
    after = out.astype(mx.float32).sum() + pre.sum() * 0
    t0 = time.perf_counter()
    mx.async_eval(after, status)
    t1 = time.perf_counter()
    delay = 0.003 if step % 2 else 0.030
    time.sleep(delay)
    masks_h[:] = step * 11
    flag_h[0] = step
    tw = time.perf_counter()
    mx.eval(after, status)
    tr = time.perf_counter()
    got = np.array(out)
    print(f"step {step}: launch {1e3*(t1-t0):.2f} ms, host wrote at +{1e3*(tw-t0):.1f}, result at +{1e3*(tr-t0):.1f} ms "
          f"(after write {1e3*(tr-tw):.2f}); status {int(status.item())}; masks seen {np.unique(got)[:3]} expect {step*11}")
