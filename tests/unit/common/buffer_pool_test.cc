#include "common/buffer_pool.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace aloe {
namespace {

TEST(FloatBufferPoolTest, NewBuffersAreZeroedAndGivenBuffersComeBackBySize) {
  auto pool = FloatBufferPool::Create(1 << 20);
  std::vector<float> a = pool->Take(1000);
  ASSERT_EQ(a.size(), 1000u);
  for (float v : a) ASSERT_EQ(v, 0.0f);
  EXPECT_EQ(pool->reused(), 0u);
  a[7] = 3.5f;
  const float* memory = a.data();
  pool->Give(std::move(a));
  EXPECT_EQ(pool->idle(), 1u);

  // Another size does not get it.
  EXPECT_EQ(pool->Take(999).size(), 999u);
  EXPECT_EQ(pool->reused(), 0u);
  // The same size does: the same memory, contents as left (not cleared).
  std::vector<float> b = pool->Take(1000);
  EXPECT_EQ(b.data(), memory);
  EXPECT_EQ(b[7], 3.5f);
  EXPECT_EQ(pool->reused(), 1u);
  EXPECT_EQ(pool->idle(), 0u);
  pool->Give(std::vector<float>());  // empty: ignored
  EXPECT_EQ(pool->idle(), 0u);
}

TEST(FloatBufferPoolTest, IdleBytesStayWithinTheBound) {
  auto pool = FloatBufferPool::Create(1000);                       // bytes
  for (int i = 0; i < 5; ++i) pool->Give(std::vector<float>(64));  // 256 bytes each: 3 fit
  EXPECT_EQ(pool->idle(), 3u);
  EXPECT_EQ(pool->idle_bytes(), 768u);
  pool->Give(std::vector<float>(100));  // 400 more would exceed 1000
  pool->Give(std::vector<float>(58));   // 232 more fits exactly
  EXPECT_EQ(pool->idle(), 4u);
  EXPECT_EQ(pool->idle_bytes(), 1000u);
  EXPECT_EQ(pool->Take(64).size(), 64u);
  EXPECT_EQ(pool->idle_bytes(), 744u);
  auto none = FloatBufferPool::Create(0);
  none->Give(std::vector<float>(64));
  EXPECT_EQ(none->idle(), 0u);
}

TEST(FloatBufferPoolTest, SharedBuffersReturnWhenTheLastOwnerLetsGo) {
  auto pool = FloatBufferPool::Create(1 << 20);
  std::shared_ptr<std::vector<float>> p = pool->MakeShared(256);
  ASSERT_EQ(p->size(), 256u);
  const float* memory = p->data();
  std::shared_ptr<std::vector<float>> reader = p;  // a pull still streaming it
  p.reset();
  EXPECT_EQ(pool->idle(), 0u);
  reader.reset();
  EXPECT_EQ(pool->idle(), 1u);
  EXPECT_EQ(pool->MakeShared(256)->data(), memory);
  EXPECT_EQ(pool->reused(), 1u);
}

TEST(FloatBufferPoolTest, SharedBuffersMayOutliveThePool) {
  auto pool = FloatBufferPool::Create(1 << 20);
  std::shared_ptr<std::vector<float>> p = pool->MakeShared(128);
  pool.reset();
  (*p)[0] = 1.0f;  // still valid; freed by its deleter below without a pool
  p.reset();
}

TEST(FloatBufferPoolTest, ConcurrentTakeAndGiveNeverShareABuffer) {
  auto pool = FloatBufferPool::Create(8 * 512 * sizeof(float));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t] {
      for (int i = 0; i < 2000; ++i) {
        std::vector<float> b = pool->Take(512);
        for (float& v : b) v = static_cast<float>(t);
        for (float v : b) ASSERT_EQ(v, static_cast<float>(t));  // nobody else wrote into it
        pool->Give(std::move(b));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(pool->idle(), 8u);
  EXPECT_GT(pool->reused(), 0u);
}

}  // namespace
}  // namespace aloe
