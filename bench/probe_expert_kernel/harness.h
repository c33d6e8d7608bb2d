#include <cstdint>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <thread>
#include <barrier>
#include <vector>
#include <atomic>
#include <algorithm>
using std::min;
struct Dim { int x; };
struct Shape { int v[4]; int operator[](int i) const { return v[i]; } };
thread_local Dim threadIdx;
Dim blockIdx;
Dim blockDim;
// one block at a time: shared variables are process-wide, threads of the block run concurrently
std::barrier<>* block_barrier;
std::barrier<>* warp_barriers[8];
float shuffle_slots[256];
#define __syncthreads() block_barrier->arrive_and_wait()
static float __shfl_xor_sync(unsigned, float v, int off) {
  int t = threadIdx.x, warp = t / 32, lane = t % 32;
  shuffle_slots[t] = v;
  warp_barriers[warp]->arrive_and_wait();
  float other = shuffle_slots[warp * 32 + (lane ^ off)];
  warp_barriers[warp]->arrive_and_wait();
  return other;
}
static int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
#define __shared__ static
