// `dflash inspect MODEL [--json]`: architecture, layer plan, parameters, dtypes, memory, and the
// kernel every layer runs on each device.
#include <fmt/core.h>

#include <map>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/gpu.h"
#include "cli/spec_options.h"
#include "models/target.h"
#include "models/target_dtype.h"

namespace dflash::cli {

namespace {

nlohmann::json describe(const std::string& path, TargetDtype dtype) {
  OpenedModel m = open_model(path);
  const ModelSpec& s = m.spec;
  int64_t params = 0;
  std::map<std::string, int64_t> dtypes;  // storage type -> parameter count
  int64_t ignored = 0;
  for (const std::string& n : m.weights->names()) {
    const TensorInfo ti = m.weights->info(n);
    const bool used = n.rfind(s.weight_prefix, 0) == 0 || (n == "lm_head.weight" && !s.tie_word_embeddings);
    if (!used) {
      ++ignored;
      continue;
    }
    params += Tensor::numel_of(ti.shape);
    dtypes[ti.storage] += Tensor::numel_of(ti.shape);
  }
  nlohmann::json j;
  j["path"] = path;
  j["format"] = m.format;
  j["architecture"] = s.architecture;
  j["model_type"] = s.model_type;
  j["hidden_size"] = s.hidden_size;
  j["intermediate_size"] = s.intermediate_size;
  j["num_hidden_layers"] = s.num_hidden_layers;
  j["vocab_size"] = s.vocab_size;
  j["attention"] = {{"heads", s.num_attention_heads}, {"kv_heads", s.num_key_value_heads}, {"head_dim", s.head_dim},
                    {"rotary_dim", s.rotary_dim()}, {"rope_type", s.rope.type}, {"rope_theta", s.rope.theta},
                    {"qk_norm", s.has_qk_norm()}, {"output_gate", s.attn_output_gate()}};
  if (s.linear_num_key_heads)
    j["gated_deltanet"] = {{"key_heads", s.linear_num_key_heads}, {"value_heads", s.linear_num_value_heads},
                           {"key_head_dim", s.linear_key_head_dim}, {"value_head_dim", s.linear_value_head_dim},
                           {"conv_kernel", s.linear_conv_kernel_dim}};
  if (s.num_experts) {
    std::vector<int64_t> moe_layers;
    for (int64_t i = 0; i < s.num_hidden_layers; ++i)
      if (s.is_moe_layer(i)) moe_layers.push_back(i);
    j["mixture_of_experts"] = {{"experts", s.num_experts}, {"experts_per_token", s.num_experts_per_tok},
                               {"expert_intermediate_size", s.moe_intermediate_size},
                               {"shared_expert_intermediate_size", s.shared_expert_intermediate_size},
                               {"renormalized_top_k", s.norm_topk_prob}, {"layers", moe_layers}};
  }
  j["norm"] = s.zero_centered_norm() ? "zero-centered RMSNorm (1 + w)" : "RMSNorm (w)";
  j["tie_word_embeddings"] = s.tie_word_embeddings;
  j["parameters"] = params;
  j["dtypes"] = dtypes;
  j["ignored_tensors"] = ignored;
  j["memory_bytes"] = {{"fp32_cpu_reference", params * 4}, {"bf16_gpu", params * 2}};
  if (nlohmann::json w = gpu_weight_bytes(s); !w.is_null()) j["memory_bytes"]["gpu_weights"] = w;
  j["target_dtype"] = target_dtype_name(dtype);
  nlohmann::json layers = nlohmann::json::array();
  for (int64_t i = 0; i < s.num_hidden_layers; ++i) {
    nlohmann::json k = nlohmann::json::object();
    nlohmann::json refused = nlohmann::json::object();
    for (const KernelChoice& c : layer_kernels(s, i, dtype)) {
      k[c.device] = c.kernel.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.kernel);
      if (c.kernel.empty()) refused[c.device] = c.refused_because;
    }
    layers.push_back(
        {{"index", i}, {"type", layer_kind_name(s.layer_types[size_t(i)])}, {"kernels", k}, {"refused", refused}});
  }
  j["layers"] = layers;
  j["devices"] = {{"cpu", "available"}, {"cuda", cuda_description()}};
  return j;
}

std::string gib(int64_t b) {
  return b >= (int64_t(1) << 30) ? fmt::format("{:.2f} GiB", double(b) / (1ull << 30))
                                 : fmt::format("{:.2f} MiB", double(b) / (1ull << 20));
}

void print_text(const nlohmann::json& j) {
  fmt::print("model        {}\nformat       {}\narchitecture {} (model_type {})\n", j["path"].get<std::string>(),
             j["format"].get<std::string>(), j["architecture"].get<std::string>(), j["model_type"].get<std::string>());
  fmt::print("shape        hidden {}, intermediate {}, {} layers, vocab {}\n", j["hidden_size"].get<int64_t>(),
             j["intermediate_size"].get<int64_t>(), j["num_hidden_layers"].get<int64_t>(), j["vocab_size"].get<int64_t>());
  const auto& a = j["attention"];
  fmt::print("attention    {} heads / {} kv heads x {} (rotary {}, {} theta {}){}{}\n", a["heads"].get<int64_t>(),
             a["kv_heads"].get<int64_t>(), a["head_dim"].get<int64_t>(), a["rotary_dim"].get<int64_t>(),
             a["rope_type"].get<std::string>(), a["rope_theta"].get<double>(), a["qk_norm"].get<bool>() ? ", q/k norm" : "",
             a["output_gate"].get<bool>() ? ", sigmoid output gate" : "");
  if (j.contains("gated_deltanet")) {
    const auto& g = j["gated_deltanet"];
    fmt::print("GatedDeltaNet {} key heads x {} / {} value heads x {}, conv kernel {}\n", g["key_heads"].get<int64_t>(),
               g["key_head_dim"].get<int64_t>(), g["value_heads"].get<int64_t>(), g["value_head_dim"].get<int64_t>(),
               g["conv_kernel"].get<int64_t>());
  }
  if (j.contains("mixture_of_experts")) {
    const auto& m = j["mixture_of_experts"];
    fmt::print("experts      {} experts x {}, top {}{}, shared expert {}; in {} of {} layers (the rest: dense MLP)\n",
               m["experts"].get<int64_t>(), m["expert_intermediate_size"].get<int64_t>(),
               m["experts_per_token"].get<int64_t>(), m["renormalized_top_k"].get<bool>() ? " renormalized" : "",
               m["shared_expert_intermediate_size"].get<int64_t>(), m["layers"].size(), j["num_hidden_layers"].get<int64_t>());
  }
  fmt::print("norm         {}\ntied lm_head {}\n", j["norm"].get<std::string>(), j["tie_word_embeddings"].get<bool>());
  fmt::print("parameters   {} ({:.1f} M)\n", j["parameters"].get<int64_t>(), double(j["parameters"].get<int64_t>()) / 1e6);
  std::string dt;
  for (auto& [k, v] : j["dtypes"].items()) dt += fmt::format("{}{} {}", dt.empty() ? "" : ", ", k, v.get<int64_t>());
  fmt::print("dtypes       {} (parameters per stored type)\n", dt);
  if (j["ignored_tensors"].get<int64_t>())
    fmt::print("ignored      {} tensors outside the text model (vision, mtp, ...)\n", j["ignored_tensors"].get<int64_t>());
  fmt::print("memory       {} as fp32 for the CPU reference, {} as bf16 on a GPU\n",
             gib(j["memory_bytes"]["fp32_cpu_reference"].get<int64_t>()), gib(j["memory_bytes"]["bf16_gpu"].get<int64_t>()));
  if (j["memory_bytes"].contains("gpu_weights"))
    fmt::print("GPU weights  {} with --target-dtype bf16, {} with fp8 (as stored on the GPU, with the GEMM workspace)\n",
               gib(j["memory_bytes"]["gpu_weights"]["bf16"].get<int64_t>()),
               gib(j["memory_bytes"]["gpu_weights"]["fp8"].get<int64_t>()));
  const auto& cuda = j["devices"]["cuda"];
  if (!cuda["built"].get<bool>()) {
    fmt::print("devices      cpu; CUDA backend not built\n");
  } else {
    std::string d;
    for (const auto& g : cuda["devices"]) {
      // Which device code runs: the native cubin for this sm, else the driver JIT-compiles the
      // newest embedded PTX that is not newer than the device.
      const int sm = g["sm"].get<int>();
      int ptx = 0;
      bool native = false;
      for (const auto& a : cuda["compiled_archs"]) {
        native = native || a.get<int>() == sm;
        if (a.get<int>() <= sm) ptx = std::max(ptx, a.get<int>());
      }
      const std::string code = native ? fmt::format("native sm_{} code", sm)
                               : ptx ? fmt::format("PTX JIT from compute_{}", ptx)
                                     : std::string("no usable device code");
      d += fmt::format("{}cuda:{} {} (sm_{}, {}; fp8 {})", d.empty() ? "" : ", ", g["index"].get<int>(),
                       g["name"].get<std::string>(), sm, code, g["fp8"].get<std::string>());
    }
    fmt::print("devices      cpu; {}\n", d.empty() ? "CUDA built, no GPU visible" : d);
    fmt::print("gemm tune    {} (DFLASH_GEMM_TUNE)\n", cuda["gemm_tune"].get<std::string>());
  }
  fmt::print("\nkernels with --target-dtype {}\n{:>5}  {:<32}  {}\n", j["target_dtype"].get<std::string>(), "layer",
             "type", "kernels");
  for (const auto& l : j["layers"]) {
    std::string k;
    for (auto& [dev, name] : l["kernels"].items())
      k += fmt::format("{}{}: {}", k.empty() ? "" : " | ", dev,
                       name.is_null() ? "none (refused: " + l["refused"].value(dev, std::string("no kernel")) + ")"
                                      : name.get<std::string>());
    fmt::print("{:>5}  {:<32}  {}\n", l["index"].get<int64_t>(), l["type"].get<std::string>(), k);
  }
}

}  // namespace

void add_inspect(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("inspect", "Show a model's architecture, layers, size and the kernel of every layer");
  static std::string path;
  static bool json = false;
  cmd->add_option("model", path, "Checkpoint directory (config.json + safetensors) or .gguf file")->required();
  cmd->add_flag("--json", json, "Print JSON instead of a table");
  static TargetDtype dtype = TargetDtype::kBf16;
  add_target_dtype_option(cmd, dtype);
  cmd->callback([&run] {
    run = [] {
      const nlohmann::json j = describe(path, dtype);
      if (json) fmt::print("{}\n", j.dump(2));
      else print_text(j);
      return 0;
    };
  });
}

}  // namespace dflash::cli
