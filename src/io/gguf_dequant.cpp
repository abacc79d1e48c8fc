// Dequantization of ggml block formats to float32. Block layouts follow ggml-common.h and the
// arithmetic follows the reference dequantize_row_* of ggml-quants.c (same operation order, so
// results are bit-identical to ggml's CPU reference).
#include <array>
#include <cstring>
#include <stdexcept>
#include <string>

#include "io/gguf.h"
#include "tensor/dtype.h"

namespace dflash {

namespace {

constexpr int64_t QK = 32;    // elements per Q4_0 / Q4_1 / Q8_0 block
constexpr int64_t QK_K = 256; // elements per K-quant super-block

/// All 65536 half values as float (built once; thread-safe static init).
const float* f16_table() {
  static const std::array<float, 65536>* table = [] {
    auto* t = new std::array<float, 65536>;
    for (uint32_t h = 0; h < 65536; ++h) (*t)[h] = f16_to_f32(uint16_t(h));
    return t;
  }();
  return table->data();
}

inline uint16_t load_u16(const unsigned char* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline float load_f16(const unsigned char* p) { return f16_table()[load_u16(p)]; }

/// Q4_0: {f16 d; u8 qs[16]}, 18 bytes / 32 values.
void dequant_q4_0(const unsigned char* b, float* y, int64_t nblocks) {
  for (int64_t i = 0; i < nblocks; ++i, b += 18, y += QK) {
    const float d = load_f16(b);
    const unsigned char* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      y[j] = float(int(qs[j] & 0x0F) - 8) * d;
      y[j + 16] = float(int(qs[j] >> 4) - 8) * d;
    }
  }
}

/// Q4_1: {f16 d; f16 m; u8 qs[16]}, 20 bytes / 32 values.
void dequant_q4_1(const unsigned char* b, float* y, int64_t nblocks) {
  for (int64_t i = 0; i < nblocks; ++i, b += 20, y += QK) {
    const float d = load_f16(b), m = load_f16(b + 2);
    const unsigned char* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = float(qs[j] & 0x0F) * d + m;
      y[j + 16] = float(qs[j] >> 4) * d + m;
    }
  }
}

/// Q8_0: {f16 d; i8 qs[32]}, 34 bytes / 32 values.
void dequant_q8_0(const unsigned char* b, float* y, int64_t nblocks) {
  for (int64_t i = 0; i < nblocks; ++i, b += 34, y += QK) {
    const float d = load_f16(b);
    for (int j = 0; j < 32; ++j) y[j] = float(int8_t(b[2 + j])) * d;
  }
}

/// Scale and min of sub-block j (0..7) from the 12 packed bytes of a Q4_K block: bytes 0..3 hold
/// the low 6 bits of scales 0..3 (top 2 bits: high bits of scale j+4), bytes 4..7 the same for
/// mins, bytes 8..11 the low nibbles of scales 4..7 (low) and mins 4..7 (high).
inline void q4k_scale_min(int j, const unsigned char* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

/// Q4_K: {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}, 144 bytes / 256 values.
void dequant_q4_k(const unsigned char* b, float* y, int64_t nblocks) {
  for (int64_t i = 0; i < nblocks; ++i, b += 144) {
    const float d = load_f16(b), dmin = load_f16(b + 2);
    const unsigned char* scales = b + 4;
    const unsigned char* q = b + 16;
    for (int chunk = 0; chunk < 4; ++chunk, q += 32) {  // 64 values: two sub-blocks of 32
      int sc, mn;
      q4k_scale_min(2 * chunk, scales, &sc, &mn);
      const float d_lo = d * float(sc), m_lo = dmin * float(mn);
      q4k_scale_min(2 * chunk + 1, scales, &sc, &mn);
      const float d_hi = d * float(sc), m_hi = dmin * float(mn);
      for (int l = 0; l < 32; ++l) *y++ = d_lo * float(q[l] & 0x0F) - m_lo;
      for (int l = 0; l < 32; ++l) *y++ = d_hi * float(q[l] >> 4) - m_hi;
    }
  }
}

/// Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}, 210 bytes / 256 values. Each half of
/// 128 values uses 64 bytes of ql, 32 of qh and 8 scales; within it, value 32*k + l (k = 0..3,
/// l = 0..31) takes the low (k < 2) or high (k >= 2) nibble of ql[l + 32*(k & 1)] and bits
/// 2k..2k+1 of qh[l], and scale 2k + l/16.
void dequant_q6_k(const unsigned char* b, float* y, int64_t nblocks) {
  for (int64_t i = 0; i < nblocks; ++i, b += 210) {
    const unsigned char* ql = b;
    const unsigned char* qh = b + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = load_f16(b + 208);
    for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int s = l / 16;
        const int q1 = int((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = int((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * float(sc[s + 0]) * float(q1);
        y[l + 32] = d * float(sc[s + 2]) * float(q2);
        y[l + 64] = d * float(sc[s + 4]) * float(q3);
        y[l + 96] = d * float(sc[s + 6]) * float(q4);
      }
    }
  }
}

}  // namespace

bool ggml_can_dequantize(GGMLType t) {
  switch (t) {
    case GGMLType::F32: case GGMLType::F16: case GGMLType::BF16: case GGMLType::Q8_0:
    case GGMLType::Q4_0: case GGMLType::Q4_1: case GGMLType::Q4_K: case GGMLType::Q6_K:
      return true;
    default:
      return false;
  }
}

void ggml_dequantize(GGMLType type, const void* src, float* dst, int64_t n) {
  if (!ggml_can_dequantize(type))
    throw std::invalid_argument("cannot dequantize ggml type " + ggml_type_name(type));
  const GGMLTypeTraits* tr = ggml_type_traits(type);
  if (n < 0 || n % tr->block_size != 0)
    throw std::invalid_argument("ggml_dequantize: " + std::to_string(n) +
                                " elements is not a multiple of the " + tr->name + " block size " +
                                std::to_string(tr->block_size));
  const auto* b = static_cast<const unsigned char*>(src);
  const int64_t nb = n / tr->block_size;
  switch (type) {
    case GGMLType::F32:
      if (n) std::memcpy(dst, b, std::size_t(n) * 4);
      return;
    case GGMLType::F16: {
      const float* tab = f16_table();
      for (int64_t i = 0; i < n; ++i) dst[i] = tab[load_u16(b + 2 * i)];
      return;
    }
    case GGMLType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_u16(b + 2 * i));
      return;
    case GGMLType::Q4_0: dequant_q4_0(b, dst, nb); return;
    case GGMLType::Q4_1: dequant_q4_1(b, dst, nb); return;
    case GGMLType::Q8_0: dequant_q8_0(b, dst, nb); return;
    case GGMLType::Q4_K: dequant_q4_k(b, dst, nb); return;
    case GGMLType::Q6_K: dequant_q6_k(b, dst, nb); return;
    default: break;
  }
  throw std::invalid_argument("cannot dequantize ggml type " + ggml_type_name(type));
}

}  // namespace dflash
