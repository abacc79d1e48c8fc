#include "bench/record.h"

#include <fmt/core.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>
#include <utility>

#include "gpu/device_info.h"

namespace dflash {

nlohmann::json to_json(const BenchRecord& r) {
  nlohmann::json j = {{"bench", r.bench}, {"preset", r.preset}, {"metric", r.metric}, {"value", r.value},
                      {"unit", r.unit},   {"commit", r.commit}, {"device", r.device}, {"date", r.date}};
  if (!r.extra.empty()) j["extra"] = r.extra;
  return j;
}

std::string cpu_description() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, name = "unknown CPU";
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      name = line.substr(line.find(':') + 2);
      break;
    }
  return fmt::format("{} ({} threads)", name, std::thread::hardware_concurrency());
}

namespace {

std::string git_commit() {
  if (const char* c = std::getenv("DFLASH_COMMIT"); c && *c) return c;
  std::array<char, 64> buf{};
  std::string out;
  if (FILE* p = popen("git rev-parse --short HEAD 2>/dev/null", "r")) {
    while (fgets(buf.data(), int(buf.size()), p)) out += buf.data();
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

void append_line(const std::filesystem::path& p, const std::string& line) {
  std::ofstream f(p, std::ios::app);
  f << line << '\n';
  f.flush();
  if (!f) throw std::runtime_error(p.string() + ": cannot append benchmark record");
}

}  // namespace

BenchRecord complete_bench_record(BenchRecord r, [[maybe_unused]] bool gpu) {
  if (r.commit.empty()) r.commit = git_commit();
  if (r.date.empty()) r.date = utc_now();
  if (r.device.empty()) {
    if (gpu)
      if (const auto d = cuda::devices(); !d.empty()) r.device = d[0].name;
    if (r.device.empty()) r.device = cpu_description();
  }
  return r;
}

BenchRecord append_bench_record(const std::string& dir, BenchRecord r, bool gpu) {
  if (r.bench.empty() || r.metric.empty()) throw std::invalid_argument("benchmark record needs bench and metric");
  r = complete_bench_record(std::move(r), gpu);
  std::filesystem::create_directories(dir);
  const std::filesystem::path base = std::filesystem::path(dir) / r.bench;
  append_line(base.string() + ".jsonl", to_json(r).dump());
  append_line(base.string() + ".md", fmt::format("- {} | {} | {} = {:.6g} {} | commit {} | {}{}", r.date, r.preset,
                                                 r.metric, r.value, r.unit, r.commit, r.device,
                                                 r.extra.empty() ? "" : " | " + r.extra.dump()));
  return r;
}

void print_bench_record(const std::string& dir, BenchRecord r, bool record, bool gpu) {
  r = record ? append_bench_record(dir, std::move(r), gpu) : complete_bench_record(std::move(r), gpu);
  fmt::print("{}\n", to_json(r).dump());
}

}  // namespace dflash
