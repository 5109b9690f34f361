#include "common/sentencepiece_tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/durable_file.h"
#include "common/status_matchers.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

class SentencePieceTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef ALOE_HAVE_SENTENCEPIECE
    GTEST_SKIP() << "built without libsentencepiece-dev (scripts/install-deps.sh installs it)";
#endif
  }
};

std::string TestDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir =
      absl::StrFormat("%ssentencepiece_test_%d_%s", ::testing::TempDir(), ::getpid(), info->name());
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

const char kText[] =
    "Four score and seven years ago our fathers brought forth on this continent, a new nation,\n"
    "conceived in Liberty, and dedicated to the proposition that all men are created equal.\n"
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so\n"
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that\n"
    "war. We have come to dedicate a portion of that field, as a final resting place for those\n"
    "who here gave their lives that that nation might live. It is altogether fitting and\n"
    "proper that we should do this. But, in a larger sense, we can not dedicate -- we can not\n"
    "consecrate -- we can not hallow -- this ground. The brave men, living and dead, who\n"
    "struggled here, have consecrated it, far above our poor power to add or detract.\n";

// Trains a 400-piece BPE model on kText in `dir`; returns its path.
std::string TrainModel(const std::string& dir) {
  WriteFile(dir + "/train.txt", kText);
  const std::string model = dir + "/sp.model";
  EXPECT_THAT(SentencePieceTokenizer::Train(dir + "/train.txt", model,
                                            {.vocab_size = 400, .model_type = "bpe"}),
              IsOk());
  return model;
}

TEST_F(SentencePieceTokenizerTest, TrainsAModelOfTheAskedSizeThatRoundTrips) {
  const std::string dir = TestDir();
  absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> t =
      SentencePieceTokenizer::Load(TrainModel(dir));
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ((*t)->vocab_size(), 400u);
  EXPECT_EQ((*t)->name(), "sentencepiece");
  const std::vector<uint32_t> ids = (*t)->Encode("Four score and seven years ago");
  EXPECT_LT(ids.size(), 25u);  // merges happened: the text has 30 characters
  for (uint32_t id : ids) EXPECT_LT(id, 400u);
  EXPECT_EQ((*t)->Decode(ids), "Four score and seven years ago");
  // Byte fallback: characters never seen in training still encode and decode.
  EXPECT_EQ((*t)->Decode((*t)->Encode("\xe6\x9d\xb1 zq")), "\xe6\x9d\xb1 zq");
  EXPECT_THAT((*t)->Encode("\n\n"), IsEmpty());
}

// The ids spm_encode (the SentencePiece command-line encoder) gives each line of `text`.
std::vector<std::vector<uint32_t>> SpmEncode(const std::string& dir, const std::string& model,
                                             const std::string& text) {
  WriteFile(dir + "/in.txt", text);
  const std::string command = absl::StrCat("spm_encode --model=", model, " --output_format=id < ",
                                           dir, "/in.txt > ", dir, "/out.txt");
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  std::vector<std::vector<uint32_t>> lines;
  absl::StatusOr<std::string> out = ReadWholeFile(dir + "/out.txt");
  EXPECT_THAT(out, IsOk());
  for (absl::string_view line : absl::StrSplit(*out, '\n', absl::SkipEmpty())) {
    lines.emplace_back();
    for (absl::string_view id : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      uint32_t v = 0;
      EXPECT_TRUE(absl::SimpleAtoi(id, &v)) << line;
      lines.back().push_back(v);
    }
  }
  return lines;
}

TEST_F(SentencePieceTokenizerTest, MatchesSpmEncodeLineByLine) {
  if (std::system("spm_encode --help >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "spm_encode is not installed (Debian package sentencepiece)";
  }
  const std::string dir = TestDir();
  const std::string model = TrainModel(dir);
  absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> t = SentencePieceTokenizer::Load(model);
  ASSERT_THAT(t, IsOk());
  std::string long_line;  // encoded in pieces cut at whitespace, with the same ids
  while (long_line.size() < 10000) absl::StrAppend(&long_line, "we can not dedicate -- ");
  const std::vector<std::string> lines = {
      long_line,
      "The brave men, living and dead, who struggled here.",
      "  Extra   spaces and UPPER case; numbers 1863 and 2024!",
      "Unseen: na\xc3\xafve caf\xc3\xa9 \xe6\x9d\xb1\xe4\xba\xac \xf0\x9f\x98\x80",
  };
  std::string text;
  for (const std::string& line : lines) absl::StrAppend(&text, line, "\n");
  const std::vector<std::vector<uint32_t>> want = SpmEncode(dir, model, text);
  ASSERT_THAT(want, SizeIs(lines.size()));
  std::vector<uint32_t> all;
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_THAT((*t)->Encode(lines[i]), ElementsAreArray(want[i])) << lines[i];
    all.insert(all.end(), want[i].begin(), want[i].end());
  }
  // Several lines at once: the lines' ids one after another.
  EXPECT_THAT((*t)->Encode(text), ElementsAreArray(all));
}

TEST_F(SentencePieceTokenizerTest, RefusesMissingAndBrokenModels) {
  const std::string dir = TestDir();
  EXPECT_THAT(SentencePieceTokenizer::Load(dir + "/none.model"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("none.model: no such file")));
  WriteFile(dir + "/bad.model", "not a model");
  EXPECT_THAT(SentencePieceTokenizer::Load(dir + "/bad.model"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("bad.model: not a SentencePiece model")));
}

TEST_F(SentencePieceTokenizerTest, RefusesBadTrainingOptions) {
  const std::string dir = TestDir();
  WriteFile(dir + "/train.txt", kText);
  EXPECT_THAT(SentencePieceTokenizer::Train(dir + "/train.txt", dir + "/sp.model",
                                            {.vocab_size = 300, .extra_options = "oops"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected name=value")));
  EXPECT_THAT(
      SentencePieceTokenizer::Train(dir + "/train.txt", dir + "/sp.model", {.vocab_size = 100000}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocab_size 100000")));
  EXPECT_THAT(SentencePieceTokenizer::Train(dir + "/train.txt", dir + "/sp.bin", {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must end in .model")));
}

}  // namespace
}  // namespace aloe
