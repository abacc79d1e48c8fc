// cpu::gated_delta_rule_chunked (ops/gated_delta_rule.h): the chunked gated delta rule stage by stage,
// the reference of each GPU kernel (src/ops/cuda/gdn_*.cu), in double.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "ops/attention.h"
#include "ops/gated_delta_rule.h"

namespace dflash::cpu {

namespace {

/// Row-major double matrix [rows][cols].
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> a;
  Mat(int64_t r, int64_t c) : rows(r), cols(c), a(size_t(r * c), 0.0) {}
  double& operator()(int64_t i, int64_t j) { return a[size_t(i * cols + j)]; }
  double operator()(int64_t i, int64_t j) const { return a[size_t(i * cols + j)]; }
};

double dot(const float* x, const float* y, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * y[i];
  return s;
}

}  // namespace

GdnChunkedTrace gated_delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                         const Tensor& beta, const std::vector<int64_t>& cu_seqlens,
                                         const Tensor* initial_state, int64_t chunk) {
  if (q.ndim() != 3 || k.shape != q.shape || v.ndim() != 3 || v.dim(0) != q.dim(0) || k.dim(1) == 0 ||
      v.dim(1) % k.dim(1) != 0 || g.shape != std::vector<int64_t>{v.dim(0), v.dim(1)} || beta.shape != g.shape ||
      chunk < 1)
    throw std::invalid_argument("gated_delta_rule_chunked: q " + shape_str(q.shape) + ", k " + shape_str(k.shape) +
                                ", v " + shape_str(v.shape) + ", g " + shape_str(g.shape) + ", beta " +
                                shape_str(beta.shape) + ", chunk " + std::to_string(chunk));
  const int64_t T = q.dim(0), Hk = q.dim(1), dk = q.dim(2), Hv = v.dim(1), dv = v.dim(2), rep = Hv / Hk;
  check_cu_seqlens(cu_seqlens, T, "gated_delta_rule_chunked");
  const int64_t nseq = int64_t(cu_seqlens.size()) - 1;
  const std::vector<int64_t> state_shape{nseq, Hv, dk, dv};
  if (initial_state && initial_state->shape != state_shape)
    throw std::invalid_argument("gated_delta_rule_chunked: initial_state " + shape_str(initial_state->shape) +
                                ", expected " + shape_str(state_shape));
  int64_t n_chunks = 0;
  for (int64_t s = 0; s < nseq; ++s)
    n_chunks += (cu_seqlens[size_t(s) + 1] - cu_seqlens[size_t(s)] + chunk - 1) / chunk;
  GdnChunkedTrace r;
  r.G = Tensor({T, Hv});
  r.w = Tensor({T, Hv, dk});
  r.u = Tensor({T, Hv, dv});
  r.P = Tensor({n_chunks, Hv, chunk, chunk});
  r.h = Tensor({n_chunks, Hv, dk, dv});
  r.v_new = Tensor({T, Hv, dv});
  r.o = Tensor({T, Hv, dv});
  r.final_state = initial_state ? *initial_state : Tensor(state_shape);
  auto kr = [&](int64_t t, int64_t kh) { return k.ptr() + (t * Hk + kh) * dk; };  // token t's key of head kh
  auto qr = [&](int64_t t, int64_t kh) { return q.ptr() + (t * Hk + kh) * dk; };
  for (int64_t s = 0, ci0 = 0; s < nseq; ++s) {
    const int64_t b = cu_seqlens[size_t(s)], e = cu_seqlens[size_t(s) + 1];
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t kh = h / rep;
      float* state = r.final_state.ptr() + (s * Hv + h) * dk * dv;
      Mat S(dk, dv);  // the state, in double across the sequence's chunks
      for (int64_t i = 0; i < dk * dv; ++i) S.a[size_t(i)] = state[i];
      for (int64_t c0 = b, ci = ci0; c0 < e; c0 += chunk, ++ci) {
        const int64_t L = std::min(chunk, e - c0);
        auto gate = [&](const Tensor& x, int64_t i) { return double(x.data[size_t((c0 + i) * Hv + h)]); };
        // chunk_prepare: G, A, T = (I + A)^-1 by forward substitution, w, u, P.
        std::vector<double> G(static_cast<size_t>(L));
        for (int64_t i = 0; i < L; ++i) G[size_t(i)] = (i ? G[size_t(i) - 1] : 0.0) + gate(g, i);
        Mat A(L, L), Tm(L, L), P(L, L);
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j < i; ++j)
            A(i, j) = gate(beta, i) * std::exp(G[size_t(i)] - G[size_t(j)]) * dot(kr(c0 + i, kh), kr(c0 + j, kh), dk);
        for (int64_t i = 0; i < L; ++i) {  // (I + A) T = I: T_ij = [i == j] - sum_{j <= m < i} A_im T_mj
          Tm(i, i) = 1.0;
          for (int64_t j = 0; j < i; ++j) {
            double acc = 0;
            for (int64_t m = j; m < i; ++m) acc += A(i, m) * Tm(m, j);
            Tm(i, j) = -acc;
          }
        }
        Mat W(L, dk), Uh(L, dv);
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j <= i; ++j) {
            const double cw = Tm(i, j) * gate(beta, j) * std::exp(G[size_t(j)]), cu = Tm(i, j) * gate(beta, j);
            const float* kj = kr(c0 + j, kh);
            const float* vj = v.ptr() + ((c0 + j) * Hv + h) * dv;
            for (int64_t m = 0; m < dk; ++m) W(i, m) += cw * kj[m];
            for (int64_t n = 0; n < dv; ++n) Uh(i, n) += cu * vj[n];
          }
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j <= i; ++j)
            P(i, j) = std::exp(G[size_t(i)] - G[size_t(j)]) * dot(qr(c0 + i, kh), kr(c0 + j, kh), dk);
        // chunk_state: the state before the chunk, U = u - w S0, then the state after it.
        std::copy(S.a.begin(), S.a.end(), r.h.data.begin() + (ci * Hv + h) * dk * dv);
        Mat U(L, dv);
        for (int64_t i = 0; i < L; ++i)
          for (int64_t n = 0; n < dv; ++n) {
            double ws = 0;
            for (int64_t m = 0; m < dk; ++m) ws += W(i, m) * S(m, n);
            U(i, n) = Uh(i, n) - ws;
          }
        // chunk_out: O = diag(exp(G)) Q S0 + P U (before the state moves on).
        for (int64_t i = 0; i < L; ++i) {
          const float* qi = qr(c0 + i, kh);
          float* oi = r.o.ptr() + ((c0 + i) * Hv + h) * dv;
          for (int64_t n = 0; n < dv; ++n) {
            double qs = 0, pu = 0;
            for (int64_t m = 0; m < dk; ++m) qs += double(qi[m]) * S(m, n);
            for (int64_t j = 0; j <= i; ++j) pu += P(i, j) * U(j, n);
            oi[n] = float(std::exp(G[size_t(i)]) * qs + pu);
          }
        }
        const double gl = std::exp(G[size_t(L) - 1]);
        for (auto& x : S.a) x *= gl;
        for (int64_t j = 0; j < L; ++j) {
          const double d = std::exp(G[size_t(L) - 1] - G[size_t(j)]);
          const float* kj = kr(c0 + j, kh);
          for (int64_t m = 0; m < dk; ++m)
            for (int64_t n = 0; n < dv; ++n) S(m, n) += d * kj[m] * U(j, n);
        }
        // The trace, fp32.
        for (int64_t i = 0; i < L; ++i) {
          const int64_t t = c0 + i;
          r.G.data[size_t(t * Hv + h)] = float(G[size_t(i)]);
          for (int64_t m = 0; m < dk; ++m) r.w.data[size_t((t * Hv + h) * dk + m)] = float(W(i, m));
          for (int64_t n = 0; n < dv; ++n) {
            r.u.data[size_t((t * Hv + h) * dv + n)] = float(Uh(i, n));
            r.v_new.data[size_t((t * Hv + h) * dv + n)] = float(U(i, n));
          }
          for (int64_t j = 0; j < L; ++j) r.P.data[size_t(((ci * Hv + h) * chunk + i) * chunk + j)] = float(P(i, j));
        }
      }
      for (int64_t i = 0; i < dk * dv; ++i) state[i] = float(S.a[size_t(i)]);
    }
    ci0 += (e - b + chunk - 1) / chunk;
  }
  return r;
}

}  // namespace dflash::cpu
