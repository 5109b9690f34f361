#include "worker/torch_util.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <atomic>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/trainer.h"

namespace aloe::worker {

bool FlushDenormals() {
  const bool supported = at::globalContext().setFlushDenormal(true);
  if (!supported) return false;
  // One chunk per pool thread: with a grain of 1 over as many items as threads, every thread of
  // the pool runs the body once (OpenMP and native backends alike).
  const int64_t threads = at::get_num_threads();
  if (threads > 1 && !at::in_parallel_region()) {
    at::parallel_for(0, threads, 1,
                     [](int64_t, int64_t) { at::globalContext().setFlushDenormal(true); });
  }
  return true;
}
namespace {

// Returns kInvalidArgument naming the first token >= vocab_size among `count` tokens.
absl::Status CheckTokens(const int64_t* tokens, int64_t count, uint32_t vocab_size,
                         uint64_t window_start) {
  for (int64_t i = 0; i < count; ++i) {
    if (tokens[i] < 0 || static_cast<uint64_t>(tokens[i]) >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token %d in the window starting at offset %d is outside the model vocabulary of %d",
          tokens[i], window_start, vocab_size));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// LibTorch 2.4 keyed the autocast switches by device type; 1.13 has one set per type.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define ALOE_AUTOCAST_BY_DEVICE_TYPE 1
#else
#define ALOE_AUTOCAST_BY_DEVICE_TYPE 0
#endif

bool AutocastEnabled(at::DeviceType type) {
#if ALOE_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::is_autocast_enabled(type);
#else
  return type == at::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

namespace {

at::ScalarType AutocastDtype(at::DeviceType type) {
#if ALOE_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::get_autocast_dtype(type);
#else
  return type == at::kCUDA ? at::autocast::get_autocast_gpu_dtype()
                           : at::autocast::get_autocast_cpu_dtype();
#endif
}

void SetAutocast(at::DeviceType type, bool enabled, at::ScalarType dtype) {
#if ALOE_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_dtype(type, dtype);
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (type == at::kCUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

}  // namespace

TrainingAutocast::TrainingAutocast()
    : on_(TrainerAutocastBf16()), type_(TrainingDevice().is_cuda() ? at::kCUDA : at::kCPU) {
  if (!on_) return;
  was_enabled_ = AutocastEnabled(type_);
  was_dtype_ = AutocastDtype(type_);
  SetAutocast(type_, true, at::kBFloat16);
}

TrainingAutocast::~TrainingAutocast() {
  if (!on_) return;
  SetAutocast(type_, was_enabled_, was_dtype_);
  at::autocast::clear_cache();
}

absl::Status LibTorchError(const char* what, const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    return absl::InternalError(absl::StrFormat("%s: %s", what, c10->what_without_backtrace()));
  }
  return absl::InternalError(absl::StrFormat("%s: %s", what, e.what()));
}

absl::StatusOr<torch::Tensor> ReadBatch(const TokenSource& data,
                                        const std::vector<uint64_t>& starts, int64_t window,
                                        uint32_t vocab_size) {
  // A corpus prepared with another tokenizer fails here, before any token is read. A model
  // vocabulary larger than the corpus's (padded, say to 50304 for 50257) is fine.
  if (data.vocab_size() > vocab_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the training data has a vocabulary of %d token ids (its corpus manifest or shard "
        "header) but the model's vocab_size is %d: prepare the corpus with the model's "
        "tokenizer, or set model.vocab_size to at least %d",
        data.vocab_size(), vocab_size, data.vocab_size()));
  }
  torch::Tensor batch = torch::empty({static_cast<int64_t>(starts.size()), window}, torch::kInt64);
  int64_t* out = batch.data_ptr<int64_t>();
  for (size_t r = 0; r < starts.size(); ++r) {
    int64_t* row = out + static_cast<int64_t>(r) * window;
    data.Read(starts[r], window, row);
    ALOE_RETURN_IF_ERROR(CheckTokens(row, window, vocab_size, starts[r]));
  }
  return batch;
}

torch::Tensor BatchOnDevice(const torch::Tensor& batch, const torch::Device& device) {
  if (!device.is_cuda()) return batch.to(device);
  return batch.pin_memory().to(device, /*non_blocking=*/true);
}

}  // namespace aloe::worker
