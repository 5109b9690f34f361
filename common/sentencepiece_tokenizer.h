// SentencePiece tokenizers (Debian's libsentencepiece): a model trained on the corpus or one
// brought along, e.g. a Llama-style BPE model with byte fallback.
//
// libsentencepiece is reached through libaloe_sentencepiece.so, found next to the running
// executable (or on the library path) and loaded on first use.
//
// Text is encoded one line at a time, as spm_encode does: SentencePiece's normalisation turns
// line breaks into spaces, so they are not tokens, and empty lines give no ids. Lines longer than
// 4000 bytes are encoded in pieces cut at whitespace, which gives the same ids for models whose
// pieces do not span whitespace (SentencePiece's default).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tokenizer.h"

namespace aloe {

// How to train a model on a corpus (SentencePieceTokenizer::Train).
struct SentencePieceTrainOptions {
  uint32_t vocab_size = 8000;
  // "bpe" or "unigram" (spm_train's --model_type; also "char", "word").
  std::string model_type = "bpe";
  // Further spm_train options as name=value pairs separated by spaces, e.g.
  // "character_coverage=0.9995 byte_fallback=false"; applied last, so they override.
  std::string extra_options;
};

struct SentencePieceApi;

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Loads the .model file at `path`. kNotFound when it does not exist; kInvalidArgument naming
  // the path when SentencePiece cannot load it; kFailedPrecondition when
  // libaloe_sentencepiece.so cannot be loaded (the same for Train).
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Load(const std::string& path);

  // Trains a model on the lines of `input_file` and writes it to `model_path` (and the vocabulary
  // listing next to it, with ".vocab" for ".model"). Byte fallback is on and the unknown-piece
  // id is 0, as in Llama's models, so any text encodes. kInvalidArgument naming the option or
  // SentencePiece's message when training fails (e.g. a vocab_size the text cannot fill).
  static absl::Status Train(const std::string& input_file, const std::string& model_path,
                            const SentencePieceTrainOptions& options);

  ~SentencePieceTokenizer() override;
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  std::vector<uint32_t> Encode(std::string_view text) const override;
  uint32_t vocab_size() const override { return vocab_size_; }
  std::string name() const override { return "sentencepiece"; }

  // Appends `text` to *out as Train's input wants it: the sentences Encode would encode, one
  // per line.
  static void AppendTrainingLines(std::string_view text, std::string* out);

  // The text of `ids` (SentencePiece's decoding: pieces joined, "▁" back to spaces).
  std::string Decode(const std::vector<uint32_t>& ids) const;

 private:
  SentencePieceTokenizer(const SentencePieceApi& api, void* model, uint32_t vocab_size)
      : api_(api), model_(model), vocab_size_(vocab_size) {}

  const SentencePieceApi& api_;
  void* const model_;  // owned
  const uint32_t vocab_size_;
};

}  // namespace aloe
