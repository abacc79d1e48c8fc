// FP8 E4M3 scalars (the CPU reference of the GPU quantizer) and FP8 checkpoints as transformers writes
// them (block scales, per-channel and per-tensor scales), read as float32: by hand-built files and by a
// whole fixture target converted to FP8.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>

#include "io/fp8_checkpoint.h"
#include "io/json_file.h"
#include "io/safetensors.h"
#include "models/target.h"
#include "tensor/dtype.h"
#include "test_util.h"

using namespace dflash;

TEST(Fp8E4M3, EveryCodeRoundTripsAndTheGridIsTheOcpOne) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.f);         // largest finite
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), 0.015625f);     // smallest normal 2^-6
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.f);
  EXPECT_EQ(fp8_e4m3_to_f32(0xb8), -1.f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xff)));
  float prev = -1.f;
  for (int c = 0; c < 0x7f; ++c) {
    const float v = fp8_e4m3_to_f32(uint8_t(c));
    EXPECT_GT(v, prev) << "code " << c;  // positive codes are ordered
    prev = v;
    EXPECT_EQ(f32_to_fp8_e4m3(v), c);
    EXPECT_EQ(f32_to_fp8_e4m3(-v), c == 0 ? 0x80 : (0x80 | c));
  }
}

TEST(Fp8E4M3, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(f32_to_fp8_e4m3(1.0625f), 0x38);       // halfway 1 and 1.125: even (1)
  EXPECT_EQ(f32_to_fp8_e4m3(1.1875f), 0x3a);       // halfway 1.125 and 1.25: even (1.25)
  EXPECT_EQ(f32_to_fp8_e4m3(1.07f), 0x39);         // above halfway
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(1.5f, -9)), 0x02);   // subnormal tie: even (2)
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(0.5f, -9)), 0x00);   // to zero
  EXPECT_EQ(f32_to_fp8_e4m3(0.0146484375f), 0x08);  // 7.5 x 2^-9: tie to the smallest normal (even code 8)
  EXPECT_EQ(f32_to_fp8_e4m3(15.5f), 0x58);          // halfway 15 and 16: 16 (even mantissa 0)
  EXPECT_EQ(f32_to_fp8_e4m3(460.f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(1e9f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(f32_to_fp8_e4m3(NAN), 0x7f);
}

namespace {

/// One 2-D weight `w` [N, K] quantized with `scales` laid out as the format says.
struct Fp8Tensor {
  std::vector<uint8_t> q;
  std::vector<float> scale;
  std::vector<int64_t> scale_shape;
};

Fp8Tensor quantize_blocks(const std::vector<float>& w, int64_t N, int64_t K, int64_t bn, int64_t bk) {
  const int64_t rn = (N + bn - 1) / bn, rk = (K + bk - 1) / bk;
  Fp8Tensor t;
  t.scale.assign(size_t(rn * rk), 0.f);
  t.scale_shape = {rn, rk};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      float& s = t.scale[size_t((n / bn) * rk + k / bk)];
      s = std::max(s, std::fabs(w[size_t(n * K + k)]) / kFp8E4M3Max);
    }
  for (float& s : t.scale) s = s > 0 ? s : 1.f;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      t.q.push_back(f32_to_fp8_e4m3(w[size_t(n * K + k)] / t.scale[size_t((n / bn) * rk + k / bk)]));
  return t;
}

void write_config(const std::filesystem::path& dir, const nlohmann::json& quant) {
  nlohmann::json cfg = {{"architectures", {"Qwen3ForCausalLM"}}};
  if (!quant.is_null()) cfg["quantization_config"] = quant;
  std::ofstream(dir / "config.json") << cfg.dump();
}

std::unique_ptr<WeightSource> open_fp8(const std::filesystem::path& dir) {
  const std::string cfg = (dir / "config.json").string();
  return fp8_dequantizing(SafetensorsCheckpoint::open(dir.string()), read_fp8_format(read_json_file(cfg), cfg));
}

}  // namespace

TEST(Fp8Checkpoint, BlockScalesDequantizeEachBlock) {
  test::TempDir d;
  const int64_t N = 5, K = 7;
  std::vector<float> w(size_t(N * K));
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(std::sin(double(i) * 1.3) * (1.0 + double(i % 4) * 10.0));
  const Fp8Tensor t = quantize_blocks(w, N, K, 2, 4);
  const std::vector<float> other = {1.f, 2.f};
  write_safetensors((d / "model.safetensors").string(),
                    {{"m.weight", DType::F8_E4M3, {N, K}, t.q.data()},
                     {"m.weight_scale_inv", DType::F32, t.scale_shape, t.scale.data()},
                     {"m.input_scale", DType::F32, {}, other.data()},
                     {"norm.weight", DType::F32, {2}, other.data()}});
  write_config(d.path(), {{"quant_method", "fp8"}, {"weight_block_size", {2, 4}}, {"activation_scheme", "dynamic"}});
  const auto src = open_fp8(d.path());
  EXPECT_EQ(src->names(), (std::vector<std::string>{"m.weight", "norm.weight"}));
  EXPECT_FALSE(src->has("m.weight_scale_inv"));
  EXPECT_EQ(src->info("m.weight").dtype, DType::F32);
  EXPECT_EQ(src->info("m.weight").storage, "F8_E4M3");
  const Tensor got = src->load_f32("m.weight");
  ASSERT_EQ(got.shape, (std::vector<int64_t>{N, K}));
  double err = 0, ref = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const size_t i = size_t(n * K + k);
      EXPECT_EQ(got.data[i], fp8_e4m3_to_f32(t.q[i]) * t.scale[size_t((n / 2) * 2 + k / 4)]);
      err += std::pow(got.data[i] - w[i], 2), ref += std::pow(w[i], 2);
    }
  EXPECT_LT(std::sqrt(err / ref), 0.0625);  // E4M3: 3 mantissa bits, a relative step of at most 2^-3
  EXPECT_EQ(src->load_f32("norm.weight").data, other);
}

TEST(Fp8Checkpoint, PerChannelAndPerTensorScales) {
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{3, 1}, {3}, {}}) {
    test::TempDir d;
    const std::vector<uint8_t> q = {0x38, 0x40, 0xb8, 0x30, 0x00, 0x7e};  // [3, 2]: 1, 2, -1, 0.5, 0, 448
    const std::vector<float> scale = shape.empty() ? std::vector<float>{0.5f} : std::vector<float>{0.5f, 2.f, 0.25f};
    write_safetensors((d / "model.safetensors").string(),
                      {{"m.weight", DType::F8_E4M3, {3, 2}, q.data()}, {"m.weight_scale", DType::F32, shape, scale.data()}});
    write_config(d.path(), {{"quant_method", "fbgemm_fp8"}});
    const Tensor got = open_fp8(d.path())->load_f32("m.weight");
    const std::vector<float> want = shape.empty() ? std::vector<float>{0.5f, 1.f, -0.5f, 0.25f, 0.f, 224.f}
                                                  : std::vector<float>{0.5f, 1.f, -2.f, 1.f, 0.f, 112.f};
    EXPECT_EQ(got.data, want) << "scale shape rank " << shape.size();
  }
}

TEST(Fp8Checkpoint, BadScalesAndFormatsAreNamed) {
  test::TempDir d;
  const std::vector<uint8_t> q(6, 0x38);
  const std::vector<float> s = {1.f, 1.f};
  write_safetensors((d / "model.safetensors").string(), {{"a.weight", DType::F8_E4M3, {3, 2}, q.data()},
                                                         {"b.weight", DType::F8_E4M3, {3, 2}, q.data()},
                                                         {"b.weight_scale", DType::F32, {2}, s.data()}});
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  write_config(d.path(), {{"quant_method", "fp8"}});
  EXPECT_NE(message([&] { open_fp8(d.path())->load_f32("a.weight"); }).find("without its scale tensor 'a.weight_scale'"),
            std::string::npos);
  EXPECT_NE(message([&] { open_fp8(d.path())->load_f32("b.weight"); }).find("'b.weight_scale' has shape [2]"),
            std::string::npos);
  write_config(d.path(), nullptr);
  EXPECT_NE(message([&] { open_fp8(d.path())->load_f32("a.weight"); }).find("no quantization_config"), std::string::npos);
  write_config(d.path(), {{"quant_method", "gptq"}});
  EXPECT_NE(message([&] { open_fp8(d.path()); }).find("quant_method 'gptq' is not read"), std::string::npos);
  write_config(d.path(), {{"quant_method", "fp8"}, {"weight_block_size", {128}}});
  EXPECT_NE(message([&] { open_fp8(d.path()); }).find("weight_block_size must be two positive integers"), std::string::npos);
}

// The Qwen3 fixture with every projection stored as transformers' FineGrainedFP8 writes it (E4M3 and
// 16 x 16 block scales): TargetModel::load reads it, and every weight it holds is exactly the
// dequantized E4M3 value (the projections) or the original (norms, embeddings).
TEST(Fp8Checkpoint, AQwen3TargetInFp8LoadsItsDequantizedWeights) {
  const auto fixture = test::fixtures_dir() / "qwen3";
  const auto st = SafetensorsCheckpoint::open(fixture.string());
  test::TempDir d;
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, Tensor> dense;
  std::map<std::string, Fp8Tensor> quantized;
  for (const std::string& n : st->names()) {
    Tensor t = st->load_f32(n);
    const bool projection = t.ndim() == 2 && n.find("layers.") != std::string::npos;
    if (projection) quantized[n] = quantize_blocks(t.data, t.dim(0), t.dim(1), 16, 16);
    dense[n] = std::move(t);
  }
  for (const auto& [n, t] : dense) {
    auto it = quantized.find(n);
    if (it == quantized.end()) {
      entries.push_back({n, DType::F32, t.shape, t.data.data()});
      continue;
    }
    entries.push_back({n, DType::F8_E4M3, t.shape, it->second.q.data()});
    entries.push_back({n + "_scale_inv", DType::F32, it->second.scale_shape, it->second.scale.data()});
  }
  ASSERT_FALSE(quantized.empty());
  write_safetensors((d / "model.safetensors").string(), entries);
  nlohmann::json cfg = read_json_file((fixture / "config.json").string());
  cfg["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {16, 16}}};
  std::ofstream(d / "config.json") << cfg.dump();

  const auto fp8 = TargetModel::load(d.path().string());
  EXPECT_NE(open_model(d.path().string()).format.find("16 x 16 block scales"), std::string::npos);
  auto dequantized = [&](const std::string& name) {
    const Fp8Tensor& q = quantized.at(name);
    const int64_t K = dense.at(name).dim(1), rk = q.scale_shape[1];
    std::vector<float> w(q.q.size());
    for (size_t i = 0; i < w.size(); ++i) {
      const int64_t n = int64_t(i) / K, k = int64_t(i) % K;
      w[i] = fp8_e4m3_to_f32(q.q[i]) * q.scale[size_t((n / 16) * rk + k / 16)];
    }
    return w;
  };
  const std::string p = fp8->spec().weight_prefix;
  for (size_t i = 0; i < fp8->layers().size(); ++i) {
    const LayerWeights& l = fp8->layers()[i];
    const std::string lp = p + "layers." + std::to_string(i) + ".";
    EXPECT_EQ(l.attn.q_proj.data, dequantized(lp + "self_attn.q_proj.weight")) << "layer " << i;
    EXPECT_EQ(l.attn.o_proj.data, dequantized(lp + "self_attn.o_proj.weight")) << "layer " << i;
    EXPECT_EQ(l.mlp.down_proj.data, dequantized(lp + "mlp.down_proj.weight")) << "layer " << i;
    EXPECT_EQ(l.input_layernorm.data, dense.at(lp + "input_layernorm.weight").data) << "layer " << i;
  }
  EXPECT_EQ(fp8->embed_tokens().data, dense.at(p + "embed_tokens.weight").data);
  // What E4M3 weights move the forward (for the record; the GPU FP8 path is measured in tests/ops/cuda/fp8_test.cpp).
  const auto orig = TargetModel::load(fixture.string());
  const std::vector<int32_t> ids = {1, 5, 9, 2, 7, 3, 11, 4};
  const ForwardOutput a = orig->forward(ids, {0, 8}, {}), b = fp8->forward(ids, {0, 8}, {});
  std::printf("[fp8 checkpoint] qwen3 fixture, E4M3 16x16 blocks: logits rel L2 vs the original %.3e\n",
              test::rel_l2(b.logits.data, a.logits.data));
}
