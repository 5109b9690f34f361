// LibTorch helpers shared by the worker's trainers (LocalTrainer, FsdpTrainer). Includes
// <torch/torch.h>: only for translation units that use LibTorch anyway.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstdint>
#include <exception>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/token_source.h"

namespace aloe::worker {

// Applies SetTrainerThreads (worker/trainer.h) on the calling thread: torch::set_num_threads
// sets the calling thread's OpenMP thread count, so it is applied on the thread that trains.
// Also makes sure that thread and its intra-op threads flush denormals (FlushDenormals).
void ApplyTrainerThreads();

// Turns on flush-to-zero and denormals-are-zero (at::Context::setFlushDenormal, Python's
// torch.set_flush_denormal) on the calling thread and on every intra-op thread of its LibTorch
// pool. The setting (MXCSR on x86) is per thread: a thread created later inherits its
// creator's, a pool thread that already exists does not. Denormal floats, which the inner loop
// produces as AdamW moments and gradients decay, are many times slower than normal ones on x86
// CPUs. Returns false where the CPU has no such mode.
bool FlushDenormals();

// SetTrainerDevice's choice (worker/trainer.h) as a LibTorch device.
torch::Device TrainingDevice();

// Whether LibTorch's autocast is on for `type` (at::kCPU or at::kCUDA) on the calling thread, in
// the API of the LibTorch it is built against (1.13 or 2.x).
bool AutocastEnabled(at::DeviceType type);

// The forward pass of a training step under bf16 autocast while TrainerAutocastBf16()
// (worker/trainer.h) is on, for the training device's type (CPU or CUDA autocast); a no-op
// otherwise. Restores the thread's previous autocast state on destruction.
class TrainingAutocast {
 public:
  TrainingAutocast();
  ~TrainingAutocast();
  TrainingAutocast(const TrainingAutocast&) = delete;
  TrainingAutocast& operator=(const TrainingAutocast&) = delete;

 private:
  const bool on_;
  const at::DeviceType type_;
  bool was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kBFloat16;
};

// A LibTorch exception as kInternal "what: message" (without the C++ backtrace).
absl::Status LibTorchError(const char* what, const std::exception& e);

// Reads `starts.size()` windows of `window` tokens into a fresh [rows, window] int64 tensor.
// kInvalidArgument when data.vocab_size() exceeds `vocab_size` (the model's), or naming the
// first token outside [0, vocab_size).
absl::StatusOr<torch::Tensor> ReadBatch(const TokenSource& data,
                                        const std::vector<uint64_t>& starts, int64_t window,
                                        uint32_t vocab_size);

// A batch read on the host, on `device`. A CUDA device gets it through page-locked memory and
// an asynchronous copy, ordered on the device's current stream before the step's kernels: the
// host does not wait for the device (a copy from pageable memory would wait for every kernel
// queued before it).
torch::Tensor BatchOnDevice(const torch::Tensor& batch, const torch::Device& device);

}  // namespace aloe::worker
