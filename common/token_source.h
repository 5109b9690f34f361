// A read-only sequence of token ids: a memory-mapped token shard (common/token_shard.h) or an
// in-memory vector in tests.
#pragma once

#include <cstdint>
#include <vector>

namespace aloe {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual uint64_t num_tokens() const = 0;
  virtual uint32_t vocab_size() const = 0;
  // Copies tokens [offset, offset + count) to out. Precondition: offset + count <= num_tokens().
  // Thread-safe (reads only).
  virtual void Read(uint64_t offset, uint64_t count, int64_t* out) const = 0;
};

// Tokens held in a vector. For tests.
class InMemoryTokenSource final : public TokenSource {
 public:
  InMemoryTokenSource(std::vector<uint32_t> tokens, uint32_t vocab_size)
      : tokens_(std::move(tokens)), vocab_size_(vocab_size) {}
  uint64_t num_tokens() const override { return tokens_.size(); }
  uint32_t vocab_size() const override { return vocab_size_; }
  void Read(uint64_t offset, uint64_t count, int64_t* out) const override {
    for (uint64_t i = 0; i < count; ++i) out[i] = tokens_[offset + i];
  }

 private:
  std::vector<uint32_t> tokens_;
  uint32_t vocab_size_;
};

}  // namespace aloe
