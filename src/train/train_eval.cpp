#include "train/train_eval.h"

#include <chrono>
#include <stdexcept>

#include "common/clock.h"
#include "spec/decoder.h"

namespace dflash {

TrainEval::TrainEval(const TargetModel& model, const Tokenizer& tok, ChatFamily family,
                     const std::vector<std::string>& files, int64_t limit, int64_t max_new_tokens, int batch_size,
                     std::string device, int gpu, TargetDtype target_dtype)
    : model_(model), tok_(tok), family_(family), device_(std::move(device)), gpu_(gpu), target_dtype_(target_dtype) {
  std::vector<SkippedRecord> skipped;
  convs_ = load_prompts(files, limit, &skipped);
  opt_.gen.max_new_tokens = max_new_tokens;
  opt_.gen.stop_token_ids = chat_stop_tokens(model.spec(), tok, family);
  opt_.batch_size = batch_size;
}

TrainEvalResult TrainEval::run(const DrafterConfig& cfg, const DrafterWeights<float>& w) const {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<TargetDecoder> target;
  std::unique_ptr<BlockDrafter> drafter;
  if (device_ == "cuda") {
    target = make_gpu_decoder(model_, cfg.target_layer_ids, gpu_, target_dtype_);
    drafter = make_gpu_drafter(cfg, w, model_.embed_tokens(), model_.lm_head(), gpu_);
  } else {
    target = make_cpu_decoder(model_, cfg.target_layer_ids);
    drafter = make_cpu_drafter(cfg, w, model_.embed_tokens(), model_.lm_head());
  }
  const ChatRunResult r = run_chat(*target, drafter.get(), tok_, family_, convs_, opt_);
  const EvalReport rep = make_eval_report(convs_, r, nullptr, cfg.drafts_per_block() + 1);
  TrainEvalResult out;
  out.acceptance = rep.acceptance;
  out.turns = rep.turns, out.generated_tokens = rep.generated_tokens;
  out.ms = ms_since(t0);
  return out;
}

}  // namespace dflash
