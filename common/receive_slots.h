// Bounds how many pushes a server receives at once. A push being received holds a staging
// buffer of its whole update until it is submitted, so without a bound N simultaneous pushers
// hold N updates: 32 back-to-back pushers of a 16.3 MiB model took a single-process server to
// 623 MiB, against (3 + 8) x 16.3 + 32 = 211 MiB with 8 slots. A push beyond the bound waits
// unread before its payload (a fixed gRPC receive window or the socket's buffer holds the
// sender) until a slot frees.
//
// Thread-safe. A Slot is released when it is destroyed.
#pragma once

#include <cstdint>
#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace aloe {

class ReceiveSlots {
 public:
  // One slot taken; gives it back when destroyed (a moved-from Slot holds none).
  class Slot {
   public:
    Slot(Slot&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)) {}
    Slot& operator=(Slot&& other) noexcept;
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    ~Slot();

   private:
    friend class ReceiveSlots;
    explicit Slot(ReceiveSlots* owner) : owner_(owner) {}
    ReceiveSlots* owner_;
  };

  // capacity >= 1 (0 is taken as 1). `clock` times the waits (Acquire's max_wait) and must
  // outlive the slots.
  ReceiveSlots(uint32_t capacity, const Clock& clock)
      : capacity_(capacity == 0 ? 1 : capacity), clock_(clock) {}
  ReceiveSlots(const ReceiveSlots&) = delete;
  ReceiveSlots& operator=(const ReceiveSlots&) = delete;

  // Takes a free slot, waiting up to `max_wait` (on the clock) for one; `cancelled` (the caller
  // gave up: a cancelled call, a closed connection, a server stopping) and the clock are asked
  // whenever a slot is given back and at least every `poll` (blocking up to `poll` at a time).
  // kResourceExhausted naming the bound when none freed in time, kCancelled once `cancelled`
  // says so. Slots go to waiters in the order they came (first come, first served: with 32
  // back-to-back pushers on 8 slots, handing a freed slot to whichever waiter woke first let
  // some wait three times as long as the median).
  absl::StatusOr<Slot> Acquire(absl::FunctionRef<bool()> cancelled, absl::Duration max_wait,
                               absl::Duration poll = absl::Milliseconds(100));

  uint32_t capacity() const { return capacity_; }
  uint32_t in_use() const;
  // Callers waiting in Acquire now.
  uint32_t waiting() const;
  // The most slots held at once so far.
  uint32_t peak() const;

 private:
  void Release();
  // Whether the waiter holding `ticket` is among the first as many waiters as there are free
  // slots.
  bool MayTake(uint64_t ticket) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint32_t capacity_;
  const Clock& clock_;
  mutable absl::Mutex mu_;
  absl::CondVar freed_;
  uint32_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<uint64_t> waiting_ ABSL_GUARDED_BY(mu_);  // tickets, oldest first
};

}  // namespace aloe
