#include "train/prepare_data.h"

#include <fmt/core.h>
#include <unistd.h>

#include <stdexcept>

#include "io/json_file.h"
#include "text/chat_template.h"
#include "text/packed.h"
#include "text/prepare.h"
#include "text/tokenizer.h"

namespace dflash {

namespace fs = std::filesystem;

namespace {
nlohmann::json read_manifest(const fs::path& dir) {
  try {
    return read_json_file((dir / "manifest.json").string());
  } catch (const std::exception&) {
    return nullptr;
  }
}
}  // namespace

std::string prepared_data_dir(const TrainConfig& c, const Tokenizer* tok, const fs::path& data_dir,
                              const std::atomic<int>& stop) {
  if (c.data.size() == 1 && fs::is_directory(c.data[0])) {
    if (!is_packed_dir(c.data[0]))
      throw std::runtime_error(c.data[0] + ": a directory that is not the output of dflash prepare (no " +
                               std::string(kPackedFormat) + " manifest.json)");
    return c.data[0];
  }
  std::vector<std::string> abs;
  for (const auto& f : c.data) {
    if (fs::is_directory(f))
      throw std::runtime_error(f + ": a directory among chat files; give either one prepared directory or chat files");
    if (!fs::is_regular_file(f)) throw std::runtime_error(f + ": no such data file");
    abs.push_back(fs::absolute(f).string());
    const std::string canon = fs::weakly_canonical(f).string(), inside = fs::weakly_canonical(data_dir).string() + "/";
    if (canon.rfind(inside, 0) == 0)
      throw std::runtime_error(f + " lies inside " + data_dir.string() + ", where this run writes its prepared data; "
                               "move it or choose another --out");
  }
  if (!tok) throw std::runtime_error("raw chat files need a tokenizer: the target has none; pass --tokenizer");
  if (fs::exists(data_dir) && !is_packed_dir(data_dir.string()))
    throw std::runtime_error(data_dir.string() + " exists and is not data prepared by dflash; move it or choose "
                             "another --out (nothing was changed)");
  const std::string tok_path = c.tokenizer.empty() ? c.target : c.tokenizer;
  const ChatFamily family = chat_family_for(*tok, c.chat_template, tok_path);
  // Reuse an earlier preparation of the same files (same sizes), tokenizer, template and max_length:
  // a resumed run must see the same samples.
  if (const nlohmann::json m = read_manifest(data_dir); m.is_object()) {
    std::vector<std::pair<std::string, int64_t>> had, now;
    auto integer = [](const nlohmann::json& o, const char* k) {  // -1 when absent or not an integer
      const auto it = o.is_object() ? o.find(k) : o.end();
      return it != o.end() && it->is_number_integer() ? it->get<int64_t>() : int64_t(-1);
    };
    for (const auto& s : m.value("sources", nlohmann::json::array()))
      had.emplace_back(s.is_object() ? s.value("file", "") : "", integer(s, "bytes"));
    for (const auto& f : abs) now.emplace_back(f, int64_t(fs::file_size(f)));
    const bool same = had == now && integer(m, "max_length") == c.max_length &&
                      m.value("chat_template", "") == chat_family_name(family) &&
                      m.value("tokenizer", "") == fs::absolute(tok_path).string();
    if (same) {
      fmt::print("train: using the data prepared earlier in {}\n", data_dir.string());
      return data_dir.string();
    }
    if (c.resume)
      throw std::runtime_error(data_dir.string() + " was prepared from other files, another tokenizer, chat template or "
                               "--max-length than this run's: a resumed run must train on the same data");
  }
  const std::string tmp = data_dir.string() + ".partial-" + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  try {
    const PrepareReport r = write_prepared(*tok, family, {c.data, c.max_length, false, tok_path}, tmp,
                                           [&] { return stop.load() != 0; });
    fs::remove_all(data_dir, ec);
    fs::rename(tmp, data_dir);
    fmt::print("train: prepared {} samples ({} tokens, {} with loss, {} records skipped, {} truncated) into {}\n",
               r.samples, r.tokens, r.loss_tokens, r.skipped.size(), r.truncated, data_dir.string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return data_dir.string();
}

}  // namespace dflash
