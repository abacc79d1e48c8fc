#include <cuda_runtime.h>

#include <sstream>

#include "gpu/device_info.h"

namespace dflash::cuda {

std::vector<DeviceInfo> devices() {
  std::vector<DeviceInfo> r;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return r;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, int(sizeof(bus)), i) != cudaSuccess) bus[0] = 0;
    r.push_back({i, p.name, p.major * 10 + p.minor, int64_t(p.totalGlobalMem), bus});
  }
  return r;
}

int64_t memory_in_use() {
  size_t free_b = 0, total = 0;
  return cudaMemGetInfo(&free_b, &total) == cudaSuccess ? int64_t(total - free_b) : -1;
}

std::vector<int> parse_archs(const std::string& list) {
  std::vector<int> r;
  std::istringstream archs(list);
  for (std::string a; archs >> a;) r.push_back(std::stoi(a));  // "90a": 90 (with Hopper's own instructions)
  return r;
}

bool sm90a_without_sm90(const std::string& list) {
  std::istringstream archs(list);
  bool a = false, plain = false;
  for (std::string t; archs >> t;) {
    // CMake spellings: "90a", "90a-real", "90-virtual"
    const std::string base = t.substr(0, t.find('-'));
    a |= base == "90a";
    plain |= base == "90";
  }
  return a && !plain;
}

bool runs_sm90a() {
  // The binary carries sm_90a code only when built for "90a" (CMakeLists.txt); a compute capability
  // 9.0 device then surely runs it only when there is no plain sm_90 code to choose instead.
  static const bool built = sm90a_without_sm90(DFLASH_CUDA_ARCHS);
  if (!built) return false;
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();  // no usable device: nothing runs, and the error is not left behind
    return false;
  }
  return major == 9 && minor == 0;
}

std::vector<int> compiled_archs() { return parse_archs(DFLASH_CUDA_ARCHS); }  // e.g. "80 90a 100 120", set by CMake

}  // namespace dflash::cuda
