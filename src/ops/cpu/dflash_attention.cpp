#include "ops/dflash_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace dflash::cpu {

std::vector<KvRanges> dflash_kv_ranges(const std::vector<int64_t>& anchors, int64_t num_blocks,
                                       int64_t block_size, int64_t context_len, int64_t window, bool causal) {
  if (block_size <= 0 || context_len < 0 || num_blocks < int64_t(anchors.size()))
    throw std::invalid_argument("dflash_kv_ranges: block_size " + std::to_string(block_size) + ", context " +
                                std::to_string(context_len) + ", " + std::to_string(anchors.size()) +
                                " anchors in " + std::to_string(num_blocks) + " blocks");
  const int64_t B = block_size, S = context_len;
  std::vector<KvRanges> r(size_t(num_blocks * B));  // default: empty (padding blocks)
  for (size_t b = 0; b < anchors.size(); ++b) {
    const int64_t a = anchors[b];
    if (a < 0 || a > S)
      throw std::invalid_argument("dflash_kv_ranges: anchor " + std::to_string(a) + " outside [0, " +
                                  std::to_string(S) + "]");
    const int64_t blk0 = S + int64_t(b) * B;
    for (int64_t k = 0; k < B; ++k) {
      KvRanges& x = r[size_t(int64_t(b) * B + k)];
      x.ctx_begin = window > 0 ? std::clamp<int64_t>(a + k - (window - 1), 0, a) : 0;
      x.ctx_end = a;
      x.blk_begin = blk0;
      x.blk_end = causal || window > 0 ? blk0 + k + 1 : blk0 + B;
    }
  }
  return r;
}

namespace {
template <typename T>
void check_shapes(const BasicTensor<T>& q, const BasicTensor<T>& k, const BasicTensor<T>& v,
                  const std::vector<KvRanges>& ranges, const char* what) {
  if (q.ndim() != 3 || k.ndim() != 3 || v.shape != k.shape || k.dim(2) != q.dim(2) || k.dim(1) == 0 ||
      q.dim(1) % k.dim(1) != 0 || int64_t(ranges.size()) != q.dim(0))
    throw std::invalid_argument(std::string(what) + ": q " + shape_str(q.shape) + ", k " + shape_str(k.shape) +
                                ", v " + shape_str(v.shape) + ", " + std::to_string(ranges.size()) + " mask rows");
  const int64_t Nk = k.dim(0);
  for (const KvRanges& r : ranges)
    if ((r.ctx_end > r.ctx_begin && (r.ctx_begin < 0 || r.ctx_end > Nk)) ||
        (r.blk_end > r.blk_begin && (r.blk_begin < 0 || r.blk_end > Nk)))
      throw std::invalid_argument(std::string(what) + ": mask range outside [0, " + std::to_string(Nk) + ")");
  for (const KvRanges& r : ranges)
    if (r.ctx_end > r.ctx_begin && r.blk_end > r.blk_begin && r.ctx_begin < r.blk_end && r.blk_begin < r.ctx_end)
      throw std::invalid_argument(std::string(what) + ": the two mask ranges of a row overlap");
}

/// Calls f(j) for every allowed kv index of row r, in increasing range order.
template <typename F>
void for_each_kv(const KvRanges& r, F&& f) {
  for (int64_t j = r.ctx_begin; j < r.ctx_end; ++j) f(j);
  for (int64_t j = r.blk_begin; j < r.blk_end; ++j) f(j);
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
}  // namespace

template <typename T>
BasicTensor<T> masked_attention_forward(const BasicTensor<T>& q, const BasicTensor<T>& k, const BasicTensor<T>& v,
                                        const std::vector<KvRanges>& ranges, double scale, OutTensor<T>* lse) {
  check_shapes(q, k, v, ranges, "masked_attention_forward");
  const int64_t Nq = q.dim(0), H = q.dim(1), Hkv = k.dim(1), D = q.dim(2), rep = H / Hkv;
  const T sc = T(scale);
  BasicTensor<T> o({Nq, H, D});
  if (lse) *lse = BasicTensor<T>({Nq, H});
  std::vector<T> s;
  for (int64_t i = 0; i < Nq; ++i) {
    const KvRanges& r = ranges[size_t(i)];
    for (int64_t h = 0; h < H; ++h) {
      const T* qr = q.ptr() + (i * H + h) * D;
      const int64_t kh = h / rep;
      s.clear();
      T mx = -std::numeric_limits<T>::infinity();
      for_each_kv(r, [&](int64_t j) {
        s.push_back(dot(qr, k.ptr() + (j * Hkv + kh) * D, D) * sc);
        mx = std::max(mx, s.back());
      });
      if (s.empty()) {  // sees nothing: o stays 0
        if (lse) lse->data[size_t(i * H + h)] = -std::numeric_limits<T>::infinity();
        continue;
      }
      T sum = 0;
      for (T& x : s) sum += (x = std::exp(x - mx));
      T* orow = o.ptr() + (i * H + h) * D;
      size_t n = 0;
      for_each_kv(r, [&](int64_t j) {
        const T p = s[n++] / sum;
        const T* vr = v.ptr() + (j * Hkv + kh) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] += p * vr[d];
      });
      if (lse) lse->data[size_t(i * H + h)] = mx + std::log(sum);
    }
  }
  return o;
}

template <typename T>
void masked_attention_backward(const BasicTensor<T>& q, const BasicTensor<T>& k, const BasicTensor<T>& v,
                               const BasicTensor<T>& o, const BasicTensor<T>& lse, const BasicTensor<T>& dout,
                               const std::vector<KvRanges>& ranges, double scale, OutTensor<T>* dq,
                               OutTensor<T>* dk, OutTensor<T>* dv) {
  check_shapes(q, k, v, ranges, "masked_attention_backward");
  const int64_t Nq = q.dim(0), H = q.dim(1), Hkv = k.dim(1), D = q.dim(2), rep = H / Hkv;
  if (o.shape != q.shape || dout.shape != q.shape || lse.shape != std::vector<int64_t>{Nq, H})
    throw std::invalid_argument("masked_attention_backward: o " + shape_str(o.shape) + ", dout " +
                                shape_str(dout.shape) + ", lse " + shape_str(lse.shape) + " for q " +
                                shape_str(q.shape));
  const T sc = T(scale);
  if (dq) *dq = BasicTensor<T>(q.shape);
  if (dk) *dk = BasicTensor<T>(k.shape);
  if (dv) *dv = BasicTensor<T>(k.shape);
  for (int64_t i = 0; i < Nq; ++i) {
    const KvRanges& r = ranges[size_t(i)];
    for (int64_t h = 0; h < H; ++h) {
      const T L = lse.data[size_t(i * H + h)];
      if (!std::isfinite(L)) continue;  // row sees nothing: no gradient
      const T* qr = q.ptr() + (i * H + h) * D;
      const T* gr = dout.ptr() + (i * H + h) * D;
      const T delta = dot(gr, o.ptr() + (i * H + h) * D, D);  // rowsum(dO * O)
      const int64_t kh = h / rep;
      for_each_kv(r, [&](int64_t j) {
        const T* kr = k.ptr() + (j * Hkv + kh) * D;
        const T* vr = v.ptr() + (j * Hkv + kh) * D;
        const T p = std::exp(dot(qr, kr, D) * sc - L);
        const T ds = p * (dot(gr, vr, D) - delta) * sc;
        if (dv) {
          T* dvr = dv->ptr() + (j * Hkv + kh) * D;
          for (int64_t d = 0; d < D; ++d) dvr[d] += p * gr[d];
        }
        if (dq) {
          T* dqr = dq->ptr() + (i * H + h) * D;
          for (int64_t d = 0; d < D; ++d) dqr[d] += ds * kr[d];
        }
        if (dk) {
          T* dkr = dk->ptr() + (j * Hkv + kh) * D;
          for (int64_t d = 0; d < D; ++d) dkr[d] += ds * qr[d];
        }
      });
    }
  }
}

template Tensor masked_attention_forward<float>(const Tensor&, const Tensor&, const Tensor&,
                                                const std::vector<KvRanges>&, double, Tensor*);
template Tensor64 masked_attention_forward<double>(const Tensor64&, const Tensor64&, const Tensor64&,
                                                   const std::vector<KvRanges>&, double, Tensor64*);
template void masked_attention_backward<float>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                               const Tensor&, const Tensor&, const std::vector<KvRanges>&, double,
                                               Tensor*, Tensor*, Tensor*);
template void masked_attention_backward<double>(const Tensor64&, const Tensor64&, const Tensor64&, const Tensor64&,
                                                const Tensor64&, const Tensor64&, const std::vector<KvRanges>&,
                                                double, Tensor64*, Tensor64*, Tensor64*);

}  // namespace dflash::cpu
