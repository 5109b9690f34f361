// libFuzzer target for the files aloe-corpus and the data loaders read from other tools: token
// files used as data shards as they are (common/token_shard.h: ALOE token shards, llm.c .bin,
// nanoGPT's headerless uint16 .bin) and .jsonl records whose named field holds the text
// (common/corpus_inputs.h). Built with ASan + UBSan (tests/fuzz/CMakeLists.txt).
//
// Input: any bytes, read from memory as a token file of each format (TokenShard::FromBytes, the
// checks of TokenShard::Open) and as a .jsonl file (ParseJsonlDocuments, field "text").
//
// Oracle, on every input (a violation aborts, which libFuzzer reports as a crash):
//   - A refused token file gets kInvalidArgument naming the file; an llm.c or uint16 one also
//     names the byte offset of the fault (bar an empty file).
//   - An accepted token file holds exactly its header and its tokens: header_bytes +
//     num_tokens * dtype_bytes is the input's size, the header's fields are what the format
//     says, Read returns the little-endian tokens of the body, whole or in two parts, and
//     CheckTokenRange refuses exactly when a token is outside the vocabulary, naming the byte
//     offset of the first one. Its tokens, if in range, written again by EncodeTokenShard read
//     back the same.
//   - A refused .jsonl file gets kInvalidArgument "fuzz.jsonl: byte offset N: ..." with N
//     within the input.
//   - An accepted one yields at most one document per non-blank line; the documents written
//     again as .jsonl records read back the same, and so does the input with CRLF line ends.
//   - A line with escapes that protobuf's JSON parser reads too, as an object with a string
//     "text", gives the same text (where protobuf alone accepts, it is the laxer one).
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/corpus_inputs.h"
#include "common/token_shard.h"
#include "tests/fuzz/fuzz_check.h"

namespace aloe {
namespace {

constexpr char kTokenPath[] = "fuzz.bin";
constexpr char kJsonlPath[] = "fuzz.jsonl";
// GPT-2's vocabulary: what llm.c and nanoGPT files hold.
constexpr uint32_t kVocab = 50257;

uint64_t Le(std::string_view bytes, size_t at, int width) {
  uint64_t v = 0;
  for (int i = 0; i < width; ++i) {
    v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
  }
  return v;
}

// The number after "byte offset " in `message`, or -1.
int64_t ByteOffset(absl::string_view message) {
  const size_t at = message.find("byte offset ");
  if (at == absl::string_view::npos) return -1;
  absl::string_view rest = message.substr(at + 12);
  rest = rest.substr(0, rest.find_first_not_of("0123456789"));
  int64_t n = -1;
  return absl::SimpleAtoi(rest, &n) ? n : -1;
}

void CheckTokenFile(std::string_view bytes, TokenFileFormat format, uint32_t vocab_size) {
  const std::string name = TokenFileFormatName(format);
  absl::StatusOr<std::unique_ptr<TokenShard>> opened =
      TokenShard::FromBytes(kTokenPath, std::string(bytes), format, vocab_size);
  if (!opened.ok()) {
    const absl::Status& s = opened.status();
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument &&
                   absl::StartsWith(s.message(), absl::StrCat(kTokenPath, ": ")),
               "%s refused with %s", name.c_str(), s.ToString().c_str());
    if (format != TokenFileFormat::kAloe && !bytes.empty()) {
      const int64_t offset = ByteOffset(s.message());
      FUZZ_CHECK(offset >= 0 && static_cast<uint64_t>(offset) <= bytes.size(),
                 "%s refused without a byte offset in the file: %s", name.c_str(),
                 s.ToString().c_str());
    }
    return;
  }
  const TokenShard& shard = **opened;
  const uint64_t n = shard.num_tokens();
  const uint32_t dtype = shard.dtype_bytes();
  FUZZ_CHECK(dtype == 2 || dtype == 4, "%s: dtype %u", name.c_str(), dtype);
  FUZZ_CHECK(shard.header_bytes() <= bytes.size() &&
                 (bytes.size() - shard.header_bytes()) / dtype == n &&
                 (bytes.size() - shard.header_bytes()) % dtype == 0,
             "%s: %zu header bytes and %llu tokens of %u in a file of %zu", name.c_str(),
             shard.header_bytes(), static_cast<unsigned long long>(n), dtype, bytes.size());
  switch (format) {
    case TokenFileFormat::kAloe:
      FUZZ_CHECK(shard.header_bytes() == kTokenShardHeaderBytes &&
                     std::memcmp(bytes.data(), kTokenShardMagic, 8) == 0 && Le(bytes, 8, 4) == 1 &&
                     Le(bytes, 12, 4) == dtype && Le(bytes, 16, 8) == n &&
                     Le(bytes, 24, 4) == shard.vocab_size() && shard.vocab_size() > 0 &&
                     (vocab_size == 0 || vocab_size == shard.vocab_size()),
                 "aloe: accepted with another header");
      break;
    case TokenFileFormat::kLlmc:
      FUZZ_CHECK(shard.header_bytes() == kLlmcHeaderBytes &&
                     static_cast<int32_t>(Le(bytes, 0, 4)) == kLlmcMagic &&
                     Le(bytes, 4, 4) == (dtype == 2 ? 1u : 2u) && Le(bytes, 8, 4) == n && n > 0 &&
                     shard.vocab_size() == vocab_size,
                 "llmc: accepted with another header");
      break;
    case TokenFileFormat::kUint16:
      FUZZ_CHECK(
          shard.header_bytes() == 0 && dtype == 2 && n > 0 && shard.vocab_size() == vocab_size,
          "uint16: accepted as another layout");
      break;
  }
  std::vector<int64_t> tokens(n);
  if (n > 0) shard.Read(0, n, tokens.data());
  int64_t first_bad = -1;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t want = Le(bytes, shard.header_bytes() + i * dtype, static_cast<int>(dtype));
    FUZZ_CHECK(static_cast<uint64_t>(tokens[i]) == want, "%s: token %llu read as %lld, is %llu",
               name.c_str(), static_cast<unsigned long long>(i), static_cast<long long>(tokens[i]),
               static_cast<unsigned long long>(want));
    if (first_bad < 0 && want >= shard.vocab_size()) first_bad = static_cast<int64_t>(i);
  }
  const uint64_t half = n / 2;
  std::vector<int64_t> parts(n);
  if (half > 0) shard.Read(0, half, parts.data());
  if (n > half) shard.Read(half, n - half, parts.data() + half);
  FUZZ_CHECK(parts == tokens, "%s: reading in two parts differs", name.c_str());

  const absl::Status range = shard.CheckTokenRange();
  if (first_bad >= 0) {
    const int64_t want = static_cast<int64_t>(shard.header_bytes()) + first_bad * dtype;
    FUZZ_CHECK(
        range.code() == absl::StatusCode::kInvalidArgument && ByteOffset(range.message()) == want,
        "%s: token %lld is outside the vocabulary at byte offset %lld; got %s", name.c_str(),
        static_cast<long long>(first_bad), static_cast<long long>(want), range.ToString().c_str());
    return;
  }
  FUZZ_CHECK(range.ok(), "%s: tokens in range refused: %s", name.c_str(), range.ToString().c_str());
  const std::vector<uint32_t> narrow(tokens.begin(), tokens.end());
  absl::StatusOr<std::unique_ptr<TokenShard>> again = TokenShard::FromBytes(
      kTokenPath, EncodeTokenShard(narrow, shard.vocab_size()), TokenFileFormat::kAloe, 0);
  FUZZ_CHECK(again.ok(), "%s: written again, refused: %s", name.c_str(),
             again.status().ToString().c_str());
  std::vector<int64_t> back(n);
  if (n > 0) (*again)->Read(0, n, back.data());
  FUZZ_CHECK(back == tokens && (*again)->vocab_size() == shard.vocab_size(),
             "%s: written again, reads back other tokens", name.c_str());
}

// A JSON string of `s` as it is: quotes, backslashes and control characters escaped.
void AppendJsonString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(out, "\\u%04x", static_cast<unsigned char>(c));
    } else {
      out->push_back(c);
    }
  }
  out->push_back('"');
}

// Differential: a line that both protobuf's JSON parser and ours read, as an object with a
// string "text", gives the same text. Only agreement is checked where both accept: protobuf is
// the laxer (raw control characters, unknown escapes like \q). Lines without an escape are
// left out: protobuf's parser is slow to set up, and the escapes are what could decode wrong.
void CheckJsonlLineAgainstProtobuf(std::string_view line) {
  if (line.find('\\') == std::string_view::npos) return;
  google::protobuf::Struct record;
  if (!google::protobuf::util::JsonStringToMessage(std::string(line), &record).ok()) return;
  const auto text = record.fields().find("text");
  if (text == record.fields().end() ||
      text->second.kind_case() != google::protobuf::Value::kStringValue) {
    return;
  }
  const absl::StatusOr<std::vector<std::string>> ours =
      ParseJsonlDocuments(line, kJsonlPath, "text");
  if (!ours.ok()) return;
  FUZZ_CHECK(ours->size() == 1 && (*ours)[0] == text->second.string_value(),
             "protobuf reads \"text\" as \"%s\"; ours as \"%s\"",
             absl::CHexEscape(text->second.string_value()).c_str(),
             ours->size() == 1 ? absl::CHexEscape((*ours)[0]).c_str() : "not one document");
}

void CheckJsonl(std::string_view bytes) {
  for (size_t start = 0; start < bytes.size();) {
    size_t end = bytes.find('\n', start);
    if (end == std::string_view::npos) end = bytes.size();
    CheckJsonlLineAgainstProtobuf(bytes.substr(start, end - start));
    start = end + 1;
  }

  const absl::StatusOr<std::vector<std::string>> documents =
      ParseJsonlDocuments(bytes, kJsonlPath, "text");
  if (!documents.ok()) {
    const absl::Status& s = documents.status();
    const int64_t offset = ByteOffset(s.message());
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument &&
                   absl::StartsWith(s.message(), absl::StrCat(kJsonlPath, ": byte offset ")) &&
                   offset >= 0 && static_cast<uint64_t>(offset) <= bytes.size(),
               "jsonl refused with %s", s.ToString().c_str());
    return;
  }
  size_t lines = 0;
  for (size_t start = 0; start < bytes.size();) {
    size_t end = bytes.find('\n', start);
    if (end == std::string_view::npos) end = bytes.size();
    if (bytes.substr(start, end - start).find_first_not_of(" \t\r") != std::string_view::npos) {
      ++lines;
    }
    start = end + 1;
  }
  FUZZ_CHECK(documents->size() <= lines, "%zu documents from %zu lines", documents->size(), lines);

  std::string written;
  for (const std::string& d : *documents) {
    written += R"({"id": [1, {"text": null}], "text": )";
    AppendJsonString(d, &written);
    written += "}\n";
  }
  const absl::StatusOr<std::vector<std::string>> back =
      ParseJsonlDocuments(written, kJsonlPath, "text");
  FUZZ_CHECK(back.ok() && *back == *documents, "documents written again read back %s",
             back.ok() ? "others" : back.status().ToString().c_str());

  std::string crlf;
  for (const char c : bytes) {
    if (c == '\n') crlf.push_back('\r');
    crlf.push_back(c);
  }
  const absl::StatusOr<std::vector<std::string>> windows =
      ParseJsonlDocuments(crlf, kJsonlPath, "text");
  FUZZ_CHECK(windows.ok() && *windows == *documents, "with CRLF line ends: %s",
             windows.ok() ? "other documents" : windows.status().ToString().c_str());
}

}  // namespace
}  // namespace aloe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace aloe;  // NOLINT(build/namespaces)
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  CheckTokenFile(bytes, TokenFileFormat::kAloe, 0);
  CheckTokenFile(bytes, TokenFileFormat::kAloe, kVocab);
  CheckTokenFile(bytes, TokenFileFormat::kLlmc, kVocab);
  CheckTokenFile(bytes, TokenFileFormat::kUint16, kVocab);
  CheckJsonl(bytes);
  return 0;
}
