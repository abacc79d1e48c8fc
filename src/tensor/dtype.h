// Element types of tensors on disk and in memory, and scalar conversions.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace dflash {

/// Element type of a stored or in-memory tensor. Quantized GGUF block types are not listed:
/// they are dequantized to F32 when loaded (see io/gguf.h).
enum class DType { F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL, F8_E4M3 };

/// Size of one element in bytes.
std::size_t dtype_size(DType t);
/// Canonical name as safetensors writes it ("F32", "BF16", ...).
std::string dtype_name(DType t);
/// Parses a safetensors dtype string; throws std::runtime_error naming `what` for unknown names.
DType dtype_from_name(std::string_view name, const std::string& what);

/// bfloat16 <-> float (round-to-nearest-even, NaN kept quiet).
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
/// FP8 E4M3 ("fn": no infinities, one NaN code per sign, largest finite 448; OCP FP8 spec) <-> float.
/// f32_to_fp8_e4m3 rounds to nearest even and saturates to +-448 (NaN stays NaN), as CUDA's
/// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) does: the CPU reference of the GPU quantizer.
float fp8_e4m3_to_f32(uint8_t b);
uint8_t f32_to_fp8_e4m3(float f);
/// Largest finite E4M3 value.
constexpr float kFp8E4M3Max = 448.f;
/// IEEE half <-> float.
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

/// Converts `n` elements of type `t` at `src` to float32 into `dst`. Throws for non-float types
/// other than the integer ones (integers are converted by value).
void convert_to_f32(DType t, const void* src, float* dst, std::size_t n);

}  // namespace dflash
