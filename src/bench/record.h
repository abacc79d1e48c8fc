// Benchmark records: one JSON object per line in bench/results/<bench>.jsonl plus a readable line
// in bench/results/<bench>.md. Every speed and memory goal of the project is checked there.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace dflash {

/// One measurement. `commit`, `device` and `date` are filled by append_bench_record when empty.
struct BenchRecord {
  std::string bench;   // e.g. "target-forward"
  std::string preset;  // e.g. "smollm2-135m"
  std::string metric;  // e.g. "tokens_per_s"
  double value = 0;
  std::string unit;    // e.g. "tokens/s"
  std::string commit, device, date;
  nlohmann::json extra = nlohmann::json::object();  // free-form context (threads, T, repeats...)
};

/// The record as its JSONL object: {"bench","preset","metric","value","unit","commit","device","date"}
/// plus "extra" when non-empty.
nlohmann::json to_json(const BenchRecord& r);

/// Fills what is empty of commit (env DFLASH_COMMIT, else `git rev-parse --short HEAD`, else
/// "unknown"), device (the first CUDA GPU when `gpu`, else the CPU model from /proc/cpuinfo) and date
/// (UTC, ISO 8601). Returns the completed record.
BenchRecord complete_bench_record(BenchRecord r, bool gpu = false);

/// complete_bench_record, then appends to `dir`/<bench>.jsonl and `dir`/<bench>.md (created if
/// absent). Throws std::invalid_argument without bench or metric, std::runtime_error naming the file
/// when it cannot write. Returns the completed record.
BenchRecord append_bench_record(const std::string& dir, BenchRecord r, bool gpu = false);

/// A benchmark's result line: the completed record, appended to `dir` first when `record` (else
/// written nowhere: --no-record), printed as its JSON object on stdout.
void print_bench_record(const std::string& dir, BenchRecord r, bool record, bool gpu = false);

/// CPU model name ("unknown CPU" when /proc/cpuinfo has none), with the core count.
std::string cpu_description();

}  // namespace dflash
