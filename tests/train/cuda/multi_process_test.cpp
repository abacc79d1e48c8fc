// `dflash train` as two processes (the DFLASH_RANK / DFLASH_WORLD_SIZE environment, as mpirun's
// OMPI_COMM_WORLD_* would give): one GPU each, against one process driving both GPUs. Needs two
// CUDA devices and python3 (scripts/make_synthetic_data.py); skipped, saying so, otherwise.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <filesystem>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "gpu/runtime.h"
#include "test_util.h"

using namespace dflash;
namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::vector<double> losses(const fs::path& out) {
  std::vector<double> r;
  std::ifstream f(out / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) r.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return r;
}

}  // namespace

TEST(CudaMultiProcess, TwoProcessesTrainLikeOneProcessOnTwoGpus) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "needs 2 CUDA devices (found " << n << "): skipped";
  test::TempDir tmp;
  std::string log;
  if (test::run_command("python3 " + (test::source_dir() / "scripts" / "make_synthetic_data.py").string() + " " +
                            (tmp.path() / "data").string(),
                        &log) != 0)
    GTEST_SKIP() << "python3 cannot write the synthetic data: skipped (" << log << ")";
  // One target forward per sample (--target-batch-tokens 1): every placement computes the same taps.
  auto args = [&](const fs::path& out, const std::string& gpus) {
    return " train --target " + (test::source_dir() / "tests" / "fixtures" / "qwen3_hd64").string() + " --data " +
           (tmp.path() / "data").string() + " --out " + out.string() + " --device cuda --gpus " + gpus +
           " --mask-token-id 300 --num-taps 1 --num-draft-layers 2 --block-size 4 --num-anchors 8 --max-steps 8 "
           "--grad-accum 4 --lr 3e-3 --log-every 1 --save-every 4 --target-batch-tokens 1";
  };
  // GEMM algorithms by cuBLASLt's heuristic: separate processes may tune to different choices (GemmTune).
  const std::string bin = "DFLASH_GEMM_TUNE=0 " + test::dflash_binary().string();
  ASSERT_EQ(test::run_command(bin + args(tmp.path() / "one", "0,1"), &log), 0) << log;
  const fs::path two = tmp.path() / "two";
  const std::string env = "DFLASH_WORLD_SIZE=2 DFLASH_MASTER_PORT=29611 ";
  const std::string cmd = "sh -c '" + env + "DFLASH_RANK=0 DFLASH_LOCAL_RANK=0 " + bin + args(two, "0") + " > " +
                          (tmp.path() / "r0.log").string() + " 2>&1 & " + env + "DFLASH_RANK=1 DFLASH_LOCAL_RANK=1 " +
                          bin + args(two, "0") + " > " + (tmp.path() / "r1.log").string() +
                          " 2>&1; r1=$?; wait $!; r0=$?; exit $((r0 + r1))'";
  const int rc = test::run_command(cmd, &log);
  const std::string r0 = slurp(tmp.path() / "r0.log"), r1 = slurp(tmp.path() / "r1.log");
  ASSERT_EQ(rc, 0) << "rank 0:\n" << r0 << "\nrank 1:\n" << r1;
  EXPECT_NE(r1.find("process 1 of 2"), std::string::npos) << r1;
  EXPECT_NE(r1.find("GPUs [1]"), std::string::npos) << r1;  // the second process of the node takes GPU 1
  EXPECT_EQ(r1.find("step 1/8"), std::string::npos) << "only rank 0 reports progress:\n" << r1;
  EXPECT_TRUE(fs::exists(two / "final" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(two / "checkpoints" / "step-00000004"));
  // The same micro-batches on the same replicas and the same two-rank sum: the same training.
  const auto a = losses(tmp.path() / "one"), b = losses(two);
  ASSERT_EQ(a.size(), 8u);
  EXPECT_EQ(a, b);
  EXPECT_EQ(slurp(tmp.path() / "one" / "final" / "model.safetensors"),
            slurp(two / "final" / "model.safetensors"));
  std::printf("[multi process] losses one process on 2 GPUs %.6f .. %.6f | two processes %.6f .. %.6f\n", a.front(),
              a.back(), b.front(), b.back());
}

#endif  // DFLASH_HAVE_CUDA
