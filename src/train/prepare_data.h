// The training data of a run: a prepared directory as given, or raw chat files prepared into
// OUT/data on the fly (src/text/prepare.h).
#pragma once
#include <atomic>
#include <filesystem>
#include <string>

#include "train/train_config.h"

namespace dflash {

class Tokenizer;

/// The packed directory to train on. c.data = one directory with a dflash-packed-v1 manifest: that
/// directory. Otherwise c.data are chat files: they are prepared with `tok` (required) into
/// `data_dir` (atomically), or an earlier preparation there of the same files and max_length is
/// reused (resume). Throws std::runtime_error naming the file or flag at fault.
std::string prepared_data_dir(const TrainConfig& c, const Tokenizer* tok, const std::filesystem::path& data_dir,
                              const std::atomic<int>& stop);

}  // namespace dflash
