// Fast transcendental functions shared by the hand-written kernels.
#pragma once

namespace dflash::cuda {

constexpr float kLog2e = 1.4426950408889634f;

/// 2^x in one MUFU.EX2 (ex2.approx.ftz.f32: ~2^-22 relative error, results below 2^-126 flushed to
/// 0, 2^-inf = 0). exp2f without fast-math wraps the same instruction in a denormal-range fix-up
/// (4 instructions); values that small do not matter next to the bf16 operands.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace dflash::cuda
