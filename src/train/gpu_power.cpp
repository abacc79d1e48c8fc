#include "train/gpu_power.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <type_traits>

#include <fmt/format.h>

namespace dflash {

std::string PowerSummary::words() const {
  if (samples == 0) return "not sampled (no NVML)";
  std::string s = fmt::format("{:.0f} of {:.0f} W, SM clock {:.0f} of {:.0f} MHz, power-capped {:.0f} % of the time",
                              power_w, power_limit_w, sm_clock_mhz, sm_clock_max_mhz, 100 * power_capped);
  if (thermal > 0) s += fmt::format(", thermal slowdown {:.0f} %", 100 * thermal);
  return s;
}

PowerSummary summarize_power(const std::vector<PowerSample>& s, double sm_clock_max_mhz, double power_limit_w) {
  PowerSummary r;
  r.sm_clock_max_mhz = sm_clock_max_mhz, r.power_limit_w = power_limit_w;
  r.samples = int(s.size());
  if (s.empty()) return r;
  std::vector<double> mhz, w;
  int capped = 0, hot = 0;
  for (const PowerSample& x : s) {
    mhz.push_back(x.sm_mhz), w.push_back(x.watts);
    capped += x.power_capped, hot += x.thermal;
  }
  auto upper_median = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  r.sm_clock_mhz = upper_median(mhz), r.power_w = upper_median(w);
  r.power_capped = double(capped) / double(s.size()), r.thermal = double(hot) / double(s.size());
  return r;
}

// The NVML entry points used, by their C signatures in nvml.h (nvmlDevice_t is an opaque pointer,
// nvmlReturn_t an int, 0 = NVML_SUCCESS).
struct PowerSampler::Nvml {
  void* lib = nullptr;
  int (*init)() = nullptr;
  int (*shutdown)() = nullptr;
  int (*by_bus_id)(const char*, void**) = nullptr;
  int (*clock)(void*, int, unsigned*) = nullptr;      // nvmlDeviceGetClockInfo
  int (*max_clock)(void*, int, unsigned*) = nullptr;  // nvmlDeviceGetMaxClockInfo
  int (*power)(void*, unsigned*) = nullptr;           // nvmlDeviceGetPowerUsage, mW
  int (*limit)(void*, unsigned*) = nullptr;           // nvmlDeviceGetEnforcedPowerLimit, mW
  int (*reasons)(void*, unsigned long long*) = nullptr;  // nvmlDeviceGetCurrentClocksEventReasons
  static constexpr int kClockSm = 1;                      // NVML_CLOCK_SM
  static constexpr unsigned long long kPowerCap = 0x4;    // nvmlClocksEventReasonSwPowerCap
  static constexpr unsigned long long kThermal = 0x20 | 0x40;  // Sw / HwThermalSlowdown

  bool load() {
    lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return false;
    auto sym = [&](auto& f, const char* name) { f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, name)); };
    sym(init, "nvmlInit_v2"), sym(shutdown, "nvmlShutdown"), sym(by_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    sym(clock, "nvmlDeviceGetClockInfo"), sym(max_clock, "nvmlDeviceGetMaxClockInfo");
    sym(power, "nvmlDeviceGetPowerUsage"), sym(limit, "nvmlDeviceGetEnforcedPowerLimit");
    sym(reasons, "nvmlDeviceGetCurrentClocksEventReasons");
    if (!reasons) sym(reasons, "nvmlDeviceGetCurrentClocksThrottleReasons");  // drivers before 535
    if (!init || !shutdown || !by_bus_id || !clock || !max_clock || !power || !limit || !reasons || init() != 0) {
      dlclose(lib);
      lib = nullptr;
      return false;
    }
    return true;
  }
  ~Nvml() {
    if (lib) shutdown(), dlclose(lib);
  }
};

PowerSampler::PowerSampler(const std::vector<std::string>& pci_bus_ids, int period_ms)
    : nvml_(std::make_unique<Nvml>()),
      handles_(pci_bus_ids.size(), nullptr),
      max_mhz_(pci_bus_ids.size(), 0),
      limit_w_(pci_bus_ids.size(), 0),
      samples_(pci_bus_ids.size()) {
  if (pci_bus_ids.empty() || !nvml_->load()) return;
  for (size_t i = 0; i < pci_bus_ids.size(); ++i) {
    void* h = nullptr;
    unsigned mhz = 0, mw = 0;
    if (pci_bus_ids[i].empty() || nvml_->by_bus_id(pci_bus_ids[i].c_str(), &h) != 0) continue;
    if (nvml_->max_clock(h, Nvml::kClockSm, &mhz) != 0 || nvml_->limit(h, &mw) != 0) continue;
    handles_[i] = h, max_mhz_[i] = mhz, limit_w_[i] = mw / 1e3;
  }
  if (!available()) return;
  thread_ = std::thread([this, period_ms] {
    while (!stop_.load()) {
      for (size_t i = 0; i < handles_.size(); ++i) {
        if (!handles_[i]) continue;
        unsigned mhz = 0, mw = 0;
        unsigned long long why = 0;
        if (nvml_->clock(handles_[i], Nvml::kClockSm, &mhz) != 0 || nvml_->power(handles_[i], &mw) != 0 ||
            nvml_->reasons(handles_[i], &why) != 0)
          continue;
        const std::lock_guard<std::mutex> lock(mu_);
        samples_[i].push_back({double(mhz), mw / 1e3, (why & Nvml::kPowerCap) != 0, (why & Nvml::kThermal) != 0});
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(period_ms));
    }
  });
}

PowerSampler::~PowerSampler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

bool PowerSampler::available() const {
  return std::any_of(handles_.begin(), handles_.end(), [](void* h) { return h != nullptr; });
}

std::vector<PowerSummary> PowerSampler::take() {
  std::vector<std::vector<PowerSample>> s(samples_.size());
  {
    const std::lock_guard<std::mutex> lock(mu_);
    s.swap(samples_);
  }
  std::vector<PowerSummary> r;
  for (size_t i = 0; i < s.size(); ++i) r.push_back(summarize_power(s[i], max_mhz_[i], limit_w_[i]));
  return r;
}

}  // namespace dflash
