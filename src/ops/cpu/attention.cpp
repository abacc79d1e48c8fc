#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace dflash::cpu {

void check_cu_seqlens(const std::vector<int64_t>& cu, int64_t T, const char* what) {
  bool ok = cu.size() >= 2 && cu.front() == 0 && cu.back() == T;
  for (size_t i = 1; ok && i < cu.size(); ++i) ok = cu[i] >= cu[i - 1];
  if (!ok)
    throw std::invalid_argument(std::string(what) + ": cu_seqlens must start at 0, not decrease and end at T = " +
                                std::to_string(T));
}

Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& cu_seqlens, float scale) {
  return causal_attention(q, k, v, cu_seqlens, cu_seqlens, scale);
}

Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int64_t>& cu_q,
                        const std::vector<int64_t>& cu_k, float scale) {
  if (q.ndim() != 3 || k.ndim() != 3 || v.shape != k.shape || k.dim(2) != q.dim(2) || k.dim(1) == 0 ||
      q.dim(1) % k.dim(1) != 0 || cu_q.size() != cu_k.size())
    throw std::invalid_argument("causal_attention: q " + shape_str(q.shape) + ", k " + shape_str(k.shape) +
                                ", v " + shape_str(v.shape));
  const int64_t T = q.dim(0), H = q.dim(1), Hkv = k.dim(1), D = q.dim(2), rep = H / Hkv;
  check_cu_seqlens(cu_q, T, "causal_attention");
  check_cu_seqlens(cu_k, k.dim(0), "causal_attention (keys)");
  Tensor o({T, H, D});
  std::vector<float> p;
  for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
    const int64_t b = cu_k[s], nq = cu_q[s + 1] - cu_q[s], past = cu_k[s + 1] - b - nq;
    if (past < 0)
      throw std::invalid_argument("causal_attention: sequence " + std::to_string(s) + " has " + std::to_string(nq) +
                                  " queries but " + std::to_string(cu_k[s + 1] - b) + " keys");
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t t = cu_q[s] + i, last = b + past + i;  // query row, its last visible key
      p.resize(size_t(last - b + 1));
      for (int64_t h = 0; h < H; ++h) {
        const float* qr = q.ptr() + (t * H + h) * D;
        const int64_t kh = h / rep;
        float mx = -INFINITY;
        for (int64_t j = b; j <= last; ++j) {
          const float* kr = k.ptr() + (j * Hkv + kh) * D;
          float dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
          p[size_t(j - b)] = dot * scale;
          mx = std::max(mx, p[size_t(j - b)]);
        }
        float sum = 0;
        for (auto& x : p) sum += (x = std::exp(x - mx));
        float* orow = o.ptr() + (t * H + h) * D;
        for (int64_t j = b; j <= last; ++j) {
          const float w = p[size_t(j - b)] / sum;
          const float* vr = v.ptr() + (j * Hkv + kh) * D;
          for (int64_t d = 0; d < D; ++d) orow[d] += w * vr[d];
        }
      }
    }
  }
  return o;
}

}  // namespace dflash::cpu
