// `dflash train` end to end on the CPU with the tiny Qwen3 fixture as the target and a prepared
// directory of synthetic chat samples: the loss falls, a run cut in two (--steps-this-run, then
// --resume) ends bitwise where the uninterrupted run ends, SIGTERM checkpoints and exits 143 and the
// run resumes, a corrupted checkpoint and an occupied --out are refused, config files and flags.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <cstdlib>
#include <thread>

#include "io/json_file.h"
#include "io/safetensors.h"
#include "text/packed.h"
#include "train/train_config.h"
#include "test_util.h"

using namespace dflash;
namespace fs = std::filesystem;

namespace {

/// 12 samples over the fixture's 301-token vocabulary: an 8-token "prompt" without loss, then a
/// "response" following a fixed rule (next = 7 * prev + 3 mod 300) that a drafter can learn.
void write_data(const fs::path& dir) {
  std::mt19937_64 rng(5);
  PackedWriter w(dir.string());
  for (int i = 0; i < 12; ++i) {
    Sample s;
    const int n = 20 + int(rng() % 20);
    for (int j = 0; j < n; ++j) {
      s.ids.push_back(j < 8 ? int32_t(rng() % 300) : int32_t((s.ids.back() * 7 + 3) % 300));
      s.loss_mask.push_back(j >= 8);
    }
    w.add(s);
  }
  w.finish({{"note", "synthetic"}});
}

/// A packed directory of the given samples (the first 8 tokens of each without loss).
void write_samples(const fs::path& dir, const std::vector<std::vector<int32_t>>& samples) {
  PackedWriter w(dir.string());
  for (const auto& ids : samples) {
    Sample s;
    s.ids = ids;
    for (size_t j = 0; j < ids.size(); ++j) s.loss_mask.push_back(j >= 8);
    w.add(s);
  }
  w.finish({{"note", "synthetic"}});
}

struct TinyTrain {
  test::TempDir tmp;
  fs::path data = tmp / "data";
  TinyTrain() { write_data(data); }
  std::string args(const fs::path& out, const std::string& extra = "") const {
    return "train --target " + (test::fixtures_dir() / "qwen3").string() + " --data " + data.string() + " --out " +
           out.string() +
           " --mask-token-id 300 --num-taps 1 --num-draft-layers 1 --block-size 4 --num-anchors 8 --lr 3e-3 " +
           "--log-every 5 --stages-every 20 " + extra;
  }
  int train(const fs::path& out, const std::string& extra, std::string* log) const {
    return test::run_command(test::dflash_binary().string() + " " + args(out, extra), log);
  }
};

std::string bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

/// The complete lines of OUT/metrics.jsonl. (The kill test reads it while the run appends to it: a
/// line still being written, without its newline yet, is not counted.)
std::vector<nlohmann::json> metrics(const fs::path& out) {
  std::vector<nlohmann::json> r;
  const std::string text = bytes(out / "metrics.jsonl");
  for (size_t at = 0, nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1)
    r.push_back(nlohmann::json::parse(text.substr(at, nl - at)));
  return r;
}

}  // namespace

TEST(TrainCli, LossFallsAndOutputsAreComplete) {
  TinyTrain r;
  const fs::path out = r.tmp / "out";
  std::string log;
  ASSERT_EQ(r.train(out, "--max-steps 60 --save-every 20 --keep-last 2", &log), 0) << log;
  const auto m = metrics(out);
  ASSERT_EQ(m.size(), 12u) << log;
  const double first = m.front()["loss"], last = m.back()["loss"];
  EXPECT_LT(last, 0.5 * first) << log;
  EXPECT_NE(log.find("stages over the last 20 steps"), std::string::npos) << log;
  EXPECT_NE(log.find("bottleneck"), std::string::npos) << log;
  // The end says how to serve it: SGLang drafts block_size (4) tokens, vLLM num_speculative_tokens 3.
  const std::string final_dir = fs::absolute(out / "final").lexically_normal().string();
  EXPECT_NE(log.find("--speculative-algorithm DFLASH --speculative-draft-model-path " + final_dir +
                     " --speculative-num-draft-tokens 4"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("\"model\":\"" + final_dir + "\",\"num_speculative_tokens\":3"), std::string::npos) << log;
  for (const char* f : {"config.json", "model.safetensors", "training_state.safetensors"})
    EXPECT_TRUE(fs::exists(out / "final" / f)) << f;
  // keep_last 2 of the checkpoints at 20 and 40
  EXPECT_TRUE(fs::exists(out / "checkpoints" / "step-00000020"));
  EXPECT_TRUE(fs::exists(out / "checkpoints" / "step-00000040"));
  const nlohmann::json cfg = read_json_file((out / "train_config.json").string());
  EXPECT_EQ(cfg["drafter"]["dflash_config"]["mask_token_id"], 300);
  EXPECT_EQ(cfg["resolved"]["total_steps"], 60);
  // The same --out again without --resume is refused, and says how to continue.
  EXPECT_NE(r.train(out, "--max-steps 60", &log), 0);
  EXPECT_NE(log.find("--resume"), std::string::npos) << log;
}

// DSpark: every slot drafts, so the block of 4 is served with 5 verified tokens; the checkpoint is
// in the layout SGLang reads (Qwen3DSparkModel, the heads' tensors, markov_rank at the top level).
TEST(TrainCli, DsparkTrainsAndSaysHowToServeIt) {
  TinyTrain r;
  const fs::path out = r.tmp / "out";
  std::string log;
  ASSERT_EQ(r.train(out, "--drafter-type dspark --markov-rank 8 --max-steps 60", &log), 0) << log;
  const auto m = metrics(out);
  ASSERT_EQ(m.size(), 12u) << log;
  const double first = m.front()["loss"], last = m.back()["loss"];
  EXPECT_LT(last, 0.6 * first) << log;
  // (Accuracy stays low here: 0.9 of the loss matches the fixture target's own distribution, which
  // the synthetic rule does not follow; real data is the target's own answers.)
  EXPECT_NE(log.find("DSpark (0.1 CE + 0.9 L1 + confidence BCE, gamma 4"), std::string::npos) << log;
  EXPECT_NE(log.find("--speculative-algorithm DSPARK"), std::string::npos) << log;
  EXPECT_NE(log.find("--speculative-num-draft-tokens 5"), std::string::npos) << log;
  const nlohmann::json cfg = read_json_file((out / "final" / "config.json").string());
  EXPECT_EQ(cfg["architectures"][0], "Qwen3DSparkModel");
  EXPECT_EQ(cfg["markov_rank"], 8);
  // --init-from a DSpark checkpoint trains it on as DSpark; asking for DFlash there is refused.
  ASSERT_EQ(r.train(r.tmp / "more", "--init-from " + (out / "final").string() + " --max-steps 5", &log), 0) << log;
  EXPECT_NE(log.find("DSpark"), std::string::npos) << log;
  EXPECT_NE(r.train(r.tmp / "other", "--init-from " + (out / "final").string() + " --drafter-type dflash --max-steps 5", &log), 0);
  EXPECT_NE(log.find("drafter_type \"dspark\" (this run: \"dflash\")"), std::string::npos) << log;
  EXPECT_NE(r.train(r.tmp / "bad", "--drafter-type dspark --loss dpace --max-steps 5", &log), 0);
  EXPECT_NE(log.find("DSpark has its own loss"), std::string::npos) << log;
}

// A target whose hidden states are all zero (its embeddings zeroed: every layer's output is then 0):
// the first micro-batch's tap check stops the run, naming the tapped layer, before any step.
TEST(TrainCli, ZeroTapsStopTheRunNamingTheLayer) {
  TinyTrain r;
  const fs::path target = r.tmp / "zeroed";
  fs::copy(test::fixtures_dir() / "qwen3", target);
  const fs::path shard = target / "model-00001-of-00003.safetensors";
  std::vector<std::string> bufs;
  std::vector<SafetensorsEntry> entries;
  {
    const SafetensorsFile f(shard.string());
    for (const TensorInfo& t : f.tensors()) {
      std::string b(static_cast<const char*>(f.data(t.name)), f.nbytes(t.name));
      if (t.name == "model.embed_tokens.weight") b.assign(b.size(), '\0');
      bufs.push_back(std::move(b));
    }
    for (size_t i = 0; i < f.tensors().size(); ++i)
      entries.push_back({f.tensors()[i].name, f.tensors()[i].dtype, f.tensors()[i].shape, bufs[i].data()});
    fs::remove(shard);  // (the mapping keeps the old bytes until f closes)
    write_safetensors(shard.string(), entries);
  }
  std::string log;
  const std::string cmd = test::dflash_binary().string() + " train --target " + target.string() + " --data " +
                          r.data.string() + " --out " + (r.tmp / "out").string() +
                          " --mask-token-id 300 --num-taps 1 --num-draft-layers 1 --block-size 4 --num-anchors 8 --max-steps 5";
  EXPECT_NE(test::run_command(cmd, &log), 0) << log;
  EXPECT_NE(log.find("the target's taps are unusable: target layer 1: every row is exactly zero"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(r.tmp / "out" / "final"));
  // The same data on the real fixture logs each layer's numbers and trains.
  ASSERT_EQ(r.train(r.tmp / "ok", "--max-steps 2", &log), 0) << log;
  EXPECT_NE(log.find("train: taps of example"), std::string::npos) << log;
  EXPECT_NE(log.find("% non-finite"), std::string::npos) << log;
}

// --eval-data: real speculative decoding of held-out prompts with the drafter during the run (the
// real SmolLM2 target: a tokenizer and chat template are needed), tau_real in the log and in
// metrics.jsonl, and the evaluation as its own stage.
TEST(TrainCli, EvalDuringTrainingReportsTauReal) {
  const char* gguf = std::getenv("DFLASH_SMOLLM2_GGUF");
  if (!gguf || !fs::exists(gguf))
    GTEST_SKIP() << "SmolLM2 GGUF not available (DFLASH_SMOLLM2_GGUF unset; scripts/test.sh fetches it)";
  test::TempDir tmp;
  std::vector<std::vector<int32_t>> samples;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 4; ++i) {
    samples.emplace_back();
    for (int j = 0; j < 24; ++j) samples.back().push_back(int32_t(rng() % 40000));
  }
  write_samples(tmp / "data", samples);
  {
    std::ofstream q(tmp / "prompts.jsonl");
    q << R"({"question": "What is 2 + 3?", "answer": "5"})" << "\n" << R"({"question": "Name a color.", "answer": "red"})" << "\n";
  }
  std::string log;
  const std::string cmd = test::dflash_binary().string() + " train --target " + gguf + " --data " + (tmp / "data").string() +
                          " --out " + (tmp / "out").string() +
                          " --num-taps 1 --num-draft-layers 1 --block-size 4 --num-anchors 4 --max-steps 4 --log-every 2 "
                          "--stages-every 4 --eval-data " + (tmp / "prompts.jsonl").string() +
                          " --eval-every 2 --eval-limit 2 --eval-max-new-tokens 6";
  ASSERT_EQ(test::run_command(cmd, &log), 0) << log;
  EXPECT_NE(log.find("real acceptance of 2 held-out conversations"), std::string::npos) << log;
  EXPECT_NE(log.find("eval step 2: tau_real"), std::string::npos) << log;
  EXPECT_NE(log.find("eval step 4: tau_real"), std::string::npos) << log;  // at the end
  EXPECT_NE(log.find("(real "), std::string::npos) << log;
  EXPECT_NE(log.find("| eval "), std::string::npos) << log;  // its own stage
  int evals = 0;
  for (const auto& m : metrics(tmp / "out"))
    if (m.contains("tau_real")) {
      ++evals;
      EXPECT_GE(double(m["tau_real"]), 1.0);
      EXPECT_EQ(m["eval_turns"], 2);
    }
  EXPECT_EQ(evals, 2);
}

TEST(TrainCli, InterruptedAndResumedEqualsUninterrupted) {
  TinyTrain r;
  std::string log;
  const fs::path whole = r.tmp / "whole", cut = r.tmp / "cut";
  ASSERT_EQ(r.train(whole, "--max-steps 30", &log), 0) << log;
  ASSERT_EQ(r.train(cut, "--max-steps 30 --steps-this-run 13", &log), 0) << log;
  EXPECT_TRUE(fs::exists(cut / "checkpoints" / "step-00000013")) << log;
  EXPECT_FALSE(fs::exists(cut / "final"));
  ASSERT_EQ(r.train(cut, "--max-steps 30 --resume", &log), 0) << log;
  EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
  for (const char* f : {"model.safetensors", "training_state.safetensors"})
    EXPECT_EQ(bytes(whole / "final" / f), bytes(cut / "final" / f)) << f << " differs after interrupt + resume";
}

TEST(TrainCli, SigtermCheckpointsThenResumes) {
  TinyTrain r;
  const fs::path out = r.tmp / "out";
  const std::string bin = test::dflash_binary().string();
  const std::string cmd = bin + " " + r.args(out, "--max-steps 1000000") + " > " + (r.tmp / "log").string() + " 2>&1";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait until it is training (a few metrics lines), then ask it to stop.
  const auto t0 = std::chrono::steady_clock::now();
  while (metrics(out).size() < 3 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_GE(metrics(out).size(), 3u) << bytes(r.tmp / "log");
  kill(pid, SIGTERM);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << bytes(r.tmp / "log");
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << bytes(r.tmp / "log");
  const std::string log = bytes(r.tmp / "log");
  EXPECT_NE(log.find("interrupted (signal 15)"), std::string::npos) << log;
  int64_t last = 0;
  for (const auto& e : fs::directory_iterator(out / "checkpoints"))
    last = std::max<int64_t>(last, std::stoll(e.path().filename().string().substr(5)));
  ASSERT_GT(last, 0) << log;
  // Resume: it continues from that step (5 more steps, then a checkpoint).
  std::string log2;
  ASSERT_EQ(r.train(out, "--max-steps 1000000 --resume --steps-this-run 5", &log2), 0) << log2;
  EXPECT_NE(log2.find("at step " + std::to_string(last)), std::string::npos) << log2;
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(last + 5));
  EXPECT_TRUE(fs::exists(out / "checkpoints" / name)) << log2;
}

// kill -9 at seeded random moments (checkpoints every step, so many land inside a checkpoint write),
// then --resume (or a fresh start when no checkpoint was complete): at most the step in progress is
// lost, the run always ends bitwise where the uninterrupted run ends, and no temporary directory
// survives the resumed run.
TEST(TrainCli, KillNineAnywhereThenResumeEndsLikeAnUninterruptedRun) {
  TinyTrain r;
  const std::string steps = "--max-steps 30 --save-every 1 --keep-last 2";
  std::string log;
  ASSERT_EQ(r.train(r.tmp / "ref", steps, &log), 0) << log;
  const std::string want = bytes(r.tmp / "ref" / "final" / "model.safetensors");
  std::mt19937_64 rng(17);
  for (int k = 0; k < 6; ++k) {
    const fs::path out = r.tmp / ("kill" + std::to_string(k));
    const std::string cmd = "exec " + test::dflash_binary().string() + " " + r.args(out, steps) + " > " +
                            (r.tmp / "kill.log").string() + " 2>&1";
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    // Somewhere in the run: after a seeded number of progress lines (one per 5 steps; 0 = during
    // start-up), plus a few milliseconds.
    const size_t lines = size_t(rng() % 6);
    const auto t0 = std::chrono::steady_clock::now();
    while (metrics(out).size() < lines && waitpid(pid, nullptr, WNOHANG) == 0 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120))
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::this_thread::sleep_for(std::chrono::milliseconds(int(rng() % 15)));
    kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    bool resumable = false;  // a complete checkpoint exists (a killed write leaves only a temporary)
    if (fs::exists(out / "checkpoints"))
      for (const auto& e : fs::directory_iterator(out / "checkpoints")) {  // step-NNNNNNNN, not step-N.tmp-PID
        const std::string n = e.path().filename().string();
        resumable = resumable || (n.rfind("step-", 0) == 0 && n.find('.') == std::string::npos);
      }
    ASSERT_EQ(r.train(out, steps + (resumable ? std::string(" --resume") : ""), &log), 0) << "kill " << k << ":\n" << log;
    const size_t at = log.find("resumed from");
    if (at != std::string::npos) {  // at most the step in progress (one checkpoint interval) was lost
      const size_t p = log.find("at step ", at) + 8;
      EXPECT_GE(std::stoll(log.substr(p)), int64_t(5 * lines) - 1) << log;
    }
    std::printf("[kill -9] run %d: %s\n", k,
                !resumable ? "no complete checkpoint yet: started again"
                : at != std::string::npos ? log.substr(at, log.find('\n', at) - at).c_str()
                                          : "had finished before the kill");
    EXPECT_EQ(bytes(out / "final" / "model.safetensors"), want) << "kill " << k << ":\n" << log;
    for (const auto& e : fs::recursive_directory_iterator(out)) {
      const std::string name = e.path().filename().string();
      EXPECT_TRUE(name.rfind(".tmp-", 0) != 0 && name.rfind(".partial-", 0) != 0 && name.rfind(".old-", 0) != 0)
          << "left behind: " << e.path();
    }
  }
}

// A full disk while a checkpoint is written (simulated with a file-size limit: the training state,
// ~450 KB, cannot be written; everything else can): a clear error naming the file, no half-written
// checkpoint, the previous one intact; resuming without the limit ends like the uninterrupted run.
TEST(TrainCli, FullDiskKeepsThePreviousCheckpoint) {
  TinyTrain r;
  const std::string steps = "--max-steps 20 --save-every 5";
  std::string log;
  ASSERT_EQ(r.train(r.tmp / "ref", steps, &log), 0) << log;
  const fs::path out = r.tmp / "out";
  ASSERT_EQ(r.train(out, steps + " --steps-this-run 5", &log), 0) << log;
  const std::string before = bytes(out / "checkpoints" / "step-00000005" / "training_state.safetensors");
  const int rc = test::run_command("sh -c 'ulimit -f 400; exec " + test::dflash_binary().string() + " " +
                                       r.args(out, steps + " --resume") + "'",
                                   &log);
  EXPECT_EQ(rc, 1) << log;
  EXPECT_NE(log.find("training_state.safetensors"), std::string::npos) << log;
  EXPECT_NE(log.find("File too large"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(out / "checkpoints" / "step-00000010")) << log;
  EXPECT_EQ(bytes(out / "checkpoints" / "step-00000005" / "training_state.safetensors"), before);
  ASSERT_EQ(r.train(out, steps + " --resume", &log), 0) << log;
  EXPECT_EQ(bytes(out / "final" / "model.safetensors"), bytes(r.tmp / "ref" / "final" / "model.safetensors"));
}

TEST(TrainCli, CorruptedCheckpointIsRefused) {
  TinyTrain r;
  const fs::path out = r.tmp / "out";
  std::string log;
  ASSERT_EQ(r.train(out, "--max-steps 30 --steps-this-run 10", &log), 0) << log;
  const fs::path state = out / "checkpoints" / "step-00000010" / "training_state.safetensors";
  ASSERT_TRUE(fs::exists(state));
  fs::resize_file(state, fs::file_size(state) / 2);
  EXPECT_EQ(r.train(out, "--max-steps 30 --resume", &log), 1);
  EXPECT_NE(log.find("training_state.safetensors"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(out / "final"));
}

// The taps come from the target as the run computed them: resuming with another --target-dtype is
// refused, naming the one to pass (the run's train_config.json records it).
TEST(TrainCli, ResumeKeepsTheTargetDtype) {
  TinyTrain r;
  const fs::path out = r.tmp / "out";
  std::string log;
  ASSERT_EQ(r.train(out, "--max-steps 30 --steps-this-run 10", &log), 0) << log;
  nlohmann::json cfg = read_json_file((out / "train_config.json").string());
  EXPECT_EQ(cfg.value("target_dtype", ""), "bf16");
  cfg["target_dtype"] = "fp8";  // as an FP8 run on a GPU would have written it
  test::write_file(out / "train_config.json", cfg.dump());
  EXPECT_EQ(r.train(out, "--max-steps 30 --resume", &log), 1);
  EXPECT_NE(log.find("was trained with --target-dtype fp8, not bf16"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(out / "final"));
}

TEST(TrainCli, ConfigFileFlagsAndDump) {
  TinyTrain r;
  test::write_file(r.tmp / "cfg.json", R"({"lr": 0.001, "num_anchors": 64, "epochs": 2})");
  std::string out;
  ASSERT_EQ(test::run_command(test::dflash_binary().string() + " " +
                                  r.args(r.tmp / "o", "--config " + (r.tmp / "cfg.json").string() + " --dump-config"),
                              &out),
            0)
      << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_DOUBLE_EQ(j["lr"].get<double>(), 3e-3);  // the flag wins over the file
  EXPECT_EQ(j["num_anchors"], 8);                  // the flag wins
  EXPECT_EQ(j["epochs"], 2);                       // from the file
  EXPECT_EQ(j["mask_token_id"], 300);
  EXPECT_EQ(j["grad_accum"], 1);                   // the recipe's default
  test::write_file(r.tmp / "bad.json", R"({"learning_rate": 0.001})");
  EXPECT_NE(test::run_command(test::dflash_binary().string() + " " +
                                  r.args(r.tmp / "o", "--config " + (r.tmp / "bad.json").string()),
                              &out),
            0);
  EXPECT_NE(out.find("unknown key 'learning_rate'"), std::string::npos) << out;
  // --help lists the recipe's defaults beside the flags (CLI11 2.1 writes "--lr FLOAT=0.0006",
  // later versions "--lr FLOAT [0.0006]": the flag's line holds the value).
  ASSERT_EQ(test::run_command(test::dflash_binary().string() + " train --help", &out), 0) << out;
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--lr", "0.0006"}, {"--num-anchors", "512"}, {"--block-size", "16"}, {"--epochs", "6"},
           {"--max-grad-norm", "1"}}) {
    const size_t at = out.find("  " + flag + " ");
    ASSERT_NE(at, std::string::npos) << flag << "\n" << out;
    const std::string line = out.substr(at, out.find('\n', at) - at);
    EXPECT_NE(line.find(value), std::string::npos) << line;
  }
}

// Mistakes users make: none may lose data or silently change the run.
TEST(TrainCli, GuardsAgainstUserMistakes) {
  TinyTrain r;
  std::string log;
  // Chat files inside OUT/data (where the run writes its prepared data) are refused; nothing deleted.
  const fs::path proj = r.tmp / "proj";
  fs::create_directories(proj / "data");
  test::write_file(proj / "data" / "train.jsonl", R"({"question": "q", "answer": "a"})" "\n");
  const std::string smol = (test::source_dir() / ".cache" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").string();
  const char* env = std::getenv("DFLASH_SMOLLM2_GGUF");
  const std::string model = env ? env : smol;
  if (fs::exists(model)) {  // a target with a tokenizer, so that the chat file would be prepared
    EXPECT_NE(test::run_command(test::dflash_binary().string() + " train --target " + model + " --data " +
                                    (proj / "data" / "train.jsonl").string() + " --out " + proj.string() +
                                    " --max-steps 1 --num-draft-layers 1 --block-size 4 --num-anchors 4",
                                &log),
              0);
    EXPECT_NE(log.find("lies inside"), std::string::npos) << log;
    EXPECT_TRUE(fs::exists(proj / "data" / "train.jsonl")) << log;
  }
  // --no-shuffle reaches the config; --shuffle overrides a config file's false.
  test::write_file(r.tmp / "noshuf.json", R"({"shuffle": false})");
  ASSERT_EQ(test::run_command(test::dflash_binary().string() + " " + r.args(r.tmp / "o", "--no-shuffle --dump-config"), &log), 0);
  EXPECT_FALSE(nlohmann::json::parse(log)["shuffle"].get<bool>());
  ASSERT_EQ(test::run_command(test::dflash_binary().string() + " " +
                                  r.args(r.tmp / "o", "--config " + (r.tmp / "noshuf.json").string() + " --shuffle --dump-config"),
                              &log),
            0);
  EXPECT_TRUE(nlohmann::json::parse(log)["shuffle"].get<bool>());
  // Resuming with other training settings is refused, naming the setting.
  const fs::path out = r.tmp / "out";
  ASSERT_EQ(r.train(out, "--max-steps 20 --steps-this-run 10", &log), 0) << log;
  EXPECT_NE(r.train(out, "--max-steps 20 --resume --grad-accum 2", &log), 0);
  EXPECT_NE(log.find("grad_accum 1 -> 2"), std::string::npos) << log;
  // metrics.jsonl of a resumed run has each step once.
  ASSERT_EQ(r.train(out, "--max-steps 20 --resume", &log), 0) << log;
  int64_t prev = 0;
  for (const auto& m : metrics(out)) {
    EXPECT_GT(m["step"].get<int64_t>(), prev);
    prev = m["step"];
  }
  EXPECT_EQ(prev, 20);
  // Resuming a finished run says so and changes nothing.
  const std::string before = bytes(out / "final" / "model.safetensors");
  ASSERT_EQ(r.train(out, "--max-steps 20 --resume", &log), 0) << log;
  EXPECT_NE(log.find("has finished"), std::string::npos) << log;
  EXPECT_EQ(bytes(out / "final" / "model.safetensors"), before);
  // More micro-batches per step than samples is refused.
  EXPECT_NE(r.train(r.tmp / "ga", "--max-steps 2 --grad-accum 50", &log), 0);
  EXPECT_NE(log.find("--grad-accum 50"), std::string::npos) << log;
  // GPU placement: lists are checked before anything runs (also on a machine without GPUs).
  const std::string bin = test::dflash_binary().string() + " ";
  EXPECT_NE(test::run_command(bin + r.args(r.tmp / "g1", "--gpus 0,0 --dump-config"), &log), 0);
  EXPECT_NE(log.find("gpus lists device 0 twice"), std::string::npos) << log;
  EXPECT_NE(test::run_command(bin + r.args(r.tmp / "g2", "--target-gpus 0 --dump-config"), &log), 0);
  EXPECT_NE(log.find("target_gpus and drafter_gpus go together"), std::string::npos) << log;
  test::write_file(r.tmp / "badgpus.json", R"({"gpus": [-1]})");
  EXPECT_NE(test::run_command(bin + r.args(r.tmp / "g3", "--config " + (r.tmp / "badgpus.json").string() + " --dump-config"),
                              &log),
            0);
  EXPECT_NE(log.find("'gpus'"), std::string::npos) << log;
  ASSERT_EQ(test::run_command(bin + r.args(r.tmp / "g4", "--target-gpus 0 --drafter-gpus 1,2 --dump-config"), &log), 0)
      << log;
  const auto dumped = nlohmann::json::parse(log);
  EXPECT_EQ(dumped["target_gpus"], nlohmann::json({0}));
  EXPECT_EQ(dumped["drafter_gpus"], nlohmann::json({1, 2}));
}

// Resource limits (issue 10): data made for another vocabulary, a sample longer than the target's
// positions, and taps the target does not have are each refused with the knob to turn, before any
// training step and without writing a checkpoint.
TEST(TrainCli, ResourceLimitsAreClearErrorsBeforeAnyStep) {
  TinyTrain r;
  std::string log;
  const std::vector<int32_t> ok(40, 5);
  std::vector<int32_t> foreign = ok;
  foreign[20] = 400;  // the fixture's vocabulary has 301 tokens
  write_samples(r.tmp / "foreign", {ok, foreign});
  const std::string base = test::dflash_binary().string() + " train --target " + (test::fixtures_dir() / "qwen3").string() +
                           " --mask-token-id 300 --num-taps 1 --num-draft-layers 1 --block-size 4 --num-anchors 8 " +
                           "--max-steps 2 --out ";
  EXPECT_NE(test::run_command(base + (r.tmp / "o1").string() + " --data " + (r.tmp / "foreign").string(), &log), 0);
  EXPECT_NE(log.find("token id 400 is outside the target's vocabulary of 301"), std::string::npos) << log;
  write_samples(r.tmp / "long", {ok, std::vector<int32_t>(300, 7)});  // max_position_embeddings 256
  EXPECT_NE(test::run_command(base + (r.tmp / "o2").string() + " --data " + (r.tmp / "long").string(), &log), 0);
  EXPECT_NE(log.find("sample 1 has 300 tokens, more than the target's max_position_embeddings 256"), std::string::npos)
      << log;
  EXPECT_NE(log.find("--max-length 256"), std::string::npos) << log;
  EXPECT_NE(test::run_command(base + (r.tmp / "o3").string() + " --data " + r.data.string() + " --target-layer-ids 9",
                              &log),
            0);
  EXPECT_NE(log.find("target layer id 9 is outside the target's 3 layers"), std::string::npos) << log;
  for (const char* o : {"o1", "o2", "o3"}) EXPECT_FALSE(fs::exists(r.tmp / o / "checkpoints")) << o;
}

TEST(TrainCli, DpaceLossTrains) {
  TinyTrain r;
  const fs::path out = r.tmp / "dpace";
  std::string log;
  ASSERT_EQ(r.train(out, "--max-steps 60 --loss dpace", &log), 0) << log;
  EXPECT_NE(log.find("loss D-PACE"), std::string::npos) << log;
  const auto m = metrics(out);
  ASSERT_FALSE(m.empty()) << log;
  EXPECT_LT(m.back()["loss"].get<double>(), 0.5 * m.front()["loss"].get<double>()) << log;
  EXPECT_EQ(read_json_file((out / "train_config.json").string())["loss"], "dpace");
  EXPECT_NE(r.train(r.tmp / "bad", "--max-steps 5 --loss focal", &log), 0);
}

TEST(TrainCli, DrafterLayoutFlagsAndInitFromAnyLayout) {
  EXPECT_EQ(parse_layer_types("sliding_attention x2, full_attention"),
            (std::vector<std::string>{"sliding_attention", "sliding_attention", "full_attention"}));
  EXPECT_THROW(parse_layer_types("sliding x2"), std::invalid_argument);
  EXPECT_THROW(parse_layer_types("full_attention x0"), std::invalid_argument);
  // layer_types alone sets the layer count; both given must agree.
  EXPECT_EQ(train_config_from_json({{"layer_types", {"full_attention", "full_attention"}}}, "cfg").num_draft_layers, 2);
  TrainConfig bad = train_config_from_json({{"layer_types", {"full_attention"}}, {"num_draft_layers", 3}}, "cfg");
  EXPECT_THROW(bad.validate_values(), std::invalid_argument);

  TinyTrain r;
  const fs::path out = r.tmp / "sliding";
  std::string log;
  // A published-style layout: sliding layers and a full one, its own head shape, yarn RoPE.
  const std::string layout = "--layer-types \"sliding_attention x2,full_attention\" --sliding-window 8 "
                             "--num-attention-heads 4 --num-key-value-heads 2 --head-dim 16 --intermediate-size 48 "
                             "--rope-scaling '{\"rope_type\":\"yarn\",\"factor\":4.0,\"original_max_position_embeddings\":64}'";
  const std::string base = test::dflash_binary().string() + " train --target " +
                           (test::fixtures_dir() / "qwen3").string() + " --data " + r.data.string() +
                           " --mask-token-id 300 --num-taps 1 --num-anchors 8 --lr 3e-3 --block-size 4";
  // --num-draft-layers 1 beside three layer types is refused, naming both.
  EXPECT_NE(r.train(out, "--max-steps 10 " + layout, &log), 0);
  EXPECT_NE(log.find("layer_types lists 3 layers but num_draft_layers is 1"), std::string::npos) << log;
  ASSERT_EQ(test::run_command(base + " --out " + out.string() + " --max-steps 10 " + layout, &log), 0) << log;
  const nlohmann::json cfg = read_json_file((out / "final" / "config.json").string());
  EXPECT_EQ(cfg["num_hidden_layers"], 3);
  EXPECT_EQ(cfg["layer_types"], (nlohmann::json{"sliding_attention", "sliding_attention", "full_attention"}));
  EXPECT_EQ(cfg["sliding_window"], 8);
  EXPECT_EQ(cfg["use_sliding_window"], true);
  EXPECT_EQ(cfg["num_key_value_heads"], 2);
  EXPECT_EQ(cfg["head_dim"], 16);
  EXPECT_EQ(cfg["intermediate_size"], 48);
  EXPECT_EQ(cfg["rope_scaling"]["rope_type"], "yarn");
  // vLLM needs its second runner for the mixed layers: the printed command says so.
  EXPECT_NE(log.find("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve"), std::string::npos) << log;
  // --init-from takes that drafter as it is when no flag asks for another layout...
  const fs::path again = r.tmp / "again";
  const std::string init = " --init-from " + (out / "final").string();
  ASSERT_EQ(test::run_command(test::dflash_binary().string() + " train --target " +
                                  (test::fixtures_dir() / "qwen3").string() + " --data " + r.data.string() +
                                  " --out " + again.string() + " --num-anchors 8 --max-steps 5 --lr 3e-3" + init,
                              &log),
            0)
      << log;  // (no --mask-token-id either: the checkpoint's)
  EXPECT_NE(log.find("its drafter as it is: 3 layers"), std::string::npos) << log;
  EXPECT_EQ(read_json_file((again / "final" / "config.json").string())["layer_types"], cfg["layer_types"]);
  // ... and refuses a flag that asks for another layout, naming it.
  EXPECT_NE(test::run_command(base + " --out " + (r.tmp / "conflict").string() +
                                  " --max-steps 5 --num-key-value-heads 4" + init,
                              &log),
            0);
  EXPECT_NE(log.find("num_key_value_heads 2 (this run: 4)"), std::string::npos) << log;
}
