#include "common/durable_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "common/status_matchers.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string Dir(const std::string& name) {
  const std::string dir =
      ::testing::TempDir() + "/durable_" + name + "_" + std::to_string(getpid());
  EXPECT_THAT(MakeDirectories(dir), IsOk());
  return dir;
}

TEST(DurableFileTest, Crc32cCheckValue) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);  // the standard CRC-32C check value
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(DurableFileTest, ReplacesTheFileWhole) {
  const std::string path = Dir("replace") + "/f";
  ASSERT_THAT(WriteFileAtomically(path, "first"), IsOk());
  ASSERT_THAT(WriteFileAtomically(path, "second, longer"), IsOk());
  EXPECT_EQ(ReadWholeFile(path).value(), "second, longer");
  EXPECT_THAT(ReadWholeFile(path + ".tmp").status(),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST(DurableFileTest, MakesEveryMissingParent) {
  const std::string dir = Dir("parents") + "/a/b/c";
  ASSERT_THAT(MakeDirectories(dir), IsOk());
  ASSERT_THAT(MakeDirectories(dir), IsOk());  // already there
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  const std::string file = Dir("parents_file") + "/plain";
  ASSERT_THAT(WriteFileAtomically(file, "x"), IsOk());
  EXPECT_THAT(MakeDirectories(file + "/below"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr(file)));
}

// A file that outgrows the file size limit (EFBIG, as a full quota or a small volume would give
// ENOSPC) fails naming the file and the reason, and leaves the old file as it was.
TEST(DurableFileTest, AWriteThatCannotFinishLeavesTheOldFileAndNoTemporary) {
  const std::string path = Dir("efbig") + "/f";
  ASSERT_THAT(WriteFileAtomically(path, "old contents"), IsOk());
  rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const sighandler_t old_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = 64;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status status = WriteFileAtomically(path, std::string(4096, 'x'));
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable,
                               AllOf(HasSubstr(path + ".tmp"), HasSubstr("write failed"),
                                     HasSubstr("File too large"))));
  EXPECT_EQ(ReadWholeFile(path).value(), "old contents");
  EXPECT_THAT(ReadWholeFile(path + ".tmp").status(),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST(DurableFileTest, MissingDirectoryAndMissingFileAreNamed) {
  const std::string dir = Dir("missing");
  EXPECT_THAT(WriteFileAtomically(dir + "/no/such/f", "x"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr(dir + "/no/such/f.tmp")));
  EXPECT_THAT(ReadWholeFile(dir + "/absent").status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(dir + "/absent")));
}

}  // namespace
}  // namespace aloe
