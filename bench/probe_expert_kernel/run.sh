#!/usr/bin/env bash
# Probe (temporary): expert_kernel's CUDA source run on the CPU, one std::thread a CUDA thread, barriers
# for __syncthreads and the warps' shuffles (float inputs), against the dequantized weights in double.
# Args of gen.py: K O G ROW_DIV EXPERTS PAIRS.
set -euo pipefail
cd "$(dirname "$0")"
for args in "256 64 64 2 3 60" "256 32 64 1 2 100" "768 64 64 8 16 128" "2048 32 64 8 16 16" "2048 32 64 8 9 512" \
  "512 32 32 1 5 40" "256 64 128 4 9 36" "2048 32 64 8 128 8" "256 32 64 2 50 6" "256 32 64 1 40 10" \
  "768 64 64 8 128 256"; do
  python3 gen.py $args > expert_kernel_emu.cpp
  g++ -std=c++20 -O1 -pthread -o /tmp/expert_kernel_emu expert_kernel_emu.cpp && rm expert_kernel_emu.cpp
  /tmp/expert_kernel_emu
done
