// What holds a GPU's clock down while it works: its SM clock, board power and the driver's clock-event
// reasons (power cap, thermal, hardware slowdown), sampled through NVML on a background thread. An H200
// running bf16 GEMMs sits at its power limit (700 W) with the SM clock near 1,470-1,620 of 1,980 MHz:
// the benchmarks record it beside their speed, and training prints it after its stage report. NVML is
// the driver's libnvidia-ml.so.1, loaded at run time: without it (no driver, a CPU machine) nothing is
// sampled.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dflash {

/// One reading of one GPU.
struct PowerSample {
  double sm_mhz = 0;          // SM clock, MHz
  double watts = 0;           // board power draw, W (Ampere and newer except GA100: the driver's 1-s average)
  bool power_capped = false;  // clock-event reason: the software power cap holds the clock down
  bool thermal = false;       // clock-event reason: a software or hardware thermal slowdown
  bool hw_slowdown = false;   // clock-event reason: a hardware slowdown or power brake (the board's supply)
};

/// A stretch of readings of one GPU, summarized. samples == 0: nothing was sampled (`missing` says why).
struct PowerSummary {
  int64_t samples = 0;
  double sm_clock_mhz = 0;      // median SM clock (upper median, whole MHz)
  double sm_clock_max_mhz = 0;  // the GPU's maximum SM clock (0: NVML did not say)
  double power_w = 0;           // median power draw (upper median, whole W; 1-s averages)
  double power_limit_w = 0;     // enforced power limit (0: NVML did not say)
  double power_capped = 0;      // fraction of the samples with the power cap holding the clock down
  double thermal = 0;           // fraction with a thermal slowdown
  double hw_slowdown = 0;       // fraction with a hardware slowdown or power brake
  std::string missing;          // why nothing was sampled ("" when samples > 0)
  /// "690 of 700 W, SM clock 1470 of 1980 MHz; the power cap held the clock down in 100 % of 112
  /// samples" (+ thermal / hardware slowdowns when seen); "not sampled (<missing>)" when samples == 0.
  /// The power is a 1-s average, the clock and the reasons are instants: a bursty load shows the
  /// cap's flag at a mean power well below the limit.
  std::string words() const;
};

/// Running totals of one GPU's samples in fixed memory (clock and power in 1 MHz / 1 W bins, so the
/// medians are exact to the unit): what the sampler thread adds to without allocating.
class PowerTally {
 public:
  void add(const PowerSample& s);
  /// The summary with the GPU's limits (0 = unknown).
  PowerSummary summary(double sm_clock_max_mhz, double power_limit_w) const;
  void clear() { *this = PowerTally{}; }

 private:
  static constexpr int kMaxMhz = 4096, kMaxWatts = 2048;  // larger readings count in the last bin
  std::array<int64_t, kMaxMhz> mhz_{};
  std::array<int64_t, kMaxWatts> watts_{};
  int64_t n_ = 0, capped_ = 0, thermal_ = 0, hw_ = 0;
};

/// The summary of `s` (PowerTally's) with the GPU's limits.
PowerSummary summarize_power(const std::vector<PowerSample>& s, double sm_clock_max_mhz, double power_limit_w);

/// Samples GPUs every period_ms (>= 1) on one background thread from construction to destruction. GPUs
/// are named by PCI bus id ("0000:18:00.0", cuda::DeviceInfo::pci_bus_id). A GPU NVML does not find,
/// or every GPU when `library` cannot be loaded, is not sampled: its summaries say samples 0 and why.
/// Never throws. take() may be called from any thread. (The destructor joins the thread: an NVML call
/// that hangs on a GPU fallen off the bus would hang it too.)
class PowerSampler {
 public:
  explicit PowerSampler(const std::vector<std::string>& pci_bus_ids, int period_ms = 20,
                        const std::string& library = "libnvidia-ml.so.1");
  ~PowerSampler();
  PowerSampler(const PowerSampler&) = delete;
  PowerSampler& operator=(const PowerSampler&) = delete;
  /// Whether NVML loaded, found at least one of the GPUs, and the thread runs.
  bool available() const;
  /// Per GPU (in the constructor's order), the samples since construction or the last take(),
  /// summarized; they are then dropped.
  std::vector<PowerSummary> take();

 private:
  struct Nvml;
  std::unique_ptr<Nvml> nvml_;
  std::vector<void*> handles_;             // nvmlDevice_t per GPU; null: not found
  std::vector<double> max_mhz_, limit_w_;  // per GPU, 0 = unknown
  std::vector<std::string> missing_;       // per GPU: why it is not sampled
  std::mutex mu_;
  std::vector<PowerTally> tallies_;  // per GPU, guarded by mu_
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace dflash
