#include "common/corpus_inputs.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status_matchers.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TestDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir =
      absl::StrFormat("%scorpus_inputs_test_%d_%s", ::testing::TempDir(), ::getpid(), info->name());
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::vector<std::string> Names(const std::vector<InputFile>& files) {
  std::vector<std::string> names;
  for (const InputFile& f : files) names.push_back(f.file_name);
  return names;
}

TEST(CorpusInputsTest, ListsTextFilesOfTheFormatInNameOrder) {
  const std::string dir = TestDir();
  WriteFile(dir + "/b.txt", "b");
  WriteFile(dir + "/a.jsonl", "{}");
  WriteFile(dir + "/c.txt", "c");
  WriteFile(dir + "/notes.md", "ignored");
  absl::StatusOr<std::vector<InputFile>> all = ListInputFiles(dir, InputFormat::kAuto);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(Names(*all), ElementsAre("a.jsonl", "b.txt", "c.txt"));
  EXPECT_EQ((*all)[0].format, InputFormat::kJsonl);
  EXPECT_EQ((*all)[0].stem, "a");
  EXPECT_EQ((*all)[1].format, InputFormat::kText);
  absl::StatusOr<std::vector<InputFile>> txt = ListInputFiles(dir, InputFormat::kText);
  ASSERT_THAT(txt, IsOk());
  EXPECT_THAT(Names(*txt), ElementsAre("b.txt", "c.txt"));
  EXPECT_THAT(ListInputFiles(dir, InputFormat::kUint16),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no .bin files")));
}

TEST(CorpusInputsTest, AutoTakesAFolderOfBinFilesAsLlmcAndRefusesAMix) {
  const std::string dir = TestDir();
  WriteFile(dir + "/fineweb_val_000000.bin", "x");
  WriteFile(dir + "/fineweb_train_000001.bin", "x");
  absl::StatusOr<std::vector<InputFile>> bins = ListInputFiles(dir, InputFormat::kAuto);
  ASSERT_THAT(bins, IsOk());
  EXPECT_THAT(Names(*bins), ElementsAre("fineweb_train_000001.bin", "fineweb_val_000000.bin"));
  EXPECT_EQ((*bins)[0].format, InputFormat::kLlmc);
  WriteFile(dir + "/readme.txt", "x");
  EXPECT_THAT(ListInputFiles(dir, InputFormat::kAuto),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--input_format")));
  EXPECT_THAT(ListInputFiles(dir + "/none", InputFormat::kAuto),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no such directory")));
}

TEST(CorpusInputsTest, ReadsTheNamedFieldOfEachRecord) {
  const std::string dir = TestDir();
  const std::string path = dir + "/docs.jsonl";
  WriteFile(path,
            "{\"id\": 1, \"text\": \"first \\\"doc\\\"\\nline two\", \"meta\": {\"a\": [1, "
            "{\"b\": null}]}}\n"
            "\n"
            "  {\"text\": \"caf\\u00e9 \\ud83d\\ude00\", \"score\": -1.5e3, \"ok\": true}\r\n"
            "{\"body\": \"x\", \"text\": \"third\"}");  // no final newline
  absl::StatusOr<std::vector<std::string>> docs = ReadJsonlDocuments(path, "text");
  ASSERT_THAT(docs, IsOk());
  EXPECT_THAT(*docs,
              ElementsAre("first \"doc\"\nline two", "caf\xc3\xa9 \xf0\x9f\x98\x80", "third"));
  absl::StatusOr<std::vector<std::string>> bodies = ReadJsonlDocuments(path, "body");
  EXPECT_THAT(bodies, StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr(path + ": byte offset 0: the record has no \"body\"")));
  InputFile file{"docs.jsonl", "docs", path, InputFormat::kJsonl};
  absl::StatusOr<std::string> text = ReadInputText(file, "text", "|");
  ASSERT_THAT(text, IsOk());
  EXPECT_EQ(*text, "first \"doc\"\nline two|caf\xc3\xa9 \xf0\x9f\x98\x80|third");
}

TEST(CorpusInputsTest, RefusesMalformedRecordsNamingFileAndByteOffset) {
  const std::string dir = TestDir();
  const std::string path = dir + "/bad.jsonl";
  auto read = [&](const std::string& contents) {
    WriteFile(path, contents);
    return ReadJsonlDocuments(path, "text").status();
  };
  // Line 2 starts at byte 15; its value is cut off at byte 28.
  EXPECT_THAT(read("{\"text\": \"ok\"}\n{\"text\": \"cut"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path + ": byte offset 28"), HasSubstr("truncated"))));
  EXPECT_THAT(read("{\"text\": 5}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("byte offset 9: field \"text\" is not a string")));
  EXPECT_THAT(read("[\"text\"]\n"), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("byte offset 0: expected '{'")));
  EXPECT_THAT(read("{\"text\": \"a\"} {\"text\": \"b\"}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("byte offset 14: trailing data after the record")));
  EXPECT_THAT(
      read("{\"text\": \"bad \\q escape\"}\n"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte offset 14: bad escape")));
  EXPECT_THAT(read("{\"text\" \"x\"}\n"), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   HasSubstr("byte offset 8: expected ':'")));
}

TEST(CorpusInputsTest, ParsesJsonlFromMemoryLikeTheFile) {
  const std::string dir = TestDir();
  const std::string path = dir + "/mem.jsonl";
  const std::string contents = "{\"text\": \"a\"}\r\n\n{\"text\": \"b\", \"n\": [1]}\n";
  WriteFile(path, contents);
  const absl::StatusOr<std::vector<std::string>> parsed =
      ParseJsonlDocuments(contents, "mem.jsonl", "text");
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(*parsed, ElementsAre("a", "b"));
  const absl::StatusOr<std::vector<std::string>> read = ReadJsonlDocuments(path, "text");
  ASSERT_THAT(read, IsOk());
  EXPECT_EQ(*read, *parsed);
  EXPECT_THAT(ParseJsonlDocuments(contents + "{\"text\": 1}", "mem.jsonl", "text"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("mem.jsonl: byte offset 49: field \"text\" is not a string")));
}

TEST(CorpusInputsTest, HeldoutTokenFilesAreNamedVal) {
  EXPECT_TRUE(IsHeldoutTokenFile("val"));
  EXPECT_TRUE(IsHeldoutTokenFile("fineweb_val_000000"));
  EXPECT_TRUE(IsHeldoutTokenFile("tiny-validation"));
  EXPECT_FALSE(IsHeldoutTokenFile("train"));
  EXPECT_FALSE(IsHeldoutTokenFile("fineweb_train_000001"));
  EXPECT_FALSE(IsHeldoutTokenFile("interval"));
}

TEST(CorpusInputsTest, ParsesFormatNames) {
  absl::StatusOr<InputFormat> f = ParseInputFormat("jsonl");
  ASSERT_THAT(f, IsOk());
  EXPECT_EQ(*f, InputFormat::kJsonl);
  EXPECT_THAT(ParseInputFormat("csv"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("auto, txt, jsonl")));
  EXPECT_TRUE(IsTokenFileFormat(InputFormat::kUint16));
  EXPECT_FALSE(IsTokenFileFormat(InputFormat::kJsonl));
}

}  // namespace
}  // namespace aloe
