// GPUs visible to the CUDA runtime. CUDA-free: CPU-side code calls it too; a CPU-only build answers
// from src/gpu/no_cuda.cpp (no devices; require_device refuses).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dflash::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int sm = 0;                  // compute capability major*10 + minor, e.g. 90 for H100/H200
  int64_t total_memory = 0;    // bytes
  std::string pci_bus_id;      // "0000:18:00.0" (cudaDeviceGetPCIBusId): how NVML names the same GPU
};

/// Visible devices; empty when no driver or GPU is present (never throws).
std::vector<DeviceInfo> devices();
/// Throws std::runtime_error "<what>: no usable CUDA device (<reason>)" unless device `index` is usable.
void require_device(const std::string& what, int index = 0);
/// Bytes in use on the current device (total - free, cudaMemGetInfo); -1 when that fails (never throws).
int64_t memory_in_use();
/// The architectures this binary carries device code for, e.g. {80, 90, 100, 120} (90 for sm_90a).
std::vector<int> compiled_archs();
/// Whether a CMake-style architecture list names sm_90a ("90a") and no plain sm_90 ("90"): then an H100 /
/// H200 runs the sm_90a code (with both, which one the driver loads is not ours to choose).
bool sm90a_without_sm90(const std::string& list);
/// Whether the current device runs this binary's sm_90a code (Hopper's wgmma): the build carries
/// sm_90a and no plain sm_90 (sm90a_without_sm90) and the device has compute capability 9.0. False
/// without a usable device (the CUDA error is cleared); never throws.
bool runs_sm90a();
/// A CMake-style architecture list ("80 90a 100 120") as numbers ({80, 90, 100, 120}); throws
/// std::invalid_argument on a token that does not start with a number.
std::vector<int> parse_archs(const std::string& list);

}  // namespace dflash::cuda
