#include "common/executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace aloe {
namespace {

TEST(ExecutorTest, ThreadPoolRunsEveryIndexExactlyOnceAcrossCalls) {
  ThreadPoolExecutor pool(3);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> hits(17);
    pool.ParallelFor(17, [&](int i) { hits[i].fetch_add(1); });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
  pool.ParallelFor(0, [](int) { FAIL(); });
}

TEST(ExecutorTest, InlineRunsInOrder) {
  InlineExecutor inline_executor;
  std::vector<int> order;
  inline_executor.ParallelFor(4, [&](int i) { order.push_back(i); });
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace aloe
