// Token shards: the on-disk form of a tokenised corpus piece, written once by aloe-corpus and
// memory-mapped read-only by every worker's data loader.
//
// File format, version 1 (all integers little-endian):
//
//   offset  size  field
//        0     8  magic          "ALOETOKS" (no terminating NUL)
//        8     4  format_version uint32, 1
//       12     4  dtype          uint32, bytes per token: 2 (uint16) or 4 (uint32)
//       16     8  token_count    uint64
//       24     4  vocab_size     uint32, > 0; every token is < vocab_size
//       28     4  reserved       uint32, 0
//       32     -  token_count tokens of dtype, densely packed
//
// The file is exactly 32 + token_count * dtype bytes. The writer picks uint16 whenever the vocab
// fits (vocab_size <= 65536: the byte tokenizer, small BPE vocabs) and uint32 otherwise (e.g. a
// 100k-entry SentencePiece BPE vocab), so the format needs no change for larger tokenizers. The
// shard does not record which tokenizer produced it; the corpus manifest and the model config
// pair the two.
//
// Token files of other tools are read in place as well (TokenFileFormat):
//   llm.c     a header of 256 little-endian int32: magic 20240520, version (1: uint16 tokens,
//             2: uint32 tokens), token count; then the tokens.
//   uint16    nanoGPT's train.bin/val.bin: uint16 tokens and nothing else.
// Neither records a vocab_size; the corpus manifest supplies it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/durable_file.h"
#include "common/token_source.h"

namespace aloe {

inline constexpr char kTokenShardMagic[8] = {'A', 'L', 'O', 'E', 'T', 'O', 'K', 'S'};
inline constexpr uint32_t kTokenShardFormatVersion = 1;
inline constexpr size_t kTokenShardHeaderBytes = 32;
inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr size_t kLlmcHeaderBytes = 256 * 4;

// How a token file is laid out; see the file comment.
enum class TokenFileFormat { kAloe, kLlmc, kUint16 };
// "aloe", "llmc", "uint16".
const char* TokenFileFormatName(TokenFileFormat format);
// The format of a name TokenFileFormatName gives; kInvalidArgument naming the choices.
absl::StatusOr<TokenFileFormat> ParseTokenFileFormat(std::string_view name);

// Writes `tokens` as a version-1 token shard at `path` (atomically, see WriteFileAtomically in
// common/durable_file.h).
// Stores uint16 tokens when vocab_size <= 65536, else uint32. Returns kInvalidArgument when
// vocab_size is 0 or a token is >= vocab_size (the message names the first such index).
absl::Status WriteTokenShard(const std::string& path, absl::Span<const uint32_t> tokens,
                             uint32_t vocab_size);
// The bytes WriteTokenShard writes. Precondition: vocab_size > 0 and every token is below it.
std::string EncodeTokenShard(absl::Span<const uint32_t> tokens, uint32_t vocab_size);

// A read-only, memory-mapped token shard. The mapping lives as long as the object. Thread-safe:
// all methods only read.
class TokenShard final : public TokenSource {
 public:
  // Maps the shard at `path` and validates its header and size. Errors (each message starts
  // with the path):
  //   kNotFound        the file does not exist;
  //   kInvalidArgument truncated header, bad magic, unknown format_version, dtype not 2 or 4,
  //                    vocab_size 0, or a body whose size differs from token_count * dtype;
  //   kInternal        open/stat/mmap failed for another reason.
  // Tokens are not range-checked against vocab_size here (that would touch every page); the
  // writer guarantees it.
  static absl::StatusOr<std::unique_ptr<TokenShard>> Open(const std::string& path);
  // Maps a token file of `format`. For kLlmc and kUint16 `vocab_size` (> 0) is the vocabulary
  // the tokens come from; for kAloe it must be 0 or equal the header's. Errors, each naming the
  // path and, for a malformed file, the byte offset of the fault: kInvalidArgument for a
  // truncated header, a bad magic or version, a size that does not hold whole tokens or the
  // header's token count, an empty file; otherwise as above.
  static absl::StatusOr<std::unique_ptr<TokenShard>> Open(const std::string& path,
                                                          TokenFileFormat format,
                                                          uint32_t vocab_size);
  // Open's checks over a file's bytes in memory, which the shard keeps; `path` only names the
  // file in messages. Errors as Open's, bar kNotFound and kInternal.
  static absl::StatusOr<std::unique_ptr<TokenShard>> FromBytes(std::string path, std::string bytes,
                                                               TokenFileFormat format,
                                                               uint32_t vocab_size);

  ~TokenShard() override;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  uint64_t num_tokens() const override { return num_tokens_; }
  uint32_t vocab_size() const override { return vocab_size_; }
  // Bytes per token on disk: 2 or 4.
  uint32_t dtype_bytes() const { return dtype_bytes_; }
  // Where the tokens start in the file.
  size_t header_bytes() const { return header_bytes_; }
  const std::string& path() const { return path_; }

  // Precondition: offset + count <= num_tokens() (checked only by assert).
  void Read(uint64_t offset, uint64_t count, int64_t* out) const override;

  // Reads every token and returns kInvalidArgument naming the path and the byte offset of the
  // first one >= vocab_size(). Touches the whole file: for preparing and verifying corpora.
  absl::Status CheckTokenRange() const;

 private:
  TokenShard(std::string path, void* mapping, size_t mapping_bytes, std::string bytes,
             size_t header_bytes, uint32_t dtype_bytes, uint64_t num_tokens, uint32_t vocab_size);
  // The file's first byte: the mapping's, or that of the bytes held in memory.
  const char* data() const {
    return mapping_ != nullptr ? static_cast<const char*>(mapping_) : bytes_.data();
  }

  const std::string path_;
  void* const mapping_;  // owned, munmap'ed in the destructor; null for a shard held in memory
  const size_t mapping_bytes_;
  const std::string bytes_;  // the file of FromBytes
  const size_t header_bytes_;
  const uint32_t dtype_bytes_;
  const uint64_t num_tokens_;
  const uint32_t vocab_size_;
};

// The token shards of one corpus directory, each opened (TokenShard::Open of dir/file, same
// errors) on first use and kept open. The format and vocab_size of the files come from the
// directory's manifest (common/corpus_manifest.h), read on the first Get; a directory without
// one holds ALOE token shards. Not thread-safe; the shards it returns are, and live as long as
// the cache.
class TokenShardCache {
 public:
  explicit TokenShardCache(std::string dir) : dir_(std::move(dir)) {}
  // The manifest's errors other than kNotFound, or Open's.
  absl::StatusOr<const TokenShard*> Get(const std::string& file);
  const std::string& dir() const { return dir_; }

 private:
  const std::string dir_;
  bool read_manifest_ = false;
  TokenFileFormat format_ = TokenFileFormat::kAloe;
  uint32_t vocab_size_ = 0;
  std::map<std::string, std::unique_ptr<TokenShard>> shards_;
};

}  // namespace aloe
