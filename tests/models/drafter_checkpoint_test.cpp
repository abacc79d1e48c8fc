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
