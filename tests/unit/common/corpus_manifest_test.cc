#include "common/corpus_manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status_matchers.h"
#include "common/token_shard.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A fresh, existing corpus directory per test. TempDir() ends with a '/'.
std::string MakeTempDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir = absl::StrFormat("%scorpus_manifest_test_%d_%s", ::testing::TempDir(),
                                          ::getpid(), info->name());
  ::mkdir(dir.c_str(), 0755);
  ::mkdir((dir + "/shards").c_str(), 0755);
  return dir;
}

void WriteManifestText(const std::string& dir, const std::string& text) {
  std::ofstream out(CorpusManifestPath(dir), std::ios::binary | std::ios::trunc);
  out << text;
}

const char kHeader[] = "# name\tfile\ttokens\tsplit\n";

std::vector<CorpusShardInfo> SampleShards() {
  return {{"abraham_lincoln", "shards/abraham_lincoln.tok", 3, false},
          {"george_washington", "shards/george_washington.tok", 2, false},
          {"heldout", "shards/heldout.tok", 1, true}};
}

TEST(CorpusManifestTest, RoundTrips) {
  const std::string dir = MakeTempDir();
  ASSERT_THAT(WriteCorpusManifest(dir, SampleShards()), IsOk());
  absl::StatusOr<std::vector<CorpusShardInfo>> loaded = LoadCorpusManifest(dir);
  ASSERT_THAT(loaded, IsOk());
  EXPECT_EQ(*loaded, SampleShards());
}

TEST(CorpusManifestTest, WritesTheDocumentedText) {
  const std::string dir = MakeTempDir();
  ASSERT_THAT(WriteCorpusManifest(dir, {{"a", "shards/a.tok", 12, false},
                                        {"heldout", "shards/heldout.tok", 5, true}}),
              IsOk());
  std::ifstream in(CorpusManifestPath(dir));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, std::string(kHeader) +
                      "a\tshards/a.tok\t12\ttrain\n"
                      "heldout\tshards/heldout.tok\t5\theldout\n");
  EXPECT_NE(::access((CorpusManifestPath(dir) + ".tmp").c_str(), F_OK), 0);
}

TEST(CorpusManifestTest, SkipsBlankLinesAndToleratesCrlf) {
  const std::string dir = MakeTempDir();
  WriteManifestText(dir, "# name\tfile\ttokens\tsplit\r\n\na\tshards/a.tok\t7\ttrain\r\n\n");
  absl::StatusOr<std::vector<CorpusShardInfo>> loaded = LoadCorpusManifest(dir);
  ASSERT_THAT(loaded, IsOk());
  EXPECT_THAT(*loaded, ElementsAre(CorpusShardInfo{"a", "shards/a.tok", 7, false}));
}

TEST(CorpusManifestTest, MissingManifestIsNotFoundNamingThePath) {
  const std::string dir = MakeTempDir();
  EXPECT_THAT(LoadCorpusManifest(dir),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr(dir + "/manifest.tsv"), HasSubstr("no such file"))));
}

TEST(CorpusManifestTest, MalformedRowNamesItsLineNumber) {
  const std::string dir = MakeTempDir();
  WriteManifestText(dir, std::string(kHeader) +
                             "a\tshards/a.tok\t7\ttrain\n"
                             "b shards/b.tok 8 train\n");
  EXPECT_THAT(LoadCorpusManifest(dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(CorpusManifestPath(dir)), HasSubstr("line 3"),
                             HasSubstr("4 tab-separated fields"))));
}

TEST(CorpusManifestTest, WrongHeaderIsLineOne) {
  const std::string dir = MakeTempDir();
  WriteManifestText(dir, "a\tshards/a.tok\t7\ttrain\n");
  EXPECT_THAT(LoadCorpusManifest(dir), StatusIs(absl::StatusCode::kInvalidArgument,
                                                AllOf(HasSubstr("line 1"), HasSubstr("header"))));
}

TEST(CorpusManifestTest, EmptyManifestIsInvalid) {
  const std::string dir = MakeTempDir();
  WriteManifestText(dir, "");
  EXPECT_THAT(LoadCorpusManifest(dir),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 1")));
}

TEST(CorpusManifestTest, RejectsBadTokenCounts) {
  const std::string dir = MakeTempDir();
  for (const char* tokens : {"", "-3", "+3", "3x", " 3", "99999999999999999999"}) {
    WriteManifestText(dir, absl::StrFormat("%sa\tshards/a.tok\t%s\ttrain\n", kHeader, tokens));
    EXPECT_THAT(LoadCorpusManifest(dir),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("line 2"), HasSubstr("token count"))))
        << "tokens field: \"" << tokens << "\"";
  }
}

TEST(CorpusManifestTest, RejectsZeroTokens) {
  const std::string dir = MakeTempDir();
  WriteManifestText(dir, std::string(kHeader) + "a\tshards/a.tok\t0\ttrain\n");
  EXPECT_THAT(LoadCorpusManifest(dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("line 2"), HasSubstr("zero tokens"))));
}

TEST(CorpusManifestTest, RejectsUnknownSplit) {
  const std::string dir = MakeTempDir();
  WriteManifestText(dir, std::string(kHeader) + "a\tshards/a.tok\t4\ttrain\n" +
                             "b\tshards/b.tok\t4\tvalidation\n");
  EXPECT_THAT(LoadCorpusManifest(dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("line 3"), HasSubstr("unknown split \"validation\""))));
}

TEST(CorpusManifestTest, RejectsDuplicateNamesNamingBothLines) {
  const std::string dir = MakeTempDir();
  WriteManifestText(dir, std::string(kHeader) + "a\tshards/a.tok\t4\ttrain\n" +
                             "b\tshards/b.tok\t4\ttrain\n" + "a\tshards/a2.tok\t4\ttrain\n");
  EXPECT_THAT(LoadCorpusManifest(dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("line 4"), HasSubstr("duplicate shard name a"),
                             HasSubstr("first on line 2"))));
}

TEST(CorpusManifestTest, RejectsPathsOutsideTheCorpus) {
  const std::string dir = MakeTempDir();
  for (const char* file : {"/etc/passwd", "../other/a.tok", "shards/../../a.tok"}) {
    WriteManifestText(dir, absl::StrFormat("%sa\t%s\t4\ttrain\n", kHeader, file));
    EXPECT_THAT(LoadCorpusManifest(dir),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 2")))
        << file;
  }
}

TEST(CorpusManifestTest, RequiresATrainShard) {
  const std::string dir = MakeTempDir();
  WriteManifestText(dir, std::string(kHeader) + "heldout\tshards/heldout.tok\t4\theldout\n");
  EXPECT_THAT(LoadCorpusManifest(dir),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no train shard")));
}

TEST(CorpusManifestTest, WriteRefusesWhatLoadWouldReject) {
  const std::string dir = MakeTempDir();
  EXPECT_THAT(WriteCorpusManifest(dir, {{"a", "shards/a.tok", 0, false}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("zero tokens")));
  EXPECT_THAT(WriteCorpusManifest(dir, {{"a\tb", "shards/a.tok", 1, false}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tabs or newlines")));
  EXPECT_THAT(
      WriteCorpusManifest(dir, {{"a", "shards/a.tok", 1, false}, {"a", "shards/b.tok", 1, false}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate")));
  EXPECT_THAT(WriteCorpusManifest(dir, {{"h", "shards/h.tok", 1, true}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no train shard")));
  EXPECT_NE(::access(CorpusManifestPath(dir).c_str(), F_OK), 0);
}

TEST(CorpusManifestTest, VerifyAcceptsMatchingShards) {
  const std::string dir = MakeTempDir();
  ASSERT_THAT(WriteTokenShard(dir + "/shards/a.tok", {1, 2, 3}, 256), IsOk());
  ASSERT_THAT(WriteTokenShard(dir + "/shards/h.tok", {4}, 256), IsOk());
  EXPECT_THAT(
      VerifyCorpusShards(dir, {{"a", "shards/a.tok", 3, false}, {"h", "shards/h.tok", 1, true}}),
      IsOk());
}

TEST(CorpusManifestTest, VerifyReportsMissingShard) {
  const std::string dir = MakeTempDir();
  EXPECT_THAT(VerifyCorpusShards(dir, {{"a", "shards/a.tok", 3, false}}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("shards/a.tok")));
}

TEST(CorpusManifestTest, VerifyReportsCountMismatch) {
  const std::string dir = MakeTempDir();
  ASSERT_THAT(WriteTokenShard(dir + "/shards/a.tok", {1, 2, 3}, 256), IsOk());
  EXPECT_THAT(VerifyCorpusShards(dir, {{"a", "shards/a.tok", 4, false}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("shards/a.tok"), HasSubstr("holds 3 tokens"),
                             HasSubstr("lists 4"))));
}

TEST(CorpusManifestTest, VerifyReportsMixedVocabSizes) {
  const std::string dir = MakeTempDir();
  ASSERT_THAT(WriteTokenShard(dir + "/shards/a.tok", {1}, 256), IsOk());
  ASSERT_THAT(WriteTokenShard(dir + "/shards/b.tok", {1}, 512), IsOk());
  EXPECT_THAT(
      VerifyCorpusShards(dir, {{"a", "shards/a.tok", 1, false}, {"b", "shards/b.tok", 1, false}}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("shards/b.tok"), HasSubstr("vocab_size 512"))));
}

TEST(CorpusManifestTest, PropertiesRoundTripAfterTheHeader) {
  const std::string dir = MakeTempDir();
  CorpusInfo corpus;
  corpus.tokenizer = "gpt2";
  corpus.vocab_size = 50257;
  corpus.format = TokenFileFormat::kLlmc;
  corpus.shards = {{"train_000001", "shards/train_000001.bin", 9, false},
                   {"val_000000", "shards/val_000000.bin", 4, true}};
  ASSERT_THAT(WriteCorpusManifest(dir, corpus), IsOk());
  std::ifstream in(CorpusManifestPath(dir));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, std::string(kHeader) +
                      "# tokenizer\tgpt2\n# vocab_size\t50257\n# format\tllmc\n"
                      "train_000001\tshards/train_000001.bin\t9\ttrain\n"
                      "val_000000\tshards/val_000000.bin\t4\theldout\n");
  absl::StatusOr<CorpusInfo> loaded = LoadCorpusInfo(dir);
  ASSERT_THAT(loaded, IsOk());
  EXPECT_EQ(loaded->tokenizer, "gpt2");
  EXPECT_EQ(loaded->vocab_size, 50257u);
  EXPECT_EQ(loaded->format, TokenFileFormat::kLlmc);
  EXPECT_EQ(loaded->shards, corpus.shards);
  // The old reader of rows only still works on the new file.
  EXPECT_THAT(LoadCorpusManifest(dir), IsOk());
}

TEST(CorpusManifestTest, RefusesBadPropertiesNamingTheLine) {
  const std::string dir = MakeTempDir();
  WriteManifestText(dir, std::string(kHeader) + "# vocab\t5\na\tshards/a.tok\t1\ttrain\n");
  EXPECT_THAT(LoadCorpusInfo(dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("line 2"), HasSubstr("unknown property \"vocab\""))));
  WriteManifestText(dir, std::string(kHeader) + "# vocab_size\t-3\na\tshards/a.tok\t1\ttrain\n");
  EXPECT_THAT(LoadCorpusInfo(dir),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a positive integer")));
  WriteManifestText(dir, std::string(kHeader) + "# format\tnpy\na\tshards/a.tok\t1\ttrain\n");
  EXPECT_THAT(LoadCorpusInfo(dir),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("llmc or uint16")));
  // Token files without a header need the vocab_size from the manifest.
  WriteManifestText(dir, std::string(kHeader) + "# format\tuint16\na\tshards/a.bin\t1\ttrain\n");
  EXPECT_THAT(LoadCorpusInfo(dir), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("format uint16 needs a vocab_size")));
}

TEST(CorpusManifestTest, VocabSizeComesFromThePropertyOrTheFirstShard) {
  const std::string dir = MakeTempDir();
  ASSERT_THAT(WriteTokenShard(dir + "/shards/a.tok", {1, 2}, 300), IsOk());
  ASSERT_THAT(WriteCorpusManifest(dir, {{"a", "shards/a.tok", 2, false}}), IsOk());
  EXPECT_THAT(
      CorpusVocabSize(dir),
      ::testing::AllOf(IsOk(), ::testing::Property(&absl::StatusOr<uint32_t>::value, 300u)));
  CorpusInfo corpus;
  corpus.vocab_size = 50257;
  corpus.format = TokenFileFormat::kUint16;
  corpus.shards = {{"a", "shards/a.bin", 2, false}};
  ASSERT_THAT(WriteCorpusManifest(dir, corpus), IsOk());
  EXPECT_THAT(
      CorpusVocabSize(dir),
      ::testing::AllOf(IsOk(), ::testing::Property(&absl::StatusOr<uint32_t>::value, 50257u)));
}

TEST(CorpusManifestTest, ShardCacheReadsTheFormatOfTheManifest) {
  const std::string dir = MakeTempDir();
  const uint16_t tokens[] = {50256, 7, 11};
  std::ofstream(dir + "/shards/a.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens), sizeof(tokens));
  CorpusInfo corpus;
  corpus.tokenizer = "gpt2";
  corpus.vocab_size = 50257;
  corpus.format = TokenFileFormat::kUint16;
  corpus.shards = {{"a", "shards/a.bin", 3, false}};
  ASSERT_THAT(WriteCorpusManifest(dir, corpus), IsOk());
  EXPECT_THAT(VerifyCorpus(dir, corpus), IsOk());
  TokenShardCache cache(dir);
  absl::StatusOr<const TokenShard*> shard = cache.Get("shards/a.bin");
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->vocab_size(), 50257u);
  int64_t read[3];
  (*shard)->Read(0, 3, read);
  EXPECT_THAT(read, ElementsAre(50256, 7, 11));
  // Declared 4 tokens where the file holds 3.
  corpus.shards[0].tokens = 4;
  EXPECT_THAT(VerifyCorpus(dir, corpus),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds 3 tokens")));
}

}  // namespace
}  // namespace aloe
