// PowerSampler's summary (medians, fractions, words) on given samples; the sampler on a stand-in NVML
// (tests/train/fake_nvml.cpp: its thread, units and reason bits), and where it finds no GPU (no NVML,
// or a bus id no GPU has): it samples nothing and says why. The GPU side runs in
// tests/train/cuda/gpu_power_test.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "train/gpu_power.h"

using namespace dflash;

TEST(GpuPower, SummaryTakesUpperMediansAndFractions) {
  const std::vector<PowerSample> s{{1400, 600, true, false, false}, {1980, 300, false, false, false},
                                   {1500, 690, true, true, true}, {1455, 650.4, true, false, false}};
  const PowerSummary p = summarize_power(s, 1980, 700);
  EXPECT_EQ(p.samples, 4);
  EXPECT_EQ(p.sm_clock_mhz, 1500);  // {1400, 1455, 1500, 1980}: the upper median
  EXPECT_EQ(p.power_w, 650);        // {300, 600, 650, 690}
  EXPECT_EQ(p.sm_clock_max_mhz, 1980);
  EXPECT_EQ(p.power_limit_w, 700);
  EXPECT_DOUBLE_EQ(p.power_capped, 0.75);
  EXPECT_DOUBLE_EQ(p.thermal, 0.25);
  EXPECT_DOUBLE_EQ(p.hw_slowdown, 0.25);
  EXPECT_EQ(p.words(), "650 of 700 W, SM clock 1500 of 1980 MHz; the power cap held the clock down in 75 % of 4 samples, "
                       "a thermal slowdown in 25 %, a hardware slowdown or power brake in 25 %");
  PowerTally t;
  t.add(s[0]);
  t.clear();
  EXPECT_EQ(t.summary(1980, 700).samples, 0);
}

TEST(GpuPower, NoSamplesOrUnknownLimits) {
  EXPECT_EQ(summarize_power({}, 1980, 700).samples, 0);
  EXPECT_EQ(summarize_power({{1980, 120}}, 1980, 700).words(),
            "120 of 700 W, SM clock 1980 of 1980 MHz; the power cap held the clock down in 0 % of 1 sample");
  EXPECT_EQ(summarize_power({{1200, 95}}, 0, 0).words(),
            "95 W, SM clock 1200 MHz; the power cap held the clock down in 0 % of 1 sample");
  EXPECT_EQ(summarize_power({{9000, 5000}}, 0, 0).sm_clock_mhz, 4095);  // past the bins: the last one
}

#ifdef DFLASH_FAKE_NVML
/// The stand-in NVML where the build put it, or beside this test binary (a build carried elsewhere).
std::string fake_nvml() {
  namespace fs = std::filesystem;
  if (fs::exists(DFLASH_FAKE_NVML)) return DFLASH_FAKE_NVML;
  return (fs::read_symlink("/proc/self/exe").parent_path() / fs::path(DFLASH_FAKE_NVML).filename()).string();
}

TEST(GpuPower, SamplerReadsNvmlInItsUnitsOnItsThread) {
  PowerSampler p({"0000:18:00.0", "0000:99:00.0"}, 1, fake_nvml());
  ASSERT_TRUE(p.available());
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  std::vector<PowerSummary> t;
  std::thread other([&] { t = p.take(); });  // take() from another thread, beside the sampler's
  other.join();
  ASSERT_EQ(t.size(), 2u);
  EXPECT_GE(t[0].samples, 5);
  EXPECT_EQ(t[0].sm_clock_mhz, 1470);
  EXPECT_EQ(t[0].sm_clock_max_mhz, 1980);
  EXPECT_EQ(t[0].power_w, 690);  // 690123 mW, in whole W
  EXPECT_EQ(t[0].power_limit_w, 700);
  EXPECT_EQ(t[0].power_capped, 1.0);
  EXPECT_EQ(t[0].hw_slowdown, 1.0);
  EXPECT_EQ(t[0].thermal, 0.0);
  EXPECT_EQ(t[1].samples, 0);
  EXPECT_EQ(t[1].words(), "not sampled (NVML does not know the GPU at PCI bus id '0000:99:00.0')");
}
#endif

TEST(GpuPower, SamplerWithoutTheGpuSamplesNothing) {
  PowerSampler none({});
  EXPECT_FALSE(none.available());
  EXPECT_TRUE(none.take().empty());
  PowerSampler missing({"0000:ff:1f.7"}, 1);  // no such GPU (nor NVML, on a CPU machine)
  EXPECT_FALSE(missing.available());
  const auto t = missing.take();
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].samples, 0);
  EXPECT_FALSE(t[0].missing.empty());
  PowerSampler no_lib({"0000:18:00.0"}, 1, "libdflash-no-such-nvml.so");
  EXPECT_FALSE(no_lib.available());
  EXPECT_EQ(no_lib.take()[0].words(), "not sampled (NVML (libdflash-no-such-nvml.so) not loaded)");
}
