#include "io/fp8_checkpoint.h"

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

namespace dflash {

namespace {

bool is_scale_name(const std::string& n) {
  return n.ends_with(".weight_scale_inv") || n.ends_with(".weight_scale") || n.ends_with(".input_scale");
}

class Fp8Dequantizing : public WeightSource {
 public:
  Fp8Dequantizing(std::unique_ptr<WeightSource> inner, std::optional<Fp8Format> f)
      : inner_(std::move(inner)), format_(std::move(f)) {}

  std::vector<std::string> names() const override {
    std::vector<std::string> r;
    for (std::string& n : inner_->names())
      if (!is_scale_name(n)) r.push_back(std::move(n));
    return r;
  }
  bool has(const std::string& name) const override { return !is_scale_name(name) && inner_->has(name); }
  TensorInfo info(const std::string& name) const override {
    TensorInfo t = inner_->info(name);
    if (t.dtype == DType::F8_E4M3) t.dtype = DType::F32, t.storage = "F8_E4M3";
    return t;
  }
  std::string origin() const override { return inner_->origin(); }

  Tensor load_f32(const std::string& name) const override {
    const TensorInfo ti = inner_->info(name);
    Tensor t = inner_->load_f32(name);
    if (ti.dtype != DType::F8_E4M3) return t;
    const std::string where = ti.file + ": tensor '" + name + "'";
    if (!format_)
      throw std::runtime_error(where + " is F8_E4M3 but config.json has no quantization_config saying how it is "
                                       "scaled (quant_method fp8 or fbgemm_fp8)");
    if (t.ndim() != 2) throw std::runtime_error(where + ": an F8_E4M3 weight must be 2-D [out, in], is " + shape_str(t.shape));
    const int64_t N = t.dim(0), K = t.dim(1);
    const bool blocks = format_->block_n > 0;
    const std::string sname = name + (blocks ? "_scale_inv" : "_scale");
    if (!inner_->has(sname))
      throw std::runtime_error(where + " is F8_E4M3 without its scale tensor '" + sname + "' (quant_method " +
                               format_->quant_method + ")");
    const Tensor sc = inner_->load_f32(sname);
    const std::string bad = inner_->info(sname).file + ": scale tensor '" + sname + "' has shape " + shape_str(sc.shape);
    if (blocks) {
      const int64_t bn = format_->block_n, bk = format_->block_k, rn = (N + bn - 1) / bn, rk = (K + bk - 1) / bk;
      if (sc.shape != std::vector<int64_t>{rn, rk})
        throw std::runtime_error(bad + ", expected [" + std::to_string(rn) + ", " + std::to_string(rk) + "] (blocks of " +
                                 std::to_string(bn) + " x " + std::to_string(bk) + " over " + shape_str(t.shape) + ")");
      for (int64_t n = 0; n < N; ++n) {
        float* row = t.data.data() + n * K;
        const float* srow = sc.data.data() + (n / bn) * rk;
        for (int64_t k0 = 0; k0 < K; k0 += bk) {
          const float s = srow[k0 / bk];
          for (int64_t k = k0; k < std::min(K, k0 + bk); ++k) row[k] *= s;
        }
      }
    } else {
      const int64_t S = sc.numel();
      const bool per_tensor = S == 1 && sc.ndim() <= 1;
      const bool per_channel = S == N && (sc.ndim() == 1 || (sc.ndim() == 2 && sc.dim(1) == 1));
      if (!per_tensor && !per_channel)
        throw std::runtime_error(bad + ", expected [" + std::to_string(N) + ", 1], [" + std::to_string(N) +
                                 "] (per output channel) or [] (per tensor)");
      for (int64_t n = 0; n < N; ++n) {
        const float s = sc.data[size_t(per_tensor ? 0 : n)];
        for (int64_t k = 0; k < K; ++k) t.data[size_t(n * K + k)] *= s;
      }
    }
    return t;
  }

 private:
  std::unique_ptr<WeightSource> inner_;
  std::optional<Fp8Format> format_;
};

}  // namespace

std::optional<Fp8Format> read_fp8_format(const nlohmann::json& cfg, const std::string& where) {
  if (!cfg.contains("quantization_config") || cfg["quantization_config"].is_null()) return std::nullopt;
  const nlohmann::json& q = cfg["quantization_config"];
  const std::string method = q.is_object() && q.contains("quant_method") && q["quant_method"].is_string()
                                 ? q["quant_method"].get<std::string>()
                                 : "";
  if (method != "fp8" && method != "fbgemm_fp8")
    throw std::runtime_error(where + ": quantization_config quant_method '" + method +
                             "' is not read (supported: fp8, fbgemm_fp8; or give an unquantized checkpoint)");
  Fp8Format f;
  f.quant_method = method;
  if (q.contains("weight_block_size") && !q["weight_block_size"].is_null()) {
    const nlohmann::json& b = q["weight_block_size"];
    if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
        b[0].get<int64_t>() <= 0 || b[1].get<int64_t>() <= 0)
      throw std::runtime_error(where + ": quantization_config weight_block_size must be two positive integers, is " +
                               b.dump());
    f.block_n = b[0].get<int64_t>(), f.block_k = b[1].get<int64_t>();
  }
  return f;
}

std::unique_ptr<WeightSource> fp8_dequantizing(std::unique_ptr<WeightSource> inner, std::optional<Fp8Format> format) {
  return std::make_unique<Fp8Dequantizing>(std::move(inner), std::move(format));
}

}  // namespace dflash
