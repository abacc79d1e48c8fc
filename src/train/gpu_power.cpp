#include "train/gpu_power.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <system_error>
#include <type_traits>

#include <fmt/format.h>

namespace dflash {

std::string PowerSummary::words() const {
  if (samples == 0) return "not sampled (" + missing + ")";
  auto of = [](double v, double max, const char* unit) {
    return max > 0 ? fmt::format("{:.0f} of {:.0f} {}", v, max, unit) : fmt::format("{:.0f} {}", v, unit);
  };
  std::string s = fmt::format("{}, SM clock {}; the power cap held the clock down in {:.0f} % of {} sample{}",
                              of(power_w, power_limit_w, "W"), of(sm_clock_mhz, sm_clock_max_mhz, "MHz"),
                              100 * power_capped, samples, samples == 1 ? "" : "s");
  if (thermal > 0) s += fmt::format(", a thermal slowdown in {:.0f} %", 100 * thermal);
  if (hw_slowdown > 0) s += fmt::format(", a hardware slowdown or power brake in {:.0f} %", 100 * hw_slowdown);
  return s;
}

void PowerTally::add(const PowerSample& s) {
  auto bin = [](double v, int n) { return size_t(std::clamp(std::lround(v), 0L, long(n - 1))); };
  ++mhz_[bin(s.sm_mhz, kMaxMhz)], ++watts_[bin(s.watts, kMaxWatts)];
  ++n_, capped_ += s.power_capped, thermal_ += s.thermal, hw_ += s.hw_slowdown;
}

PowerSummary PowerTally::summary(double sm_clock_max_mhz, double power_limit_w) const {
  PowerSummary r;
  r.sm_clock_max_mhz = sm_clock_max_mhz, r.power_limit_w = power_limit_w, r.samples = n_;
  if (n_ == 0) return r;
  auto upper_median = [&](const auto& bins) {  // the value at sorted index n / 2
    int64_t seen = 0;
    for (size_t v = 0; v < bins.size(); ++v)
      if ((seen += bins[v]) > n_ / 2) return double(v);
    return double(bins.size() - 1);
  };
  r.sm_clock_mhz = upper_median(mhz_), r.power_w = upper_median(watts_);
  r.power_capped = double(capped_) / double(n_), r.thermal = double(thermal_) / double(n_);
  r.hw_slowdown = double(hw_) / double(n_);
  return r;
}

PowerSummary summarize_power(const std::vector<PowerSample>& s, double sm_clock_max_mhz, double power_limit_w) {
  PowerTally t;
  for (const PowerSample& x : s) t.add(x);
  return t.summary(sm_clock_max_mhz, power_limit_w);
}

// The NVML entry points used, by their C signatures in nvml.h (nvmlDevice_t is an opaque pointer,
// nvmlReturn_t an int, 0 = NVML_SUCCESS).
struct PowerSampler::Nvml {
  void* lib = nullptr;
  int (*init)() = nullptr;
  int (*shutdown)() = nullptr;
  int (*by_bus_id)(const char*, void**) = nullptr;
  int (*clock)(void*, int, unsigned*) = nullptr;         // nvmlDeviceGetClockInfo
  int (*max_clock)(void*, int, unsigned*) = nullptr;     // nvmlDeviceGetMaxClockInfo
  int (*power)(void*, unsigned*) = nullptr;              // nvmlDeviceGetPowerUsage, mW
  int (*limit)(void*, unsigned*) = nullptr;              // nvmlDeviceGetEnforcedPowerLimit, mW
  int (*reasons)(void*, unsigned long long*) = nullptr;  // nvmlDeviceGetCurrentClocksEventReasons
  static constexpr int kClockSm = 1;                     // NVML_CLOCK_SM
  static constexpr unsigned long long kPowerCap = 0x4;   // nvmlClocksEventReasonSwPowerCap
  static constexpr unsigned long long kThermal = 0x20 | 0x40;  // Sw / HwThermalSlowdown
  static constexpr unsigned long long kHw = 0x8 | 0x80;        // HwSlowdown, HwPowerBrakeSlowdown

  /// "" when loaded and initialized, else why not.
  std::string load(const std::string& library) {
    lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) return "NVML (" + library + ") not loaded";
    auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, name));
    };
    sym(init, "nvmlInit_v2"), sym(shutdown, "nvmlShutdown"), sym(by_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    sym(clock, "nvmlDeviceGetClockInfo"), sym(max_clock, "nvmlDeviceGetMaxClockInfo");
    sym(power, "nvmlDeviceGetPowerUsage"), sym(limit, "nvmlDeviceGetEnforcedPowerLimit");
    sym(reasons, "nvmlDeviceGetCurrentClocksEventReasons");
    if (!reasons) sym(reasons, "nvmlDeviceGetCurrentClocksThrottleReasons");  // drivers before 535
    std::string why;
    if (!init || !shutdown || !by_bus_id || !clock || !max_clock || !power || !limit || !reasons)
      why = "NVML (" + library + ") lacks an entry point";
    else if (init() != 0)
      why = "NVML did not initialize";
    if (!why.empty()) dlclose(lib), lib = nullptr;
    return why;
  }
  ~Nvml() {
    if (lib) shutdown(), dlclose(lib);
  }
};

PowerSampler::PowerSampler(const std::vector<std::string>& pci_bus_ids, int period_ms, const std::string& library)
    : nvml_(std::make_unique<Nvml>()),
      handles_(pci_bus_ids.size(), nullptr),
      max_mhz_(pci_bus_ids.size(), 0),
      limit_w_(pci_bus_ids.size(), 0),
      missing_(pci_bus_ids.size()),
      tallies_(pci_bus_ids.size()) {
  if (pci_bus_ids.empty()) return;
  const std::string why = nvml_->load(library);
  for (size_t i = 0; i < pci_bus_ids.size(); ++i) {
    void* h = nullptr;
    if (!why.empty()) {
      missing_[i] = why;
    } else if (pci_bus_ids[i].empty() || nvml_->by_bus_id(pci_bus_ids[i].c_str(), &h) != 0) {
      missing_[i] = "NVML does not know the GPU at PCI bus id '" + pci_bus_ids[i] + "'";
    } else {
      unsigned mhz = 0, mw = 0;  // the limits where NVML gives them (0: unknown)
      handles_[i] = h;
      if (nvml_->max_clock(h, Nvml::kClockSm, &mhz) == 0) max_mhz_[i] = mhz;
      if (nvml_->limit(h, &mw) == 0) limit_w_[i] = mw / 1e3;
      missing_[i] = "the NVML queries failed";  // until a sample arrives
    }
  }
  if (!available()) return;
  const auto period = std::chrono::milliseconds(std::max(1, period_ms));
  try {
    thread_ = std::thread([this, period] {
      try {  // (an exception here would end the process: sampling stops instead)
        while (!stop_.load()) {
          for (size_t i = 0; i < handles_.size(); ++i) {
            unsigned mhz = 0, mw = 0;
            unsigned long long why = 0;
            if (!handles_[i] || nvml_->clock(handles_[i], Nvml::kClockSm, &mhz) != 0 ||
                nvml_->power(handles_[i], &mw) != 0 || nvml_->reasons(handles_[i], &why) != 0)
              continue;
            const PowerSample s{double(mhz), mw / 1e3, (why & Nvml::kPowerCap) != 0, (why & Nvml::kThermal) != 0,
                                (why & Nvml::kHw) != 0};
            const std::lock_guard<std::mutex> lock(mu_);  // (PowerTally::add allocates nothing)
            tallies_[i].add(s);
          }
          std::this_thread::sleep_for(period);
        }
      } catch (...) {
      }
    });
  } catch (const std::system_error& e) {  // no thread: nothing is sampled
    std::fill(handles_.begin(), handles_.end(), nullptr);
    std::fill(missing_.begin(), missing_.end(), std::string("no sampling thread: ") + e.what());
  }
}

PowerSampler::~PowerSampler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

bool PowerSampler::available() const {
  return std::any_of(handles_.begin(), handles_.end(), [](void* h) { return h != nullptr; });
}

std::vector<PowerSummary> PowerSampler::take() {
  std::vector<PowerSummary> r;
  const std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < handles_.size(); ++i) {
    r.push_back(tallies_[i].summary(max_mhz_[i], limit_w_[i]));
    if (r.back().samples == 0) r.back().missing = missing_[i];
    tallies_[i].clear();
  }
  return r;
}

}  // namespace dflash
