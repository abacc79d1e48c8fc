#include "spec/engines.h"

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include "gpu/backend.h"
#include "models/drafter_config.h"
#include "text/prepare.h"

namespace dflash {

namespace fs = std::filesystem;

std::string resolve_drafter_dir(const std::string& path) {
  const fs::path p(path);
  if (!fs::exists(p)) throw std::runtime_error(path + ": no such file or directory (--drafter)");
  if (fs::exists(p / "config.json")) return path;
  if (fs::exists(p / "final" / "config.json")) return (p / "final").string();
  // An unfinished run: its newest checkpoint.
  fs::path best;
  int64_t best_step = -1;
  if (fs::is_directory(p / "checkpoints"))
    for (const auto& e : fs::directory_iterator(p / "checkpoints")) {
      const std::string n = e.path().filename().string();
      if (n.rfind("step-", 0) != 0 || !fs::exists(e.path() / "config.json")) continue;
      try {
        const int64_t step = std::stoll(n.substr(5));
        if (step > best_step) best_step = step, best = e.path();
      } catch (const std::exception&) {
      }
    }
  if (best_step >= 0) return best.string();
  throw std::runtime_error(path + ": not a drafter (no config.json here, in final/ or in checkpoints/step-N/)");
}

Engines open_engines(const EngineOptions& o) {
  Engines e;
  if (o.target_dtype != TargetDtype::kBf16 && o.device != "cuda")
    throw std::runtime_error("--target-dtype fp8 runs on the GPU only: add --device cuda");
  if (o.device != "cpu" && !cuda_backend_built()) throw std::runtime_error(no_cuda_backend("--device " + o.device));
  const std::string tok_path = o.tokenizer.empty() ? o.target : o.tokenizer;
  if (!fs::is_regular_file(tok_path) && !fs::exists(fs::path(tok_path) / "tokenizer.json"))
    throw std::runtime_error(tok_path + ": no tokenizer.json there; pass --tokenizer");
  e.tok = Tokenizer::load(tok_path);
  e.family = chat_family_for(*e.tok, o.chat_template, tok_path);
  DrafterConfig dc;
  DrafterWeights<float> dw;
  if (!o.drafter.empty()) {
    e.drafter_dir = resolve_drafter_dir(o.drafter);
    dw = load_drafter_weights<float>(e.drafter_dir, &dc);
    if (dc.mask_token_id < 0) resolve_mask_token_id(dc, *e.tok, e.drafter_dir);
    check_drafter_fits(dc, open_model(o.target).spec, e.drafter_dir);  // before the target's weights load
  }
  e.model = TargetModel::load(o.target);
  if (e.tok->vocab_size() > e.model->spec().vocab_size)
    throw std::runtime_error(tok_path + ": the tokenizer has " + std::to_string(e.tok->vocab_size()) +
                             " ids, more than the target's vocabulary of " + std::to_string(e.model->spec().vocab_size) +
                             ": it is not this target's tokenizer");
  std::vector<int64_t> taps = o.drafter.empty() ? std::vector<int64_t>{} : dc.target_layer_ids;
  if (o.device == "cuda") {
    e.target = make_gpu_decoder(*e.model, std::move(taps), 0, o.target_dtype);
    if (!o.drafter.empty()) e.drafter = make_gpu_drafter(dc, dw, e.model->embed_tokens(), e.model->lm_head(), 0);
    return e;
  }
  e.target = make_cpu_decoder(*e.model, std::move(taps));
  if (!o.drafter.empty())
    e.drafter = make_cpu_drafter(dc, std::move(dw), e.model->embed_tokens(), e.model->lm_head());
  return e;
}

}  // namespace dflash
