// PowerSampler's summary (medians, fractions, words) on given samples, and the sampler itself where it
// finds no GPU (no NVML, or a bus id no GPU has): it samples nothing and says so. The GPU side runs
// in tests/cuda/gpu_power_test.cpp.
#include <gtest/gtest.h>

#include "train/gpu_power.h"

using namespace dflash;

TEST(GpuPower, SummaryTakesUpperMediansAndFractions) {
  const std::vector<PowerSample> s{{1400, 600, true, false}, {1980, 300, false, false}, {1500, 690, true, true},
                                   {1455, 650, true, false}};
  const PowerSummary p = summarize_power(s, 1980, 700);
  EXPECT_EQ(p.samples, 4);
  EXPECT_EQ(p.sm_clock_mhz, 1500);  // {1400, 1455, 1500, 1980}: the upper median
  EXPECT_EQ(p.power_w, 650);        // {300, 600, 650, 690}
  EXPECT_EQ(p.sm_clock_max_mhz, 1980);
  EXPECT_EQ(p.power_limit_w, 700);
  EXPECT_DOUBLE_EQ(p.power_capped, 0.75);
  EXPECT_DOUBLE_EQ(p.thermal, 0.25);
  EXPECT_EQ(p.words(), "650 of 700 W, SM clock 1500 of 1980 MHz, power-capped 75 % of the time, thermal slowdown 25 %");
}

TEST(GpuPower, NoSamplesSaySo) {
  const PowerSummary p = summarize_power({}, 1980, 700);
  EXPECT_EQ(p.samples, 0);
  EXPECT_EQ(p.words(), "not sampled (no NVML)");
  EXPECT_EQ(summarize_power({{1980, 120, false, false}}, 1980, 700).words(),
            "120 of 700 W, SM clock 1980 of 1980 MHz, power-capped 0 % of the time");
}

TEST(GpuPower, SamplerWithoutTheGpuSamplesNothing) {
  PowerSampler none({});
  EXPECT_FALSE(none.available());
  EXPECT_TRUE(none.take().empty());
  PowerSampler missing({"0000:ff:1f.7"}, 1);  // no such GPU (nor NVML, on a CPU machine)
  EXPECT_FALSE(missing.available());
  const auto t = missing.take();
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].samples, 0);
}
