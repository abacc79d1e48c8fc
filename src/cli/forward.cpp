// `dflash forward`: the forward pass of a target over one or more token sequences (CPU reference,
// or --device cuda: bf16 on the GPU), written to a safetensors file (float32 logits [T, V] and
// hidden_states.{j} [T, D]).
#include <algorithm>
#include <fmt/core.h>

#include <filesystem>
#include <sstream>

#include "cli/commands.h"
#include "cli/gpu.h"
#include "cli/spec_options.h"
#include "gpu/backend.h"
#include "io/safetensors.h"
#include "models/target.h"
#include "models/target_dtype.h"

namespace dflash::cli {

namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  if (s.empty() || s.back() == ',') throw std::invalid_argument("--ids '" + s + "': empty token id");
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || item.empty() || v < 0 || v > INT32_MAX)
      throw std::invalid_argument("--ids '" + s + "': '" + item + "' is not a token id");
    ids.push_back(int32_t(v));
  }
  if (ids.empty()) throw std::invalid_argument("--ids: empty sequence");
  return ids;
}

}  // namespace

void add_forward(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("forward", "Run a target's forward pass and save logits and hidden states");
  static std::string model, device = "cpu", out;
  static std::vector<std::string> id_lists;
  static bool no_logits = false;
  cmd->add_option("--model", model, "Checkpoint directory or .gguf file")->required();
  cmd->add_option("--ids", id_lists, "Comma-separated token ids (no spaces); repeat --ids for a packed batch")
      ->required()
      ->allow_extra_args(false);
  cmd->add_option("--device", device, "Device to run on")->check(CLI::IsMember({"cpu", "cuda"}));
  static TargetDtype dtype = TargetDtype::kBf16;
  add_target_dtype_option(cmd, dtype);
  cmd->add_option("--out", out, "Output .safetensors file")->required();
  cmd->add_flag("--no-logits", no_logits, "Skip the LM head (hidden states only)");
  cmd->callback([&run] {
    run = [] {
      if (device != "cpu" && !cuda_backend_built()) throw std::runtime_error(no_cuda_backend("--device " + device));
      namespace fs = std::filesystem;
      if (fs::is_directory(out)) throw std::runtime_error("--out " + out + " is a directory; give a .safetensors file path");
      if (const fs::path parent = fs::path(out).parent_path(); !parent.empty() && !fs::is_directory(parent))
        throw std::runtime_error("--out " + out + ": directory " + parent.string() + " does not exist");
      std::vector<int32_t> ids;
      std::vector<int64_t> cu{0};
      for (const auto& s : id_lists) {
        auto v = parse_ids(s);
        ids.insert(ids.end(), v.begin(), v.end());
        cu.push_back(int64_t(ids.size()));
      }
      if (dtype != TargetDtype::kBf16 && device != "cuda")
        throw std::runtime_error("--target-dtype fp8 runs on the GPU only: add --device cuda");
      auto target = TargetModel::load(model);
      const int L = int(target->spec().num_hidden_layers);
      ForwardOptions opt;
      opt.logits = !no_logits;
      for (int j = 0; j <= L; ++j) opt.hidden_states.push_back(j);
      ForwardOutput r;
      if (device == "cuda") r = forward_on_gpu(*target, ids, cu, opt, dtype);
      if (device == "cpu") r = target->forward(ids, cu, opt);

      std::vector<std::pair<std::string, Tensor>> named;
      const bool packed = cu.size() > 2;
      for (size_t s = 0; s + 1 < cu.size(); ++s) {
        const std::string pre = packed ? fmt::format("seq{}.", s) : "";
        if (opt.logits) named.emplace_back(pre + "logits", slice_rows(r.logits, cu[s], cu[s + 1]));
        for (auto& [j, h] : r.hidden_states)
          named.emplace_back(fmt::format("{}hidden_states.{}", pre, j), slice_rows(h, cu[s], cu[s + 1]));
      }
      std::vector<std::pair<std::string, const Tensor*>> refs;
      for (auto& [n, t] : named) refs.emplace_back(n, &t);
      write_safetensors(out, refs, {{"model", model}, {"device", device}, {"target_dtype", target_dtype_name(dtype)}});
      fmt::print("wrote {} ({} sequence{}, {} tokens, {} tensors)\n", out, cu.size() - 1, cu.size() == 2 ? "" : "s",
                 ids.size(), refs.size());
      return 0;
    };
  });
}

}  // namespace dflash::cli
