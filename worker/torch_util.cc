#include "worker/torch_util.h"

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/trainer.h"

namespace aloe::worker {
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

TrainingAutocast::TrainingAutocast() : on_(TrainerAutocastBf16()) {
  if (!on_) return;
  was_enabled_ = at::autocast::is_cpu_enabled();
  was_dtype_ = at::autocast::get_autocast_cpu_dtype();
  at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
  at::autocast::set_cpu_enabled(true);
}

TrainingAutocast::~TrainingAutocast() {
  if (!on_) return;
  at::autocast::set_cpu_enabled(was_enabled_);
  at::autocast::set_autocast_cpu_dtype(was_dtype_);
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
  torch::Tensor batch = torch::empty({static_cast<int64_t>(starts.size()), window}, torch::kInt64);
  int64_t* out = batch.data_ptr<int64_t>();
  for (size_t r = 0; r < starts.size(); ++r) {
    int64_t* row = out + static_cast<int64_t>(r) * window;
    data.Read(starts[r], window, row);
    ALOE_RETURN_IF_ERROR(CheckTokens(row, window, vocab_size, starts[r]));
  }
  return batch;
}

}  // namespace aloe::worker
