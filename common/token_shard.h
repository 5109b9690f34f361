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

// Writes `tokens` as a version-1 token shard at `path` (atomically, see WriteFileAtomically in
// common/durable_file.h).
// Stores uint16 tokens when vocab_size <= 65536, else uint32. Returns kInvalidArgument when
// vocab_size is 0 or a token is >= vocab_size (the message names the first such index).
absl::Status WriteTokenShard(const std::string& path, absl::Span<const uint32_t> tokens,
                             uint32_t vocab_size);

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

  ~TokenShard() override;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  uint64_t num_tokens() const override { return num_tokens_; }
  uint32_t vocab_size() const override { return vocab_size_; }
  // Bytes per token on disk: 2 or 4.
  uint32_t dtype_bytes() const { return dtype_bytes_; }
  const std::string& path() const { return path_; }

  // Precondition: offset + count <= num_tokens() (checked only by assert).
  void Read(uint64_t offset, uint64_t count, int64_t* out) const override;

 private:
  TokenShard(std::string path, void* mapping, size_t mapping_bytes, uint32_t dtype_bytes,
             uint64_t num_tokens, uint32_t vocab_size);

  const std::string path_;
  void* const mapping_;  // owned; munmap'ed in the destructor
  const size_t mapping_bytes_;
  const uint32_t dtype_bytes_;
  const uint64_t num_tokens_;
  const uint32_t vocab_size_;
};

// The token shards of one corpus directory, each opened (TokenShard::Open of dir/file, same
// errors) on first use and kept open. Not thread-safe; the shards it returns are, and live as
// long as the cache.
class TokenShardCache {
 public:
  explicit TokenShardCache(std::string dir) : dir_(std::move(dir)) {}
  absl::StatusOr<const TokenShard*> Get(const std::string& file);
  const std::string& dir() const { return dir_; }

 private:
  const std::string dir_;
  std::map<std::string, std::unique_ptr<TokenShard>> shards_;
};

}  // namespace aloe
