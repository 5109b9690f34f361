#include "common/receive_slots.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"

// Time comes from a FakeClock only: a deadline passes when the test advances the clock, and a
// waiter is known to wait once ReceiveSlots::waiting() counts it.
namespace aloe {
namespace {

using ::testing::HasSubstr;

bool Never() { return false; }

// Spins (yielding) until `slots` has `n` callers waiting in Acquire.
void AwaitWaiters(const ReceiveSlots& slots, uint32_t n) {
  while (slots.waiting() != n) std::this_thread::yield();
}

TEST(ReceiveSlotsTest, AtMostCapacityAreHeldAndAFullSetRefusesAtTheDeadline) {
  FakeClock clock;
  ReceiveSlots slots(2, clock);
  absl::StatusOr<ReceiveSlots::Slot> a = slots.Acquire(Never, absl::Seconds(1));
  absl::StatusOr<ReceiveSlots::Slot> b = slots.Acquire(Never, absl::Seconds(1));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(slots.in_use(), 2u);

  // Every poll asks `cancelled`, which moves the clock on by 50 ms: the third poll is at the
  // 150 ms deadline, where the wait ends.
  int polls = 0;
  auto tick = [&] {
    ++polls;
    clock.Advance(absl::Milliseconds(50));
    return false;
  };
  absl::StatusOr<ReceiveSlots::Slot> c =
      slots.Acquire(tick, absl::Milliseconds(150), absl::ZeroDuration());
  EXPECT_EQ(polls, 3);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("2 pushes are being received (max_staged_updates)"));
  EXPECT_EQ(slots.in_use(), 2u);  // the refusal took nothing
  EXPECT_EQ(slots.waiting(), 0u);

  a = absl::CancelledError("dropped");  // destroys the first slot
  EXPECT_EQ(slots.in_use(), 1u);
  absl::StatusOr<ReceiveSlots::Slot> d = slots.Acquire(Never, absl::ZeroDuration());
  EXPECT_TRUE(d.ok());
  EXPECT_EQ(slots.in_use(), 2u);
  EXPECT_EQ(slots.peak(), 2u);
}

TEST(ReceiveSlotsTest, AWaiterTimesOutWhenTheClockPassesItsDeadline) {
  FakeClock clock;
  ReceiveSlots slots(1, clock);
  absl::StatusOr<ReceiveSlots::Slot> held = slots.Acquire(Never, absl::Seconds(1));
  ASSERT_TRUE(held.ok());
  absl::Status status;
  std::thread waiter(
      [&] { status = slots.Acquire(Never, absl::Seconds(30), absl::Milliseconds(1)).status(); });
  AwaitWaiters(slots, 1);
  clock.Advance(absl::Seconds(29));
  EXPECT_EQ(slots.waiting(), 1u);  // still before its deadline (it may poll meanwhile)
  clock.Advance(absl::Seconds(1));
  waiter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(slots.waiting(), 0u);
  EXPECT_EQ(slots.in_use(), 1u);
}

TEST(ReceiveSlotsTest, AWaiterTakesTheSlotWhenItIsGivenBack) {
  FakeClock clock;  // never moves: only a freed slot ends the wait
  ReceiveSlots slots(1, clock);
  std::optional<ReceiveSlots::Slot> held;
  held.emplace(*slots.Acquire(Never, absl::Seconds(1)));
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    absl::StatusOr<ReceiveSlots::Slot> slot =
        slots.Acquire(Never, absl::Seconds(30), absl::InfiniteDuration());
    EXPECT_TRUE(slot.ok()) << slot.status();
    got.store(true);
  });
  AwaitWaiters(slots, 1);
  EXPECT_FALSE(got.load());
  EXPECT_EQ(slots.in_use(), 1u);
  held.reset();
  waiter.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(slots.in_use(), 0u);
  EXPECT_EQ(slots.waiting(), 0u);
}

TEST(ReceiveSlotsTest, SlotsGoToWaitersInTheOrderTheyCame) {
  FakeClock clock;
  ReceiveSlots slots(1, clock);
  std::optional<ReceiveSlots::Slot> held;
  held.emplace(*slots.Acquire(Never, absl::Seconds(1)));
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::thread> waiters;
  for (int w = 0; w < 4; ++w) {
    waiters.emplace_back([&, w] {
      absl::StatusOr<ReceiveSlots::Slot> slot =
          slots.Acquire(Never, absl::Seconds(30), absl::InfiniteDuration());
      ASSERT_TRUE(slot.ok()) << slot.status();
      absl::MutexLock lock(&mu);
      order.push_back(w);  // recorded while the only slot is held
    });
    AwaitWaiters(slots, w + 1);  // each is waiting before the next comes
  }
  held.reset();
  for (std::thread& t : waiters) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(slots.in_use(), 0u);
}

TEST(ReceiveSlotsTest, AWaiterThatGivesUpStopsWaitingWithinAPoll) {
  FakeClock clock;
  ReceiveSlots slots(1, clock);
  absl::StatusOr<ReceiveSlots::Slot> held = slots.Acquire(Never, absl::Seconds(1));
  ASSERT_TRUE(held.ok());
  std::atomic<bool> gone{false};
  absl::Status status;
  std::thread waiter([&] {
    status = slots.Acquire([&] { return gone.load(); }, absl::Seconds(30), absl::Milliseconds(1))
                 .status();
  });
  AwaitWaiters(slots, 1);
  gone.store(true);
  waiter.join();  // no slot is given back: only a poll sees `gone`
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(slots.in_use(), 1u);
  EXPECT_EQ(slots.waiting(), 0u);
}

TEST(ReceiveSlotsTest, AMovedSlotIsGivenBackOnce) {
  FakeClock clock;
  ReceiveSlots slots(2, clock);
  {
    ReceiveSlots::Slot a = *slots.Acquire(Never, absl::Seconds(1));
    ReceiveSlots::Slot b = std::move(a);
    EXPECT_EQ(slots.in_use(), 1u);
    ReceiveSlots::Slot c = *slots.Acquire(Never, absl::Seconds(1));
    EXPECT_EQ(slots.in_use(), 2u);
    c = std::move(b);  // c's own slot is given back, b's moves in
    EXPECT_EQ(slots.in_use(), 1u);
  }
  EXPECT_EQ(slots.in_use(), 0u);
}

TEST(ReceiveSlotsTest, ManyThreadsNeverHoldMoreThanTheCapacity) {
  FakeClock clock;
  ReceiveSlots slots(3, clock);
  std::atomic<int> holding{0};
  std::atomic<int> most{0};
  std::atomic<int> first_held{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        absl::StatusOr<ReceiveSlots::Slot> slot =
            slots.Acquire(Never, absl::Seconds(30), absl::InfiniteDuration());
        ASSERT_TRUE(slot.ok()) << slot.status();
        const int now = ++holding;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        if (i == 0 && t < 3) {
          // The first three threads hold their first slots together: the set does fill up.
          ++first_held;
          while (first_held.load() < 3) std::this_thread::yield();
        }
        std::this_thread::yield();
        --holding;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(most.load(), 3);
  EXPECT_EQ(slots.peak(), 3u);
  EXPECT_EQ(slots.in_use(), 0u);
}

}  // namespace
}  // namespace aloe
