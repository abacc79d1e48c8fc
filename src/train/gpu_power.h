// What holds a GPU's clock down while it works: its SM clock, board power and the driver's clock-event
// reasons (power cap, thermal), sampled through NVML on a background thread. An H200 running bf16
// GEMMs sits at its power limit (700 W) with the SM clock near 1,500 of 1,980 MHz: the benchmarks
// record it beside their speed, and training names it in its stage report. NVML is the driver's
// libnvidia-ml.so.1, loaded at run time: without it (no driver, a CPU machine) nothing is sampled.
#pragma once
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
  double watts = 0;           // board power draw, W (Ampere and newer: the driver's average over 1 s)
  bool power_capped = false;  // clock-event reason: the software power cap holds the clock down
  bool thermal = false;       // clock-event reason: a software or hardware thermal slowdown
};

/// A stretch of readings of one GPU, summarized. samples == 0: nothing was sampled (NVML missing).
struct PowerSummary {
  int samples = 0;
  double sm_clock_mhz = 0;      // median SM clock
  double sm_clock_max_mhz = 0;  // the GPU's maximum SM clock
  double power_w = 0;           // median power draw (1-s averages: runs shorter than ~1 s read low)
  double power_limit_w = 0;     // enforced power limit
  double power_capped = 0;      // fraction of the samples with the power cap holding the clock down
  double thermal = 0;           // fraction with a thermal slowdown
  /// "690 of 700 W, SM clock 1500 of 1980 MHz, power-capped 96 % of the time" (+ thermal when seen);
  /// "not sampled (no NVML)" when samples == 0.
  std::string words() const;
};

/// The summary of `s` (medians: the upper median; fractions of all samples) with the GPU's limits.
PowerSummary summarize_power(const std::vector<PowerSample>& s, double sm_clock_max_mhz, double power_limit_w);

/// Samples GPUs every period_ms on one background thread from construction to destruction. GPUs are
/// named by PCI bus id ("0000:18:00.0", cuda::DeviceInfo::pci_bus_id). A GPU NVML does not find, or
/// every GPU when libnvidia-ml.so.1 cannot be loaded, is not sampled: its summaries say samples 0.
/// Never throws on a missing or failing NVML. take() may be called from any thread.
class PowerSampler {
 public:
  PowerSampler(const std::vector<std::string>& pci_bus_ids, int period_ms = 20);
  ~PowerSampler();
  PowerSampler(const PowerSampler&) = delete;
  PowerSampler& operator=(const PowerSampler&) = delete;
  /// Whether NVML loaded and found at least one of the GPUs.
  bool available() const;
  /// Per GPU (in the constructor's order), the samples since construction or the last take(),
  /// summarized; they are then dropped.
  std::vector<PowerSummary> take();

 private:
  struct Nvml;
  std::unique_ptr<Nvml> nvml_;
  std::vector<void*> handles_;             // nvmlDevice_t per GPU; null: not found
  std::vector<double> max_mhz_, limit_w_;  // per GPU
  std::mutex mu_;
  std::vector<std::vector<PowerSample>> samples_;  // per GPU, guarded by mu_
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace dflash
