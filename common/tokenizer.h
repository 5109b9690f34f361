// Text -> token ids, for corpus preparation (aloe-corpus). The model only ever sees ids, so the
// tokenizer that produced a corpus fixes the vocab_size the model must be built with; every
// token shard records that vocab_size in its header.
//
// Implementations: ByteTokenizer (vocab 256, one token per byte, lossless and dependency-free).
// A SentencePiece BPE tokenizer can implement the same interface later; token shards already
// store uint32 ids for vocabs above 65536 (common/token_shard.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace aloe {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Maps text to token ids, each < vocab_size(). Deterministic: the same text always gives the
  // same ids. Thread-safe (const).
  virtual std::vector<uint32_t> Encode(std::string_view text) const = 0;
  // Number of distinct ids; every id Encode returns is below it.
  virtual uint32_t vocab_size() const = 0;
  // Short stable identifier recorded alongside corpora, e.g. "byte".
  virtual std::string name() const = 0;
};

// One token per byte: id = the byte's unsigned value (0..255). Any byte sequence, UTF-8 or
// not, round-trips exactly.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr uint32_t kVocabSize = 256;

  std::vector<uint32_t> Encode(std::string_view text) const override;
  uint32_t vocab_size() const override { return kVocabSize; }
  std::string name() const override { return "byte"; }
};

}  // namespace aloe
