// DSpark's loss in DrafterGpu's training step: per chunk of rows, the corrected draft logits
// z = lm_head h + W2 W1[prev] and the target's logits t by cuBLASLt (fp32), the row kernel
// (cuda::dspark_rows), then dh = dz lm_head, de = dz W2, dW2 += dz^T e and the heads' backward.
// Reference: dspark_loss (src/models/dspark.cpp).
#include <algorithm>
#include <stdexcept>

#include "models/cuda/drafter_gpu_impl.h"
#include "ops/cuda/dspark_loss.h"
#include "ops/cuda/elementwise.h"

namespace dflash {

using cuda::bf16;
using cuda::StreamBuffer;

int64_t dspark_loss_row_chunk(int64_t V, int64_t rows, int64_t max_bytes) {
  if (V <= 0 || rows <= 0) throw std::invalid_argument("dspark_loss_row_chunk: V and rows must be > 0");
  return std::min(rows, std::max<int64_t>(16, max_bytes / (V * 10)));
}

int64_t dspark_loss_workspace_bytes(const DrafterConfig& c, int64_t V, int64_t rows, int64_t rc) {
  const int64_t d = c.hidden_size, r = c.markov_rank;
  return rc * V * (4 + 4 + 2) + rows * (2 * r + 2 * d) + rc * 4 * (d + r) + rows * 4 * (4 + 5 + 1);
}

void dspark_step_loss(DrafterGpu::Impl& I, const DrafterConfig& c, const bf16* hf, int64_t rows, const bf16* g,
                      int64_t S, const std::vector<int32_t>& labels, const std::vector<int32_t>& prev,
                      const std::vector<int32_t>& trow, const std::vector<float>& coef, int64_t rc, bf16* dhf,
                      float w2_beta, std::vector<double>* row_loss, std::vector<int32_t>* argmax) {
  cudaStream_t s = I.s;
  const int64_t d = c.hidden_size, r = c.markov_rank, V = I.V;
  if (rows <= 0 || rc <= 0 || int64_t(labels.size()) != rows || int64_t(prev.size()) != rows ||
      int64_t(trow.size()) != rows || int64_t(coef.size()) != rows)
    throw std::invalid_argument("dspark_step_loss: row arrays disagree");
  for (int32_t t : trow)
    if (t < 0 || t >= S) throw std::invalid_argument("dspark_step_loss: target row outside the sequence");
  const int64_t w1 = I.p.markov_w1, w2 = I.p.markov_w2, cw = I.p.confidence_w, cb = I.p.confidence_b;
  auto d_labels = cuda::upload(labels, s), d_prev = cuda::upload(prev, s), d_trow = cuda::upload(trow, s);
  auto d_coef = cuda::upload(coef, s);
  StreamBuffer<bf16> e(size_t(rows * r), s), gsel(size_t(rows * d), s);  // W1[prev], target_hidden[trow]
  cuda::embedding_gather(I.W(w1), V, r, d_prev.data(), rows, e.data(), nullptr, s);
  cuda::embedding_gather(g, S, d, d_trow.data(), rows, gsel.data(), nullptr, s);
  StreamBuffer<float> zb(size_t(rc * V), s), tb(size_t(rc * V), s);
  StreamBuffer<bf16> dz(dhf ? size_t(rc * V) : 0, s);
  StreamBuffer<float> dh_lm(dhf ? size_t(rc * d) : 0, s), de_lm(dhf ? size_t(rc * r) : 0, s);
  StreamBuffer<float> ce(size_t(rows), s), l1(size_t(rows), s), bce(size_t(rows), s), dc(size_t(rows), s);
  StreamBuffer<int32_t> amax(size_t(rows), s);
  for (int64_t r0 = 0; r0 < rows; r0 += rc) {
    const int64_t n = std::min(rc, rows - r0);
    const bf16 *h = hf + r0 * d, *er = e.data() + r0 * r;
    I.gemm.gemm({n, V, d, false, true}, h, I.lm_head.data(), zb.data());               // lm_head h
    I.gemm.gemm({n, V, r, false, true}, er, I.W(w2), zb.data(), 1.f, 1.f);              // + W2 e
    I.gemm.gemm({n, V, d, false, true}, gsel.data() + r0 * d, I.lm_head.data(), tb.data());  // target's logits
    cuda::dspark_rows(zb.data(), tb.data(), n, V, d_labels.data() + r0, d_coef.data() + r0, h, er, d, r, I.F(cw),
                      I.F(cb), {ce.data() + r0, l1.data() + r0, bce.data() + r0, amax.data() + r0, dc.data() + r0},
                      dhf ? dz.data() : nullptr, s);
    if (!dhf) continue;
    I.gemm.gemm({n, d, V, false, false}, dz.data(), I.lm_head.data(), dh_lm.data());  // dz lm_head
    I.gemm.gemm({n, r, V, false, false}, dz.data(), I.W(w2), de_lm.data());            // dz W2
    I.gemm.gemm({V, r, n, true, false}, dz.data(), er, I.G(w2), 1.f, r0 == 0 ? w2_beta : 1.f);  // dW2 += dz^T e
    cuda::dspark_heads_backward(dc.data() + r0, h, er, d_prev.data() + r0, n, d, r, I.F(cw), dh_lm.data(),
                                de_lm.data(), dhf + r0 * d, I.G(w1), I.G(cw), I.G(cb), s);
  }
  std::vector<float> h_ce(static_cast<size_t>(rows)), h_l1(h_ce), h_bce(h_ce);
  argmax->resize(size_t(rows));
  for (auto [host, dev] : {std::pair{h_ce.data(), ce.data()}, {h_l1.data(), l1.data()}, {h_bce.data(), bce.data()}})
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(host, dev, size_t(rows) * 4, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(argmax->data(), amax.data(), size_t(rows) * 4, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  row_loss->resize(size_t(rows));
  for (int64_t i = 0; i < rows; ++i)
    (*row_loss)[size_t(i)] = 0.1 * double(h_ce[size_t(i)]) + 0.9 * double(h_l1[size_t(i)]) + double(h_bce[size_t(i)]);
}

}  // namespace dflash
