#include "ops/chunked_ce.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "ops/cpu/blas.h"

namespace dflash::cpu {

template <typename T>
ChunkedCeResult<T> chunked_cross_entropy(const BasicTensor<T>& h, const BasicTensor<T>& W,
                                         const std::vector<int32_t>& targets, const std::vector<T>& weights,
                                         int64_t row_chunk, int64_t vocab_chunk, OutTensor<T>* dh) {
  if (h.ndim() != 2 || W.ndim() != 2 || W.dim(1) != h.dim(1) || W.dim(0) == 0 || W.dim(1) == 0 ||
      int64_t(targets.size()) != h.dim(0) || int64_t(weights.size()) != h.dim(0) || row_chunk <= 0 ||
      vocab_chunk <= 0)
    throw std::invalid_argument("chunked_cross_entropy: h " + shape_str(h.shape) + ", W " + shape_str(W.shape) +
                                ", " + std::to_string(targets.size()) + " targets, " +
                                std::to_string(weights.size()) + " weights, chunks " + std::to_string(row_chunk) +
                                " x " + std::to_string(vocab_chunk));
  const int64_t M = h.dim(0), D = h.dim(1), V = W.dim(0);
  ChunkedCeResult<T> res;
  for (int64_t m = 0; m < M; ++m) {
    const T w = weights[size_t(m)];
    if (!(w >= T(0)))
      throw std::invalid_argument("chunked_cross_entropy: negative or NaN weight at row " + std::to_string(m));
    if (w != T(0) && (targets[size_t(m)] < 0 || targets[size_t(m)] >= V))
      throw std::invalid_argument("chunked_cross_entropy: target " + std::to_string(targets[size_t(m)]) +
                                  " at row " + std::to_string(m) + " outside [0, " + std::to_string(V) + ")");
    res.weight_sum += w;
  }
  res.argmax.assign(size_t(M), 0);
  res.ce.assign(size_t(M), T(0));
  res.lse.assign(size_t(M), T(0));
  if (dh) *dh = BasicTensor<T>({M, D});
  const T inv_wsum = res.weight_sum > T(0) ? T(1) / res.weight_sum : T(0);
  const int64_t rc = std::min(row_chunk, std::max<int64_t>(M, 1)), vc = std::min(vocab_chunk, V);
  std::vector<T> z(static_cast<size_t>(rc * vc)), mx(static_cast<size_t>(rc)), sum(static_cast<size_t>(rc)),
      zt(static_cast<size_t>(rc));
  T loss_acc = 0;
  for (int64_t r0 = 0; r0 < M; r0 += rc) {
    const int64_t nr = std::min(rc, M - r0);
    std::fill(mx.begin(), mx.end(), -std::numeric_limits<T>::infinity());
    std::fill(sum.begin(), sum.end(), T(0));
    std::fill(zt.begin(), zt.end(), T(0));
    // Pass 1: online logsumexp, argmax and target logit over vocabulary chunks.
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
      const int64_t nv = std::min(vc, V - v0);
      blas::gemm(false, true, int(nr), int(nv), int(D), T(1), h.row(r0), int(D), W.row(v0), int(D), T(0), z.data(),
                 int(nv));
      for (int64_t i = 0; i < nr; ++i) {
        const T* zi = z.data() + i * nv;
        T cm = zi[0];
        int64_t ca = 0;
        for (int64_t j = 1; j < nv; ++j)
          if (zi[j] > cm) cm = zi[j], ca = j;
        T& m = mx[size_t(i)];
        if (cm > m) res.argmax[size_t(r0 + i)] = int32_t(v0 + ca);  // strict: first occurrence wins
        const T nm = std::max(m, cm);
        T s = sum[size_t(i)] * std::exp(m - nm);  // m = -inf at the first chunk: 0 * 0
        for (int64_t j = 0; j < nv; ++j) s += std::exp(zi[j] - nm);
        sum[size_t(i)] = s;
        m = nm;
        const int64_t t = targets[size_t(r0 + i)];
        if (t >= v0 && t < v0 + nv) zt[size_t(i)] = zi[t - v0];
      }
    }
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t m = r0 + i;
      res.lse[size_t(m)] = mx[size_t(i)] + std::log(sum[size_t(i)]);
      if (weights[size_t(m)] != T(0)) {
        res.ce[size_t(m)] = res.lse[size_t(m)] - zt[size_t(i)];
        loss_acc += weights[size_t(m)] * res.ce[size_t(m)];
      }
    }
    if (!dh || inv_wsum == T(0)) continue;
    // Pass 2: recompute each logits block, turn it into (w/sum w)(softmax - onehot), accumulate @ W.
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
      const int64_t nv = std::min(vc, V - v0);
      blas::gemm(false, true, int(nr), int(nv), int(D), T(1), h.row(r0), int(D), W.row(v0), int(D), T(0), z.data(),
                 int(nv));
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t m = r0 + i;
        const T c = weights[size_t(m)] * inv_wsum, L = res.lse[size_t(m)];
        T* zi = z.data() + i * nv;
        if (c == T(0)) {
          std::fill(zi, zi + nv, T(0));
          continue;
        }
        for (int64_t j = 0; j < nv; ++j) zi[j] = c * std::exp(zi[j] - L);
        const int64_t t = targets[size_t(m)];
        if (t >= v0 && t < v0 + nv) zi[t - v0] -= c;
      }
      blas::gemm(false, false, int(nr), int(D), int(nv), T(1), z.data(), int(nv), W.row(v0), int(D), T(1),
                 dh->row(r0), int(D));
    }
  }
  res.loss = loss_acc * inv_wsum;
  return res;
}

template ChunkedCeResult<float> chunked_cross_entropy<float>(const Tensor&, const Tensor&,
                                                             const std::vector<int32_t>&, const std::vector<float>&,
                                                             int64_t, int64_t, Tensor*);
template ChunkedCeResult<double> chunked_cross_entropy<double>(const Tensor64&, const Tensor64&,
                                                               const std::vector<int32_t>&,
                                                               const std::vector<double>&, int64_t, int64_t,
                                                               Tensor64*);

}  // namespace dflash::cpu
