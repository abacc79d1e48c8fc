// write_drafter_checkpoint (src/models/drafter_checkpoint.h): BF16 round trip through the strict
// loader, config round trip, exact tensor names, atomicity / refusal cases.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include <unistd.h>

#include "io/safetensors.h"
#include "models/drafter.h"
#include "models/drafter_checkpoint.h"
#include "tensor/dtype.h"
#include "ops/optimizer.h"
#include "test_util.h"

using namespace dflash;
namespace fs = std::filesystem;

namespace {

std::string init_dir() { return (test::fixtures_dir() / "drafter" / "init").string(); }

std::set<std::string> entries(const fs::path& d) {
  std::set<std::string> r;
  for (const auto& e : fs::directory_iterator(d)) r.insert(e.path().filename().string());
  return r;
}

void expect_bf16_equal(const DrafterWeights<float>& got, const DrafterWeights<float>& orig) {
  const auto a = got.named();
  const auto b = orig.named();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].first, b[i].first);
    ASSERT_EQ(a[i].second->shape, b[i].second->shape) << a[i].first;
    size_t bad = 0;
    for (size_t j = 0; j < b[i].second->data.size(); ++j)
      if (a[i].second->data[j] != bf16_to_f32(f32_to_bf16(b[i].second->data[j]))) ++bad;
    EXPECT_EQ(bad, 0u) << a[i].first;
  }
}

}  // namespace

TEST(DrafterCheckpoint, RoundTripBf16) {
  DrafterConfig cfg;
  const DrafterWeights<float> w = load_drafter_weights<float>(init_dir(), &cfg);
  test::TempDir tmp;
  const fs::path out = tmp / "ckpt";
  write_drafter_checkpoint(out.string(), cfg, w);
  EXPECT_EQ(entries(out), (std::set<std::string>{"config.json", "model.safetensors"}));
  EXPECT_EQ(entries(tmp.path()), (std::set<std::string>{"ckpt"}));  // no temp dir left

  DrafterConfig cfg2;
  const DrafterWeights<float> back = load_drafter_weights<float>(out.string(), &cfg2);
  EXPECT_EQ(drafter_config_to_json(cfg2), drafter_config_to_json(cfg));
  expect_bf16_equal(back, w);

  // Names: exactly the doc's set (no "model." prefix), all BF16 with the expected shapes.
  const SafetensorsFile f((out / "model.safetensors").string());
  std::set<std::string> names, want;
  for (const TensorInfo& t : f.tensors()) {
    names.insert(t.name);
    EXPECT_EQ(t.dtype, DType::BF16) << t.name;
  }
  for (const auto& [name, shape] : drafter_param_shapes(cfg)) {
    want.insert(name);
    ASSERT_NE(f.find(name), nullptr) << name;
    EXPECT_EQ(f.find(name)->shape, shape) << name;
  }
  EXPECT_EQ(names, want);
  EXPECT_EQ(names.size(), size_t(2 * 11 + 3));
  EXPECT_TRUE(names.count("layers.0.self_attn.q_proj.weight"));
  EXPECT_TRUE(names.count("fc.weight"));
  EXPECT_TRUE(names.count("hidden_norm.weight"));
  EXPECT_TRUE(names.count("norm.weight"));
}

TEST(DrafterCheckpoint, ReplacesEarlierCheckpoint) {
  DrafterConfig cfg;
  DrafterWeights<float> w = load_drafter_weights<float>(init_dir(), &cfg);
  test::TempDir tmp;
  const fs::path out = tmp / "ckpt";
  write_drafter_checkpoint(out.string(), cfg, w);
  for (auto& [name, t] : w.named())
    for (float& x : t->data) x = 2.0f * x + 0.5f;
  write_drafter_checkpoint(out.string() + "/", cfg, w);  // trailing slash accepted
  EXPECT_EQ(entries(tmp.path()), (std::set<std::string>{"ckpt"}));
  expect_bf16_equal(load_drafter_weights<float>(out.string(), nullptr), w);
  // An empty existing directory is fine too.
  fs::create_directory(tmp / "empty");
  write_drafter_checkpoint((tmp / "empty").string(), cfg, w);
  EXPECT_EQ(entries(tmp / "empty"), (std::set<std::string>{"config.json", "model.safetensors"}));
}

TEST(DrafterCheckpoint, RefusesAndLeavesNothingBehind) {
  DrafterConfig cfg;
  const DrafterWeights<float> w = load_drafter_weights<float>(init_dir(), &cfg);
  test::TempDir tmp;
  // Parent missing.
  const fs::path missing = tmp / "no" / "such" / "ckpt";
  EXPECT_THROW(write_drafter_checkpoint(missing.string(), cfg, w), std::runtime_error);
  EXPECT_FALSE(fs::exists(tmp / "no"));
  EXPECT_TRUE(entries(tmp.path()).empty());
  // A directory that is not a checkpoint: refused, untouched.
  fs::create_directory(tmp / "data");
  test::write_file(tmp / "data" / "notes.txt", "keep me");
  EXPECT_THROW(write_drafter_checkpoint((tmp / "data").string(), cfg, w), std::runtime_error);
  EXPECT_EQ(entries(tmp / "data"), (std::set<std::string>{"notes.txt"}));
  // A regular file.
  test::write_file(tmp / "file", "x");
  EXPECT_THROW(write_drafter_checkpoint((tmp / "file").string(), cfg, w), std::runtime_error);
  // Wrong shapes: refused before anything is created.
  DrafterWeights<float> bad = w;
  bad.fc.shape = {1, int64_t(bad.fc.data.size())};
  EXPECT_THROW(write_drafter_checkpoint((tmp / "ckpt").string(), cfg, bad), std::runtime_error);
  EXPECT_EQ(entries(tmp.path()), (std::set<std::string>{"data", "file"}));
  // Failure while writing (config.json cannot be created: a directory is in the way is impossible
  // inside a fresh temp dir, so make the parent read-only instead) leaves no temp directory.
  fs::create_directory(tmp / "ro");
  fs::permissions(tmp / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  const bool can_write = ::access((tmp / "ro").c_str(), W_OK) == 0;  // root ignores permissions
  if (!can_write) {
    EXPECT_THROW(write_drafter_checkpoint((tmp / "ro" / "ckpt").string(), cfg, w), std::runtime_error);
    EXPECT_TRUE(entries(tmp / "ro").empty());
  }
  fs::permissions(tmp / "ro", fs::perms::owner_all);
}

// A checkpoint written here (after a few training steps, bf16, with a training state beside it)
// loaded by scripts/dflash_reference.py with the published loading path (config fields, names
// without "model.", shapes, strict) gives the logits our forward gives on the same bf16 weights.
// Needs python3 with torch + safetensors (the GPU machine has them; locally PYTHONPATH=/tmp/torchenv,
// see the script's header); skipped, saying so, without.
TEST(DrafterCheckpoint, PyTorchReferenceLoadsItWithTheSameLogits) {
  std::string out;
  if (test::run_command("python3 -c 'import torch, safetensors, numpy' 2>&1", &out) != 0)
    GTEST_SKIP() << "python3 cannot import torch + safetensors + numpy: PyTorch cross-check not run (" << out << ")";
  const fs::path fx = test::fixtures_dir() / "drafter";
  const std::string inputs = (fx / "inputs.safetensors").string();
  const SafetensorsFile in(inputs);
  DrafterConfig cfg;
  const auto w0 = load_drafter_weights<float>(init_dir(), &cfg);
  const Tensor taps = test::read_tensor<float>(in, "taps"), embed = test::read_tensor<float>(in, "embed_tokens"),
               lm_head = test::read_tensor<float>(in, "lm_head");
  DrafterSequence<float> seq;
  seq.taps = &taps;
  seq.embed = &embed;
  seq.lm_head = &lm_head;
  seq.ids = test::read_i64(in, "ids");
  seq.loss_mask = test::read_i64(in, "loss_mask");
  const std::vector<int64_t> anchors = test::read_i64(in, "anchors");
  seq.num_blocks = int64_t(anchors.size());
  for (int64_t a : anchors)
    if (a >= 0) seq.anchors.push_back(a);
  seq.gamma = 2.0;
  // Move the weights away from the fixture's (three AdamW steps on this sequence) before writing.
  DrafterWeights<float> w = w0;
  std::vector<NamedSpan<float>> p;
  for (auto& [n, t] : w.named()) p.push_back({n, t->data});
  AdamW<float> adam(p, AdamWOptions{.lr = 1e-2});
  for (int s = 0; s < 3; ++s) {
    const auto r = drafter_step(cfg, w, seq);
    std::vector<NamedSpan<const float>> g;
    for (const auto& [n, t] : r.grads.named()) g.push_back({n, t->data});
    adam.step(p, g);
  }
  test::TempDir td;
  const std::string ckpt = (td / "ckpt").string();
  write_drafter_checkpoint(ckpt, cfg, w, [](const std::string& path) {
    const Tensor extra({1});
    write_safetensors(path, {{"unrelated.state", &extra}});  // servers ignore the training state
  });
  const auto served = load_drafter_weights<float>(ckpt, nullptr);
  DrafterStepOptions opt;
  opt.backward = false;
  opt.keep_logits = true;
  const auto mine = drafter_step(cfg, served, seq, opt);

  const std::string logits_path = (td / "logits.safetensors").string();
  const std::string cmd = "python3 " + (test::source_dir() / "scripts" / "dflash_reference.py").string() +
                          " --load-logits " + ckpt + " --inputs " + inputs + " --logits-out " + logits_path +
                          " --dtype float32 2>&1";
  ASSERT_EQ(test::run_command(cmd, &out), 0) << out;
  const SafetensorsFile ref(logits_path);
  const std::vector<double> theirs = test::read_f64(ref, "logits");
  const double e = test::rel_l2(mine.logits.data, theirs);
  std::printf("[pytorch load] logits [%lld, %lld] rel L2 vs PyTorch float32: %.3e\n",
              (long long)seq.num_blocks * cfg.block_size, (long long)cfg.vocab_size, e);
  EXPECT_LE(e, test::kTolF32);
  // And the weights did move: the unmodified fixture gives other logits.
  const auto before = drafter_step(cfg, w0, seq, opt);
  EXPECT_GT(test::rel_l2(before.logits.data, theirs), 1e-3);
}

TEST(DrafterCheckpoint, ServingCommandsGiveEachServerItsTokenCount) {
  DrafterConfig c;
  c.block_size = 16;
  c.num_hidden_layers = 5;
  c.layer_types.assign(5, "full_attention");
  const std::string cmd = serving_commands("/models/Qwen3-8B", "/runs/a b/final", c);
  // SGLang: the block; vLLM: block_size - 1 drafted tokens (it never reads block_size).
  EXPECT_NE(cmd.find("python -m sglang.launch_server --model-path /models/Qwen3-8B --speculative-algorithm DFLASH "
                     "--speculative-draft-model-path '/runs/a b/final' --speculative-num-draft-tokens 16\n"),
            std::string::npos)
      << cmd;
  EXPECT_NE(cmd.find("vllm serve /models/Qwen3-8B --speculative-config "
                     "'{\"method\":\"dflash\",\"model\":\"/runs/a b/final\",\"num_speculative_tokens\":15}'\n"),
            std::string::npos)
      << cmd;
  EXPECT_EQ(cmd.find("VLLM_USE_V2_MODEL_RUNNER"), std::string::npos) << cmd;
  // Sliding and full layers mixed (the Qwen3.6 layout): vLLM needs its second runner.
  c.layer_types = {"sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"};
  EXPECT_NE(serving_commands("t", "d", c).find("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve t"), std::string::npos);
  c.block_size = 10;
  EXPECT_NE(serving_commands("t", "d", c).find("\"num_speculative_tokens\":9"), std::string::npos);
  EXPECT_NE(serving_commands("it's", "d", c).find("--model-path 'it'\\''s'"), std::string::npos);
}
