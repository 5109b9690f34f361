#include "common/receive_slots.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace aloe {

ReceiveSlots::Slot& ReceiveSlots::Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    if (owner_ != nullptr) owner_->Release();
    owner_ = std::exchange(other.owner_, nullptr);
  }
  return *this;
}

ReceiveSlots::Slot::~Slot() {
  if (owner_ != nullptr) owner_->Release();
}

absl::StatusOr<ReceiveSlots::Slot> ReceiveSlots::Acquire(absl::FunctionRef<bool()> cancelled,
                                                         absl::Duration max_wait,
                                                         absl::Duration poll) {
  const absl::Time deadline = clock_.Now() + max_wait;
  absl::MutexLock lock(&mu_);
  const uint64_t ticket = next_ticket_++;
  waiting_.push_back(ticket);
  auto leave = [&] { waiting_.erase(std::find(waiting_.begin(), waiting_.end(), ticket)); };
  // Leaving without a slot may bring the waiters behind close enough to the front; taking one
  // moves them up by one as it takes one free slot away, so it wakes nobody.
  auto give_up = [&] {
    leave();
    freed_.SignalAll();
  };
  while (!MayTake(ticket)) {
    if (cancelled()) {
      give_up();
      return absl::CancelledError("the push was abandoned while it waited");
    }
    const absl::Time now = clock_.Now();
    if (now >= deadline) {
      give_up();
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%d pushes are being received (max_staged_updates) and none ended for %.0f s; push "
          "again later",
          capacity_, absl::ToDoubleSeconds(max_wait)));
    }
    freed_.WaitWithTimeout(&mu_, std::min(deadline - now, poll));
  }
  leave();
  ++in_use_;
  peak_ = std::max(peak_, in_use_);
  return Slot(this);
}

bool ReceiveSlots::MayTake(uint64_t ticket) const {
  if (in_use_ >= capacity_) return false;
  const size_t free = capacity_ - in_use_;
  for (size_t i = 0; i < waiting_.size() && i < free; ++i) {
    if (waiting_[i] == ticket) return true;
  }
  return false;
}

uint32_t ReceiveSlots::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

uint32_t ReceiveSlots::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(waiting_.size());
}

uint32_t ReceiveSlots::peak() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}

void ReceiveSlots::Release() {
  absl::MutexLock lock(&mu_);
  --in_use_;
  freed_.SignalAll();
}

}  // namespace aloe
