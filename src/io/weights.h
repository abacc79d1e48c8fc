// A named collection of tensors a model is built from (safetensors checkpoint, GGUF file, ...).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/tensor.h"

namespace dflash {

/// Description of one stored tensor: dtype as stored, shape in PyTorch order, and where it lives
/// ("file.safetensors" or "model.gguf (Q4_1)") for error messages.
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;  // storage dtype (GGUF quantized types report F32: they load as F32)
  std::string storage;       // storage type as the file names it ("BF16", "Q4_1", ...)
  std::vector<int64_t> shape;
  std::string file;
};

/// Read access to named weights. Implementations are safe to read from several threads.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  /// All tensor names, sorted.
  virtual std::vector<std::string> names() const = 0;
  virtual bool has(const std::string& name) const = 0;
  /// Throws std::runtime_error naming the source when `name` is absent.
  virtual TensorInfo info(const std::string& name) const = 0;
  /// The tensor converted to float32. Throws std::runtime_error naming the file and tensor.
  virtual Tensor load_f32(const std::string& name) const = 0;
  /// Human-readable origin (directory or file path).
  virtual std::string origin() const = 0;
};

}  // namespace dflash
