#include "models/drafter_checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include "io/safetensors.h"
#include "tensor/dtype.h"

namespace dflash {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void fail(const std::string& dir, const std::string& what) {
  throw std::runtime_error("write_drafter_checkpoint " + dir + ": " + what);
}

/// fsync of a file or directory (best effort for directories on filesystems that refuse it).
void sync_path(const std::string& p, bool is_dir) {
  const int fd = ::open(p.c_str(), (is_dir ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (is_dir) return;
    throw std::runtime_error("open " + p + ": " + std::strerror(errno));
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && !is_dir) throw std::runtime_error("fsync " + p + ": " + std::strerror(err));
}

void write_text(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot create " + path + ": " + std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0 &&
                  ::fsync(::fileno(f)) == 0;
  const int err = errno;
  if (std::fclose(f) != 0 || !ok) throw std::runtime_error("cannot write " + path + ": " + std::strerror(err));
}

/// Absent -> false; an earlier checkpoint or empty directory -> true; else throws.
bool check_target(const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (ec || st.type() == fs::file_type::not_found) return false;
  if (st.type() != fs::file_type::directory) fail(dir, "exists and is not a directory");
  bool has_config = false, empty = true;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    empty = false;
    const std::string name = e.path().filename().string();
    if (name == "config.json") {
      has_config = true;
    } else if (name != "model.safetensors" && name != kTrainingStateFile) {
      fail(dir, "refusing to replace a directory that is not a drafter checkpoint (it holds " + name + ")");
    }
  }
  if (!empty && !has_config) fail(dir, "refusing to replace a directory without config.json");
  return true;
}

}  // namespace

void write_drafter_checkpoint(const std::string& dir_in, const DrafterConfig& cfg, const DrafterWeights<float>& w,
                              const std::function<void(const std::string&)>& write_training_state) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty()) fail(dir_in, "empty path");
  cfg.validate("write_drafter_checkpoint " + dir);
  if (cfg.mask_token_id < 0)
    throw std::runtime_error("write_drafter_checkpoint " + dir + ": mask_token_id is not set (resolve_mask_token_id)");

  // Shapes and names against the config, before touching the disk.
  const auto shapes = drafter_param_shapes(cfg);
  const auto named = w.named();
  if (named.size() != shapes.size())
    fail(dir, "weights hold " + std::to_string(named.size()) + " tensors, config expects " +
                  std::to_string(shapes.size()));
  std::vector<std::vector<uint16_t>> bf16(named.size());
  std::vector<SafetensorsEntry> entries;
  for (size_t i = 0; i < named.size(); ++i) {
    const std::string& name = named[i].first;
    const auto& t = named[i].second;
    const auto it = std::find_if(shapes.begin(), shapes.end(), [&](const auto& s) { return s.first == name; });
    if (it == shapes.end()) fail(dir, "unexpected tensor " + name);
    if (t->shape != it->second || int64_t(t->data.size()) != BasicTensor<float>::numel_of(it->second))
      fail(dir, name + " has shape " + shape_str(t->shape) + ", expected " + shape_str(it->second));
    bf16[i].resize(t->data.size());
    for (size_t j = 0; j < t->data.size(); ++j) bf16[i][j] = f32_to_bf16(t->data[j]);
  }
  for (size_t i = 0; i < named.size(); ++i)
    entries.push_back({named[i].first, DType::BF16, named[i].second->shape, bf16[i].data()});

  const bool replace = check_target(dir);
  const std::string tmp = dir + ".tmp-" + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);  // a stale one of ours (same pid): never someone else's name
  if (!fs::create_directory(tmp, ec) || ec)
    fail(dir, "cannot create " + tmp + ": " + (ec ? ec.message() : std::string("exists")));
  try {
    write_text(tmp + "/config.json", drafter_config_to_json(cfg).dump(2) + "\n");
    write_safetensors(tmp + "/model.safetensors", entries, {{"format", "pt"}});
    if (write_training_state) write_training_state(tmp + "/" + kTrainingStateFile);
    sync_path(tmp, true);
    if (replace) {
      // Atomic swap of the two directories, then delete the old one (now at tmp).
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) != 0) {
        if (errno != EINVAL && errno != ENOSYS) fail(dir, std::string("rename: ") + std::strerror(errno));
        // Filesystem without RENAME_EXCHANGE: move the old one aside first (not atomic).
        const std::string old = dir + ".old-" + std::to_string(::getpid());
        fs::remove_all(old, ec);
        fs::rename(dir, old);
        try {
          fs::rename(tmp, dir);
        } catch (...) {
          fs::rename(old, dir, ec);  // put the earlier checkpoint back
          throw;
        }
        fs::remove_all(old, ec);
      } else {
        fs::remove_all(tmp, ec);
      }
    } else {
      if (::rename(tmp.c_str(), dir.c_str()) != 0) fail(dir, std::string("rename: ") + std::strerror(errno));
    }
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  const fs::path parent = fs::path(dir).parent_path();
  sync_path(parent.empty() ? std::string(".") : parent.string(), true);
}

namespace {
/// `s` as one shell word: unchanged when it has only safe characters, else in single quotes.
std::string shell_word(const std::string& s) {
  const bool safe = !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || (ch != 0 && std::strchr("/._-+:=@,", ch) != nullptr);
  });
  if (safe) return s;
  std::string r = "'";
  for (char ch : s) r += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return r + "'";
}
}  // namespace

std::string serving_commands(const std::string& target, const std::string& drafter_dir, const DrafterConfig& cfg) {
  const int64_t sliding = std::count(cfg.layer_types.begin(), cfg.layer_types.end(), "sliding_attention");
  const bool mixed = sliding > 0 && sliding < int64_t(cfg.layer_types.size());
  // DFlash drafts B - 1 tokens and verifies B; DSpark drafts B and verifies B + 1 (SGLang's
  // speculative_num_draft_tokens is gamma + 1, dspark_config.py).
  const int64_t drafts = cfg.drafts_per_block();
  const nlohmann::json spec = {{"method", cfg.is_dspark() ? "dspark" : "dflash"}, {"model", drafter_dir},
                               {"num_speculative_tokens", drafts}};
  return "SGLang: python -m sglang.launch_server --model-path " + shell_word(target) + " --speculative-algorithm " +
         (cfg.is_dspark() ? "DSPARK" : "DFLASH") + " --speculative-draft-model-path " + shell_word(drafter_dir) +
         " --speculative-num-draft-tokens " + std::to_string(drafts + 1) + "\n" +
         "vLLM:   " + (mixed ? "VLLM_USE_V2_MODEL_RUNNER=1 " : "") + "vllm serve " + shell_word(target) +
         " --speculative-config " + shell_word(spec.dump()) + "\n";
}

}  // namespace dflash
