#include "tensor/dtype.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>

namespace dflash {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: case DType::BOOL: case DType::F8_E4M3: return 1;
  }
  throw std::logic_error("dtype_size: bad dtype");
}

std::string dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
    case DType::F8_E4M3: return "F8_E4M3";
  }
  throw std::logic_error("dtype_name: bad dtype");
}

DType dtype_from_name(std::string_view n, const std::string& what) {
  if (n == "F32") return DType::F32;
  if (n == "F16") return DType::F16;
  if (n == "BF16") return DType::BF16;
  if (n == "F64") return DType::F64;
  if (n == "I64") return DType::I64;
  if (n == "I32") return DType::I32;
  if (n == "I16") return DType::I16;
  if (n == "I8") return DType::I8;
  if (n == "U8") return DType::U8;
  if (n == "BOOL") return DType::BOOL;
  if (n == "F8_E4M3") return DType::F8_E4M3;
  throw std::runtime_error(what + ": unsupported dtype '" + std::string(n) +
                           "' (supported: F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL, F8_E4M3)");
}

namespace {
/// Every E4M3 code's value (loading an FP8 checkpoint decodes billions of them).
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> r{};
    for (int c = 0; c < 256; ++c) r[size_t(c)] = fp8_e4m3_to_f32(uint8_t(c));
    return r;
  }();
  return t;
}
}  // namespace

float fp8_e4m3_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);  // subnormal: m/8 2^-6
  return (b & 0x80) ? -v : v;
}

uint8_t f32_to_fp8_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= kFp8E4M3Max) return uint8_t(sign | 0x7e);  // saturated (infinities too)
  if (a < 0.015625f) return uint8_t(sign | int(std::nearbyint(a * 512.f)));  // subnormals; 8 is 2^-6
  int ex = 0;
  const float fr = std::frexp(a, &ex);  // a = fr 2^ex, fr in [0.5, 1)
  int e = ex - 1, m = int(std::nearbyint((2.f * fr - 1.f) * 8.f));  // a = (1 + m/8) 2^e, nearest even
  if (m == 8) m = 0, ++e;
  const int code = std::min((e + 7) << 3 | m, 0x7e);
  return uint8_t(sign | code);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float v;
  if (exp == 0) v = std::ldexp(float(mant), -24);                 // zero / subnormal
  else if (exp == 31) v = mant ? NAN : INFINITY;                  // inf / nan
  else v = std::ldexp(float(mant | 0x400u), int(exp) - 25);       // normal
  return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);           // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);          // overflow -> inf
  if (a < 0x38800000u) {                                          // subnormal or zero
    if (a < 0x33000000u) return uint16_t(sign);
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;                               // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = a - 0x38000000u;                                   // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return uint16_t(sign | (r >> 13));
}

void convert_to_f32(DType t, const void* src, float* dst, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(src);
  for (std::size_t i = 0; i < n; ++i) {
    switch (t) {
      case DType::F32: { float v; std::memcpy(&v, b + 4 * i, 4); dst[i] = v; break; }
      case DType::F16: { uint16_t v; std::memcpy(&v, b + 2 * i, 2); dst[i] = f16_to_f32(v); break; }
      case DType::BF16: { uint16_t v; std::memcpy(&v, b + 2 * i, 2); dst[i] = bf16_to_f32(v); break; }
      case DType::F64: { double v; std::memcpy(&v, b + 8 * i, 8); dst[i] = float(v); break; }
      case DType::I64: { int64_t v; std::memcpy(&v, b + 8 * i, 8); dst[i] = float(v); break; }
      case DType::I32: { int32_t v; std::memcpy(&v, b + 4 * i, 4); dst[i] = float(v); break; }
      case DType::I16: { int16_t v; std::memcpy(&v, b + 2 * i, 2); dst[i] = float(v); break; }
      case DType::I8: dst[i] = float(static_cast<const int8_t*>(src)[i]); break;
      case DType::U8: case DType::BOOL: dst[i] = float(b[i]); break;
      case DType::F8_E4M3: dst[i] = fp8_table()[b[i]]; break;
    }
  }
}

}  // namespace dflash
