// The GPU run's memory plan (src/train/memory_plan.h), on the CPU: what it predicts for the 27B
// pipeline preset against the peak the H200 measured, and the refusal's advice.
#include <gtest/gtest.h>

#include "bench/presets.h"
#include "train/memory_plan.h"

using namespace dflash;

namespace {
MemoryPlan plan_27b() {
  const PipelineBenchPreset p = pipeline_bench_preset("qwen3.6-27b");
  return plan_memory(p.drafter.cfg, p.target, p.drafter.S, 512, false, 8192);
}
}  // namespace

TEST(MemoryPlan, The27bPipelineNeedsAboutWhatTheGpuMeasured) {
  const MemoryPlan m = plan_27b();
  // `dflash bench pipeline --preset qwen3.6-27b` peaked at 99.8 GB on an H200 (bench/results/pipeline.md);
  // the plan estimates from the shapes (the hybrid target as if dense) and must not be far off.
  EXPECT_GT(m.total(), 0.8 * 99.8e9);
  EXPECT_LT(m.total(), 1.3 * 99.8e9);
  EXPECT_GT(m.target, 45e9);         // ~25 B bf16 weights (the hybrid counted as dense) and more
  EXPECT_GT(m.drafter_state, 30e9);  // 1.73 B parameters x 18 bytes, embed and lm_head
  EXPECT_DOUBLE_EQ(m.on_gpu(true, true), m.total());
  EXPECT_DOUBLE_EQ(m.on_gpu(true, false), m.target);
  EXPECT_DOUBLE_EQ(m.on_gpu(false, true), m.total() - m.target);
  // Recomputation keeps fewer activations.
  const PipelineBenchPreset p = pipeline_bench_preset("qwen3.6-27b");
  EXPECT_LT(plan_memory(p.drafter.cfg, p.target, p.drafter.S, 512, true, 8192).activations, m.activations);
}

TEST(MemoryPlan, RefusalNamesTheKnobThatHelps) {
  const MemoryPlan m = plan_27b();
  auto refuse = [](const MemoryPlan& p, bool t, bool d, int gpu, double free_b) {
    return memory_refusal(p, t, d, gpu, free_b, "lower --num-anchors or --max-length");
  };
  const double h100 = 79e9, h200 = 140e9;
  EXPECT_EQ(refuse(m, true, true, 0, h200), "");  // colocated on an H200
  EXPECT_EQ(refuse(m, true, true, 0, 0), "");     // free memory unknown: no refusal
  // Colocated on an 80 GB GPU: the target and the drafter's state alone do not fit; only two GPUs help.
  const std::string both = refuse(m, true, true, 0, h100);
  EXPECT_NE(both.find("on cuda:0 but 79.0 GB are free"), std::string::npos) << both;
  EXPECT_NE(both.find("--target-gpus 0 --drafter-gpus 1"), std::string::npos) << both;
  EXPECT_EQ(both.find("--num-anchors"), std::string::npos) << both;
  // Disaggregated, each side fits one 80 GB GPU.
  EXPECT_EQ(refuse(m, true, false, 0, h100), "");
  EXPECT_EQ(refuse(m, false, true, 1, h100), "");
  // A drafter GPU short of room for the activations: fewer anchors help.
  const double some = (m.drafter_state + m.cross_entropy + 0.5 * m.activations) / 0.95;
  const std::string drafter = refuse(m, false, true, 1, some);
  EXPECT_NE(drafter.find("on cuda:1"), std::string::npos) << drafter;
  EXPECT_NE(drafter.find("lower --num-anchors or --max-length (the activations scale with them)"), std::string::npos)
      << drafter;
  EXPECT_EQ(drafter.find("--target-gpus"), std::string::npos) << drafter;
  // A target GPU too small for the weights.
  EXPECT_NE(refuse(m, true, false, 0, 20e9).find("the target does not fit"), std::string::npos);
}
