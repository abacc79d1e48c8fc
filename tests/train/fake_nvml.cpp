// A stand-in for the driver's libnvidia-ml.so.1 (the entry points PowerSampler loads, with NVML's C
// signatures): one GPU at PCI bus id 0000:18:00.0 at 1470 of 1980 MHz, drawing 690.123 of 700 W, its
// clock held down by the power cap and a power brake. Lets the CPU tests run the sampler's thread and
// check its units (mW) and reason bits.
#include <cstring>

extern "C" {
int nvmlInit_v2() { return 0; }
int nvmlShutdown() { return 0; }
int nvmlDeviceGetHandleByPciBusId_v2(const char* id, void** device) {
  static int gpu;
  if (std::strcmp(id, "0000:18:00.0") != 0) return 6;  // NVML_ERROR_NOT_FOUND
  *device = &gpu;
  return 0;
}
int nvmlDeviceGetClockInfo(void*, int type, unsigned* mhz) {
  if (type != 1) return 2;  // NVML_ERROR_INVALID_ARGUMENT: only NVML_CLOCK_SM is asked for
  *mhz = 1470;
  return 0;
}
int nvmlDeviceGetMaxClockInfo(void*, int type, unsigned* mhz) {
  if (type != 1) return 2;
  *mhz = 1980;
  return 0;
}
int nvmlDeviceGetPowerUsage(void*, unsigned* mw) {
  *mw = 690123;
  return 0;
}
int nvmlDeviceGetEnforcedPowerLimit(void*, unsigned* mw) {
  *mw = 700000;
  return 0;
}
int nvmlDeviceGetCurrentClocksEventReasons(void*, unsigned long long* reasons) {
  *reasons = 0x4 | 0x80;  // SwPowerCap | HwPowerBrakeSlowdown
  return 0;
}
}
