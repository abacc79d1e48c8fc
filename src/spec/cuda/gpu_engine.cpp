// The GPU decoding engine (TargetGpu with its KV cache and GatedDeltaNet states) and the GPU drafter (DrafterGpu
// drafting from its context key / value cache, as the CPU reference drafter).
#include <algorithm>
#include <stdexcept>

#include "models/cuda/drafter_gpu.h"
#include "models/cuda/target_gpu.h"
#include "spec/decoder.h"
#include "tensor/dtype.h"

namespace dflash {

namespace {

/// A stream on `device` (made current for the calling thread), destroyed with this object: declared
/// before what runs on it, it also goes when a constructor after it throws.
struct OwnedStream {
  cudaStream_t s = nullptr;
  explicit OwnedStream(int device) {
    cuda::require_device("decoding --device cuda", device);
    DFLASH_CUDA_CHECK(cudaSetDevice(device));
    DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  ~OwnedStream() { cudaStreamDestroy(s); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
};

class GpuDecoder final : public TargetDecoder {
 public:
  GpuDecoder(const TargetModel& m, std::vector<int64_t> taps, int device, TargetDtype dtype)
      : s_(device), gpu_(m, s_.s, dtype), taps_(std::move(taps)) {
    check_tap_layer_ids(m.spec(), taps_);
    gpu_.reset_cache(0);
  }
  const ModelSpec& spec() const override { return gpu_.spec(); }
  void reset(int n) override { gpu_.reset_cache(n); }
  void clear(int s) override { gpu_.truncate_cache(s, 0); }
  std::vector<DecodeOutput> feed(const std::vector<std::vector<int32_t>>& tokens, bool keep_rollback,
                                 bool logits) override {
    std::vector<int32_t> ids, amax;
    std::vector<int64_t> cu;
    pack_feed(tokens, &ids, &cu);
    ForwardOptions fo;
    fo.logits = logits;
    fo.keep_rollback = keep_rollback;
    fo.hidden_states = tap_hidden_states(taps_);
    const ForwardOutput f = gpu_.forward_cached(ids, cu, fo, &amax);
    return split_feed_output(f, cu, taps_, &amax, logits);
  }
  void rollback(int s, int64_t length) override { gpu_.truncate_cache(s, length); }
  int64_t length(int s) const override { return gpu_.cached_length(s); }
  std::string describe() const override {
    const bool gdn = std::count(spec().layer_types.begin(), spec().layer_types.end(), LayerKind::GatedDeltaNet) > 0;
    const std::string weights = gpu_.dtype() == TargetDtype::kFp8 ? "fp8 projections (E4M3, per-channel x per-token scales)"
                                                                  : "bf16 weights";
    return "cuda (" + weights + ", KV cache, masked_attention_forward<head_dim " + std::to_string(gpu_.spec().head_dim) +
           ">, cuBLASLt" + (gdn ? ", GatedDeltaNet conv windows and states (recurrent kernel when verifying)" : "") + ")";
  }

 private:
  OwnedStream s_;
  TargetGpu gpu_;
  std::vector<int64_t> taps_;
};

/// DrafterGpu's context cache and batched drafts. Context taps arrive per sequence (host float32)
/// and are projected into the cache in one batch when the next draft needs them.
class GpuDrafter final : public BlockDrafter {
 public:
  GpuDrafter(const DrafterConfig& c, const DrafterWeights<float>& w, const Tensor& embed, const Tensor& lm_head,
             int device)
      : s_(device), gpu_(c, w, embed, lm_head, s_.s) {}
  const DrafterConfig& config() const override { return gpu_.config(); }
  void reset(int n) override {
    gpu_.reset_context(n);
    pending_.assign(size_t(n), {});
  }
  void clear(int s) override {
    gpu_.truncate_context(s, 0);
    pending_.at(size_t(s)).clear();
  }
  void append_context(int s, const Tensor& taps) override {
    const int64_t width = int64_t(config().target_layer_ids.size()) * config().hidden_size;
    if (taps.ndim() != 2 || taps.dim(1) != width)
      throw std::invalid_argument("drafter: context taps " + shape_str(taps.shape) + ", expected [m, " +
                                  std::to_string(width) + "]");
    std::vector<uint16_t>& c = pending_.at(size_t(s));
    for (float x : taps.data) c.push_back(f32_to_bf16(x));
  }
  std::vector<std::vector<int32_t>> draft(const std::vector<int32_t>& last) override {
    flush();
    return gpu_.draft(last);
  }
  std::string describe() const override { return "cuda drafter (bf16, context key / value cache, batched drafts)"; }

 private:
  /// Projects every sequence's pending context rows into the cache, one batch.
  void flush() {
    std::vector<uint16_t> all;
    std::vector<int64_t> cu{0};
    const int64_t width = int64_t(config().target_layer_ids.size()) * config().hidden_size;
    for (const std::vector<uint16_t>& p : pending_) {
      all.insert(all.end(), p.begin(), p.end());
      cu.push_back(int64_t(all.size()) / width);
    }
    if (all.empty()) return;
    const cuda::StreamBuffer<uint16_t> taps = cuda::upload(all, s_.s);
    gpu_.extend_context(reinterpret_cast<const cuda::bf16*>(taps.data()), cu);
    for (std::vector<uint16_t>& p : pending_) p.clear();  // only once they are in the cache
  }

  OwnedStream s_;
  DrafterGpu gpu_;
  std::vector<std::vector<uint16_t>> pending_;  // per sequence: context taps [m, K*d] not yet projected (bf16 bits)
};

}  // namespace

std::unique_ptr<TargetDecoder> make_gpu_decoder(const TargetModel& model, std::vector<int64_t> tap_layer_ids,
                                                int device, TargetDtype dtype) {
  return std::make_unique<GpuDecoder>(model, std::move(tap_layer_ids), device, dtype);
}

std::unique_ptr<BlockDrafter> make_gpu_drafter(const DrafterConfig& cfg, const DrafterWeights<float>& weights,
                                               const Tensor& embed, const Tensor& lm_head, int device) {
  return std::make_unique<GpuDrafter>(cfg, weights, embed, lm_head, device);
}

}  // namespace dflash
