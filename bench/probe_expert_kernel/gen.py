"""Probe (temporary): expert_kernel's CUDA source as a C++ program for the CPU emulation (`run.sh`).
Args: K O G ROW_DIV EXPERTS PAIRS."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mlxq.worker.engine import expert_kernel as ek

inputs, outputs, group, per_row, experts, pairs = map(int, sys.argv[1:7])
consts = {
    "K": inputs, "O": outputs, "G": group, "ROW_DIV": per_row, "E": experts, "MAXR": ek.MAX_ROWS,
    "WARPS": ek._WARPS, "CPW": ek._COLUMNS, "RB": ek._ROWS,
}  # fmt: skip
body = "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
print(f"""
#include "harness.h"
void kernel_body(const float* x, const uint32_t* w, const float* scales, const float* biases,
                 const uint32_t* experts, Shape experts_shape, float* out) {{
  using T = float;
{body}
{ek._SOURCE}
}}
constexpr int KK = {inputs}, OO = {outputs}, GG = {group}, RD = {per_row}, EE = {experts}, PP = {pairs};
constexpr int NBLOCKS = (EE < PP ? EE : PP) * (OO / ({ek._WARPS} * {ek._COLUMNS}));
constexpr int NTHREADS = {ek._WARPS} * 32;
#include "driver.h"
""")
