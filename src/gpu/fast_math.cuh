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

/// 1 / (1 + e^-x) in two MUFU operations (fast_exp2 and __fdividef's approximate reciprocal: ~4e-7
/// relative). x / (1 + __expf(-x)) without fast-math adds a denormal fix-up and an IEEE division
/// (with its slow-path branch) to every call. x below about -87.3: 0 (1 + e^-x past 2^126, where
/// __fdividef gives 0; the true value is below 1e-37); -inf: NaN, as the IEEE form.
__device__ __forceinline__ float fast_sigmoid(float x) { return __fdividef(1.f, 1.f + fast_exp2(-x * kLog2e)); }

/// x sigmoid(x) (SiLU) as fast_sigmoid: x / (1 + e^-x); -0 for x below about -87.3, NaN for -inf.
__device__ __forceinline__ float fast_silu(float x) { return __fdividef(x, 1.f + fast_exp2(-x * kLog2e)); }

}  // namespace dflash::cuda
