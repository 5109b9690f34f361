#include "worker/backoff.h"

#include <algorithm>

namespace aloe::worker {

RetryBackoff::RetryBackoff(Options options) : options_(options), random_(options.seed) {}

absl::Duration RetryBackoff::Failure() {
  ++failures_;
  const uint64_t waits = options_.first_at_once ? failures_ - 1 : failures_;
  if (waits == 0) {
    last_ = absl::ZeroDuration();
    return last_;
  }
  absl::Duration ceiling = options_.initial;
  for (uint64_t i = 1; i < waits && ceiling < options_.max; ++i) ceiling *= 2;
  ceiling = std::min(ceiling, options_.max);
  // A uniform draw in [0, 1) from the generator's top 53 bits: the same on every platform, as
  // std::uniform_real_distribution is not.
  const double u = static_cast<double>(random_() >> 11) * 0x1.0p-53;
  const double jitter = std::clamp(options_.jitter, 0.0, 1.0);
  last_ = ceiling * (1.0 - jitter * u);
  return last_;
}

void RetryBackoff::Reset() {
  failures_ = 0;
  last_ = absl::ZeroDuration();
}

}  // namespace aloe::worker
