#include "server/core/checkpoint_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "common/status_matchers.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/ckpt_" + name + "_" + std::to_string(getpid());
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
  return dir;
}

v1::ServerCheckpoint Checkpoint(uint64_t version) {
  v1::ServerCheckpoint c;
  c.set_format(1);
  c.set_version(version);
  c.add_layer_params(std::string(1000, static_cast<char>(version)));
  return c;
}

TEST(CheckpointStoreTest, KeepsTheNewestAndLoadsTheLatest) {
  CheckpointStore store(FreshDir("keep"), 3);
  for (uint64_t v : {2, 4, 6, 8}) ASSERT_THAT(store.Write(Checkpoint(v)), IsOk());
  const std::vector<std::string> files = store.List();
  ASSERT_EQ(files.size(), 3u);
  EXPECT_THAT(files[0], HasSubstr("checkpoint-000000000008.aloeckpt"));
  EXPECT_THAT(files[2], HasSubstr("checkpoint-000000000004.aloeckpt"));
  auto loaded = store.LoadLatest();
  ASSERT_THAT(loaded, IsOk());
  EXPECT_EQ(loaded->checkpoint.version(), 8u);
  EXPECT_EQ(loaded->checkpoint.layer_params(0), std::string(1000, '\x08'));
  EXPECT_TRUE(loaded->skipped.empty());
}

TEST(CheckpointStoreTest, CorruptOrTruncatedFilesFallBackToThePreviousOne) {
  const std::string dir = FreshDir("corrupt");
  CheckpointStore store(dir, 5);
  for (uint64_t v : {1, 2, 3}) ASSERT_THAT(store.Write(Checkpoint(v)), IsOk());
  const std::vector<std::string> files = store.List();
  {  // flip one payload byte of the newest
    std::fstream f(files[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(500);
    f.put('Z');
  }
  ASSERT_EQ(::truncate(files[1].c_str(), 100), 0);  // cut the second newest
  auto loaded = store.LoadLatest();
  ASSERT_THAT(loaded, IsOk());
  EXPECT_EQ(loaded->checkpoint.version(), 1u);
  ASSERT_EQ(loaded->skipped.size(), 2u);
  EXPECT_THAT(loaded->skipped[0], HasSubstr("checksum mismatch"));
  EXPECT_THAT(loaded->skipped[1], HasSubstr("truncated"));
  ASSERT_EQ(::truncate(files[2].c_str(), 10), 0);
  EXPECT_THAT(store.LoadLatest(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("all 3 checkpoints")));
  EXPECT_THAT(CheckpointStore(FreshDir("empty"), 3).LoadLatest(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no checkpoints")));
}

}  // namespace
}  // namespace aloe::server
