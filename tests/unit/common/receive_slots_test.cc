#include "common/receive_slots.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace aloe {
namespace {

using ::testing::HasSubstr;

bool Never() { return false; }

TEST(ReceiveSlotsTest, AtMostCapacityAreHeldAndAFullSetRefusesAfterTheWait) {
  ReceiveSlots slots(2);
  absl::StatusOr<ReceiveSlots::Slot> a = slots.Acquire(Never, absl::Seconds(1));
  absl::StatusOr<ReceiveSlots::Slot> b = slots.Acquire(Never, absl::Seconds(1));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(slots.in_use(), 2u);

  const absl::Time start = absl::Now();
  absl::StatusOr<ReceiveSlots::Slot> c = slots.Acquire(Never, absl::Milliseconds(150));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(150));
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("2 pushes are being received (max_staged_updates)"));
  EXPECT_EQ(slots.in_use(), 2u);  // the refusal took nothing

  a = absl::CancelledError("dropped");  // destroys the first slot
  EXPECT_EQ(slots.in_use(), 1u);
  absl::StatusOr<ReceiveSlots::Slot> d = slots.Acquire(Never, absl::ZeroDuration());
  EXPECT_TRUE(d.ok());
  EXPECT_EQ(slots.in_use(), 2u);
  EXPECT_EQ(slots.peak(), 2u);
}

TEST(ReceiveSlotsTest, AWaiterTakesTheSlotWhenItIsGivenBack) {
  ReceiveSlots slots(1);
  std::optional<ReceiveSlots::Slot> held;
  held.emplace(*slots.Acquire(Never, absl::Seconds(1)));
  absl::Notification got;
  std::thread waiter([&] {
    absl::StatusOr<ReceiveSlots::Slot> slot = slots.Acquire(Never, absl::Seconds(30));
    EXPECT_TRUE(slot.ok()) << slot.status();
    got.Notify();
  });
  EXPECT_FALSE(got.WaitForNotificationWithTimeout(absl::Milliseconds(300)));
  held.reset();
  EXPECT_TRUE(got.WaitForNotificationWithTimeout(absl::Seconds(10)));
  waiter.join();
  EXPECT_EQ(slots.in_use(), 0u);
}

TEST(ReceiveSlotsTest, SlotsGoToWaitersInTheOrderTheyCame) {
  ReceiveSlots slots(1);
  std::optional<ReceiveSlots::Slot> held;
  held.emplace(*slots.Acquire(Never, absl::Seconds(1)));
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::thread> waiters;
  for (int w = 0; w < 4; ++w) {
    waiters.emplace_back([&, w] {
      absl::StatusOr<ReceiveSlots::Slot> slot = slots.Acquire(Never, absl::Seconds(30));
      ASSERT_TRUE(slot.ok()) << slot.status();
      {
        absl::MutexLock lock(&mu);
        order.push_back(w);
      }
      absl::SleepFor(absl::Milliseconds(20));
    });
    absl::SleepFor(absl::Milliseconds(100));  // each is waiting before the next comes
  }
  held.reset();
  for (std::thread& t : waiters) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(slots.in_use(), 0u);
}

TEST(ReceiveSlotsTest, AWaiterThatGivesUpStopsWaitingWithinAPoll) {
  ReceiveSlots slots(1);
  absl::StatusOr<ReceiveSlots::Slot> held = slots.Acquire(Never, absl::Seconds(1));
  ASSERT_TRUE(held.ok());
  std::atomic<bool> gone{false};
  absl::Notification done;
  absl::Status status;
  std::thread waiter([&] {
    status = slots.Acquire([&] { return gone.load(); }, absl::Seconds(30), absl::Milliseconds(20))
                 .status();
    done.Notify();
  });
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  gone.store(true);
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  waiter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(slots.in_use(), 1u);
}

TEST(ReceiveSlotsTest, AMovedSlotIsGivenBackOnce) {
  ReceiveSlots slots(2);
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
  ReceiveSlots slots(3);
  std::atomic<int> holding{0};
  std::atomic<int> most{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 300; ++i) {
        absl::StatusOr<ReceiveSlots::Slot> slot = slots.Acquire(Never, absl::Seconds(30));
        ASSERT_TRUE(slot.ok()) << slot.status();
        const int now = ++holding;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        --holding;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(most.load(), 3);
  EXPECT_GE(most.load(), 2);  // the threads did overlap
  EXPECT_LE(slots.peak(), 3u);
  EXPECT_EQ(slots.in_use(), 0u);
}

}  // namespace
}  // namespace aloe
