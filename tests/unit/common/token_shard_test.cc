#include "common/token_shard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
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
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// A fresh path per test, so tests (and concurrent runs of this binary) never share files.
// TempDir() ends with a '/'.
std::string TempPath(const std::string& name) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return absl::StrFormat("%stoken_shard_test_%d_%s_%s", ::testing::TempDir(), ::getpid(),
                         info->name(), name);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<int64_t> ReadAll(const TokenShard& shard) {
  std::vector<int64_t> out(shard.num_tokens());
  shard.Read(0, shard.num_tokens(), out.data());
  return out;
}

TEST(TokenShardTest, RoundTripsUint16Tokens) {
  const std::string path = TempPath("u16.tok");
  const std::vector<uint32_t> tokens = {0, 1, 255, 65535, 42, 7};
  ASSERT_THAT(WriteTokenShard(path, tokens, 65536), IsOk());
  // 32-byte header + 2 bytes per token: the writer chose uint16.
  EXPECT_EQ(ReadBytes(path).size(), 32u + 2 * tokens.size());

  absl::StatusOr<std::unique_ptr<TokenShard>> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->num_tokens(), tokens.size());
  EXPECT_EQ((*shard)->vocab_size(), 65536u);
  EXPECT_EQ((*shard)->dtype_bytes(), 2u);
  EXPECT_THAT(ReadAll(**shard), ElementsAreArray({0, 1, 255, 65535, 42, 7}));

  // A window in the middle.
  std::vector<int64_t> window(2);
  (*shard)->Read(2, 2, window.data());
  EXPECT_THAT(window, ElementsAreArray({255, 65535}));
}

TEST(TokenShardTest, RoundTripsUint32TokensAboveUint16Range) {
  const std::string path = TempPath("u32.tok");
  const std::vector<uint32_t> tokens = {0, 65536, 99999, 3, 100000 - 1};
  ASSERT_THAT(WriteTokenShard(path, tokens, 100000), IsOk());
  EXPECT_EQ(ReadBytes(path).size(), 32u + 4 * tokens.size());

  absl::StatusOr<std::unique_ptr<TokenShard>> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->dtype_bytes(), 4u);
  EXPECT_EQ((*shard)->vocab_size(), 100000u);
  EXPECT_THAT(ReadAll(**shard), ElementsAreArray({0, 65536, 99999, 3, 99999}));
}

TEST(TokenShardTest, HeaderLayoutMatchesTheDocumentedFormat) {
  const std::string path = TempPath("layout.tok");
  ASSERT_THAT(WriteTokenShard(path, {0x0102, 0x0304, 0x0506}, 256 * 8), IsOk());
  const std::string b = ReadBytes(path);
  ASSERT_EQ(b.size(), 38u);
  EXPECT_EQ(b.substr(0, 8), "ALOETOKS");
  EXPECT_EQ(b.substr(8, 4), std::string("\x01\0\0\0", 4));           // format_version 1
  EXPECT_EQ(b.substr(12, 4), std::string("\x02\0\0\0", 4));          // dtype uint16
  EXPECT_EQ(b.substr(16, 8), std::string("\x03\0\0\0\0\0\0\0", 8));  // token_count
  EXPECT_EQ(b.substr(24, 4), std::string("\0\x08\0\0", 4));          // vocab_size 2048
  EXPECT_EQ(b.substr(28, 4), std::string("\0\0\0\0", 4));            // reserved
  EXPECT_EQ(b.substr(32, 2), std::string("\x02\x01", 2));            // little-endian tokens
}

TEST(TokenShardTest, EmptyShardOpens) {
  const std::string path = TempPath("empty.tok");
  ASSERT_THAT(WriteTokenShard(path, {}, 256), IsOk());
  absl::StatusOr<std::unique_ptr<TokenShard>> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->num_tokens(), 0u);
}

TEST(TokenShardTest, WriteRejectsTokenOutsideVocabNamingItsIndex) {
  const std::string path = TempPath("oov.tok");
  EXPECT_THAT(WriteTokenShard(path, {1, 2, 256, 3}, 256),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("index 2"), HasSubstr("256"))));
  // Nothing was written, not even the temporary file.
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
  EXPECT_NE(::access((path + ".tmp").c_str(), F_OK), 0);
}

TEST(TokenShardTest, WriteRejectsZeroVocab) {
  EXPECT_THAT(WriteTokenShard(TempPath("v0.tok"), {}, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocab_size")));
}

TEST(TokenShardTest, WriteReplacesAnExistingFileAndLeavesNoTemporary) {
  const std::string path = TempPath("replace.tok");
  ASSERT_THAT(WriteTokenShard(path, {1, 2, 3}, 256), IsOk());
  ASSERT_THAT(WriteTokenShard(path, {9}, 256), IsOk());
  absl::StatusOr<std::unique_ptr<TokenShard>> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  EXPECT_THAT(ReadAll(**shard), ElementsAreArray({9}));
  EXPECT_NE(::access((path + ".tmp").c_str(), F_OK), 0);
}

TEST(TokenShardTest, MissingFileIsNotFound) {
  const std::string path = TempPath("missing.tok");
  EXPECT_THAT(TokenShard::Open(path), StatusIs(absl::StatusCode::kNotFound,
                                               AllOf(HasSubstr(path), HasSubstr("no such file"))));
}

TEST(TokenShardTest, TruncatedHeaderIsInvalid) {
  const std::string path = TempPath("short.tok");
  WriteBytes(path, std::string("ALOETOKS\x01\0\0", 11));
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("truncated header (11 bytes"))));
}

TEST(TokenShardTest, BadMagicIsInvalid) {
  const std::string good = TempPath("good.tok");
  ASSERT_THAT(WriteTokenShard(good, {1, 2}, 256), IsOk());
  std::string bytes = ReadBytes(good);
  bytes.replace(0, 8, "GPT2TOKS");
  const std::string path = TempPath("magic.tok");
  WriteBytes(path, bytes);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("bad magic"), HasSubstr("GPT2TOKS"))));
}

TEST(TokenShardTest, UnknownFormatVersionIsInvalid) {
  const std::string good = TempPath("good.tok");
  ASSERT_THAT(WriteTokenShard(good, {1, 2}, 256), IsOk());
  std::string bytes = ReadBytes(good);
  bytes[8] = 2;
  const std::string path = TempPath("version.tok");
  WriteBytes(path, bytes);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("format_version 2"))));
}

TEST(TokenShardTest, UnsupportedDtypeIsInvalid) {
  const std::string good = TempPath("good.tok");
  ASSERT_THAT(WriteTokenShard(good, {1, 2}, 256), IsOk());
  std::string bytes = ReadBytes(good);
  bytes[12] = 8;  // e.g. someone wrote uint64 tokens
  const std::string path = TempPath("dtype.tok");
  WriteBytes(path, bytes);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("unsupported dtype 8"))));
}

TEST(TokenShardTest, ZeroVocabInHeaderIsInvalid) {
  const std::string good = TempPath("good.tok");
  ASSERT_THAT(WriteTokenShard(good, {1, 2}, 256), IsOk());
  std::string bytes = ReadBytes(good);
  bytes[24] = 0;
  bytes[25] = 0;  // 256 = 0x100
  const std::string path = TempPath("vocab0.tok");
  WriteBytes(path, bytes);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("vocab_size is 0"))));
}

TEST(TokenShardTest, TruncatedBodyIsInvalid) {
  const std::string good = TempPath("good.tok");
  ASSERT_THAT(WriteTokenShard(good, {1, 2, 3, 4, 5}, 256), IsOk());
  std::string bytes = ReadBytes(good);
  bytes.resize(bytes.size() - 4);  // two uint16 tokens lost, e.g. an interrupted copy
  const std::string path = TempPath("body.tok");
  WriteBytes(path, bytes);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path),
                             HasSubstr("truncated: header says 5 tokens but the file holds 3"))));
}

TEST(TokenShardTest, OddBodyByteCountIsInvalid) {
  const std::string good = TempPath("good.tok");
  ASSERT_THAT(WriteTokenShard(good, {1, 2}, 256), IsOk());
  std::string bytes = ReadBytes(good);
  bytes.resize(bytes.size() - 1);
  const std::string path = TempPath("odd.tok");
  WriteBytes(path, bytes);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("header says 2 tokens but the file holds 1")));
}

TEST(TokenShardTest, HugeTokenCountDoesNotOverflow) {
  const std::string good = TempPath("good.tok");
  ASSERT_THAT(WriteTokenShard(good, {1, 2}, 256), IsOk());
  std::string bytes = ReadBytes(good);
  // token_count = 2^63 + 2: token_count * 2 wraps to the real body size in 64 bits.
  bytes[23] = static_cast<char>(0x80);
  const std::string path = TempPath("huge.tok");
  WriteBytes(path, bytes);
  EXPECT_THAT(TokenShard::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
}

TEST(TokenShardTest, IsATokenSource) {
  const std::string path = TempPath("source.tok");
  ASSERT_THAT(WriteTokenShard(path, {5, 6, 7}, 256), IsOk());
  absl::StatusOr<std::unique_ptr<TokenShard>> shard = TokenShard::Open(path);
  ASSERT_THAT(shard, IsOk());
  const TokenSource& source = **shard;
  std::vector<int64_t> out(1);
  source.Read(2, 1, out.data());
  EXPECT_EQ(out[0], 7);
  EXPECT_EQ(source.vocab_size(), 256u);
}

// An llm.c token file: 256 int32 header (magic, version, count) and the tokens.
std::string LlmcFile(const std::vector<uint16_t>& tokens, int32_t count, int32_t magic = 20240520,
                     int32_t version = 1) {
  std::string bytes(1024, '\0');
  std::memcpy(bytes.data(), &magic, 4);
  std::memcpy(bytes.data() + 4, &version, 4);
  std::memcpy(bytes.data() + 8, &count, 4);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), 2 * tokens.size());
  return bytes;
}

TEST(TokenShardTest, ReadsLlmcFilesInPlace) {
  const std::string path = TempPath("train.bin");
  WriteBytes(path, LlmcFile({50256, 15496, 995, 0}, 4));
  absl::StatusOr<std::unique_ptr<TokenShard>> shard =
      TokenShard::Open(path, TokenFileFormat::kLlmc, 50257);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->num_tokens(), 4u);
  EXPECT_EQ((*shard)->vocab_size(), 50257u);
  EXPECT_EQ((*shard)->header_bytes(), 1024u);
  EXPECT_THAT(ReadAll(**shard), ElementsAreArray({50256, 15496, 995, 0}));
  EXPECT_THAT((*shard)->CheckTokenRange(), IsOk());
}

TEST(TokenShardTest, RefusesMalformedLlmcFilesNamingTheOffset) {
  const std::string path = TempPath("bad.bin");
  auto open = [&](const std::string& bytes) {
    WriteBytes(path, bytes);
    return TokenShard::Open(path, TokenFileFormat::kLlmc, 50257).status();
  };
  EXPECT_THAT(
      open(LlmcFile({1, 2}, 2).substr(0, 1000)),
      StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr(path + ": truncated header"),
                                                         HasSubstr("ends at byte offset 1000"))));
  // A short file of another kind (nanoGPT's) is told by its magic, not called truncated.
  EXPECT_THAT(open(std::string("\x01\x00\x02\x00\x03\x00", 6)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path + ": byte offset 0: magic 131073"),
                             HasSubstr("--input_format uint16"))));
  EXPECT_THAT(open(LlmcFile({1, 2}, 2, 20240521)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(path + ": byte offset 0: magic 20240521, expected 20240520")));
  EXPECT_THAT(
      open(LlmcFile({1, 2}, 2, 20240520, 7)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(path + ": byte offset 4: version 7")));
  EXPECT_THAT(open(LlmcFile({1, 2}, 0)), StatusIs(absl::StatusCode::kInvalidArgument,
                                                  HasSubstr("byte offset 8: token count 0")));
  // The header promises 3 tokens; the body holds 2 and a half.
  EXPECT_THAT(open(LlmcFile({1, 2}, 3) + "x"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path + ": truncated"), HasSubstr("end at byte offset 1030"),
                             HasSubstr("file ends at byte offset 1029"))));
  EXPECT_THAT(open(LlmcFile({1, 2, 3}, 2)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trailing bytes")));
  EXPECT_THAT(open(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty file")));
}

TEST(TokenShardTest, LlmcVersion2HoldsUint32Tokens) {
  const std::string path = TempPath("v2.bin");
  std::string bytes = LlmcFile({}, 2, 20240520, 2);
  const uint32_t tokens[] = {128000, 7};
  bytes.append(reinterpret_cast<const char*>(tokens), sizeof(tokens));
  WriteBytes(path, bytes);
  absl::StatusOr<std::unique_ptr<TokenShard>> shard =
      TokenShard::Open(path, TokenFileFormat::kLlmc, 128256);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->dtype_bytes(), 4u);
  EXPECT_THAT(ReadAll(**shard), ElementsAreArray({128000, 7}));
}

TEST(TokenShardTest, ReadsHeaderlessUint16FilesAndRefusesOddSizes) {
  const std::string path = TempPath("val.bin");
  const std::vector<uint16_t> tokens = {3, 64, 0, 12};
  std::string bytes(reinterpret_cast<const char*>(tokens.data()), 2 * tokens.size());
  WriteBytes(path, bytes);
  absl::StatusOr<std::unique_ptr<TokenShard>> shard =
      TokenShard::Open(path, TokenFileFormat::kUint16, 65);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->header_bytes(), 0u);
  EXPECT_THAT(ReadAll(**shard), ElementsAreArray({3, 64, 0, 12}));

  WriteBytes(path, bytes + "\x01");
  EXPECT_THAT(TokenShard::Open(path, TokenFileFormat::kUint16, 65),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(path + ": truncated: byte offset 8 starts half a uint16 token")));
  EXPECT_THAT(TokenShard::Open(path, TokenFileFormat::kUint16, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs the vocab_size")));
}

TEST(TokenShardTest, CheckTokenRangeNamesTheByteOffsetOfTheFirstBadToken) {
  const std::string path = TempPath("range.bin");
  WriteBytes(path, LlmcFile({1, 2, 50257, 60000}, 4));
  absl::StatusOr<std::unique_ptr<TokenShard>> shard =
      TokenShard::Open(path, TokenFileFormat::kLlmc, 50257);
  ASSERT_THAT(shard, IsOk());
  EXPECT_THAT((*shard)->CheckTokenRange(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(path + ": byte offset 1028: token 50257 is outside the "
                                        "vocabulary (vocab_size 50257)")));
}

TEST(TokenShardTest, AloeShardMustMatchTheCorpusVocab) {
  const std::string path = TempPath("v.tok");
  ASSERT_THAT(WriteTokenShard(path, {1, 2}, 256), IsOk());
  EXPECT_THAT(TokenShard::Open(path, TokenFileFormat::kAloe, 256), IsOk());
  EXPECT_THAT(TokenShard::Open(path, TokenFileFormat::kAloe, 50257),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("byte offset 24: vocab_size 256, but the corpus manifest says "
                                 "50257")));
}

TEST(TokenShardTest, FromBytesChecksAndReadsLikeOpen) {
  const std::string path = TempPath("mem.tok");
  ASSERT_THAT(WriteTokenShard(path, {5, 0, 65535}, 65536), IsOk());
  const std::string bytes = ReadBytes(path);
  EXPECT_EQ(EncodeTokenShard({5, 0, 65535}, 65536), bytes);
  absl::StatusOr<std::unique_ptr<TokenShard>> shard =
      TokenShard::FromBytes("mem.tok", bytes, TokenFileFormat::kAloe, 0);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->path(), "mem.tok");
  EXPECT_EQ((*shard)->vocab_size(), 65536u);
  EXPECT_THAT(ReadAll(**shard), ElementsAreArray({5, 0, 65535}));
  // The same refusals, word for word, bar the name.
  const std::string cut = bytes.substr(0, bytes.size() - 2);
  WriteBytes(path, cut);
  const absl::Status opened = TokenShard::Open(path).status();
  EXPECT_THAT(opened, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
  EXPECT_EQ(TokenShard::FromBytes(path, cut, TokenFileFormat::kAloe, 0).status(), opened);
  EXPECT_THAT(TokenShard::FromBytes("x.bin", "", TokenFileFormat::kLlmc, 50257),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x.bin: empty file")));
  EXPECT_THAT(TokenShard::FromBytes("x.bin", LlmcFile({1, 2}, 2, 20240520, 7),
                                    TokenFileFormat::kLlmc, 50257),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte offset 4: version 7")));
}

TEST(TokenShardTest, EncodesAnEmptyShardOfWideTokens) {
  // Four-byte tokens (vocab > 65536) and none of them: only the header, whose dtype says 4.
  const std::string bytes = EncodeTokenShard({}, 100000);
  ASSERT_EQ(bytes.size(), 32u);
  EXPECT_EQ(bytes[12], 4);
  absl::StatusOr<std::unique_ptr<TokenShard>> shard =
      TokenShard::FromBytes("empty.tok", bytes, TokenFileFormat::kAloe, 0);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->num_tokens(), 0u);
  EXPECT_EQ((*shard)->dtype_bytes(), 4u);
  EXPECT_THAT((*shard)->CheckTokenRange(), IsOk());
}

TEST(TokenFileFormatTest, NamesRoundTrip) {
  for (TokenFileFormat f :
       {TokenFileFormat::kAloe, TokenFileFormat::kLlmc, TokenFileFormat::kUint16}) {
    absl::StatusOr<TokenFileFormat> parsed = ParseTokenFileFormat(TokenFileFormatName(f));
    ASSERT_THAT(parsed, IsOk());
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_THAT(ParseTokenFileFormat("npy"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aloe, llmc or uint16")));
}

}  // namespace
}  // namespace aloe
