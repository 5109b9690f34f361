// The corpus manifest: the index of a prepared corpus directory, read by workers to find their
// data shards and by the evaluator to find the held-out split.
//
// A corpus directory holds one token shard file per data shard (common/token_shard.h) and
// `manifest.tsv`:
//
//   # name<TAB>file<TAB>tokens<TAB>split
//   abraham_lincoln<TAB>shards/abraham_lincoln.tok<TAB>123456<TAB>train
//   heldout<TAB>shards/heldout.tok<TAB>54321<TAB>heldout
//
// The first line is exactly that header. Each further non-empty line describes one data shard:
//   name   unique, non-empty identifier (for the SotU corpus: the speaker, "george_washington");
//   file   path of the shard relative to the corpus directory (no leading '/', no "..");
//   tokens the shard's token count, > 0 (the shard header is authoritative; see
//          VerifyCorpusShards);
//   split  "train" or "heldout".
// A manifest has at least one train data shard. Fields never contain tabs or newlines.
//
// Property lines "# KEY<TAB>VALUE" may follow the header (aloe-corpus writes them first):
//   tokenizer   what produced the ids: byte, gpt2, sentencepiece (tokenizer.model beside the
//               manifest), or a name given with token files;
//   vocab_size  the number of token ids; every id is below it. The model's vocab_size must be
//               at least this;
//   format      how the shard files are laid out (common/token_shard.h): aloe (the default),
//               llmc or uint16. The last two need vocab_size, which their files lack.
// Older manifests have none: their shards are ALOE token shards whose headers hold vocab_size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/token_shard.h"

namespace aloe {

inline constexpr char kCorpusManifestFileName[] = "manifest.tsv";
inline constexpr char kCorpusManifestHeader[] = "# name\tfile\ttokens\tsplit";

struct CorpusShardInfo {
  std::string name;
  std::string file;  // relative to the corpus directory
  uint64_t tokens = 0;
  bool heldout = false;  // split "heldout" when true, "train" otherwise

  bool operator==(const CorpusShardInfo& other) const {
    return name == other.name && file == other.file && tokens == other.tokens &&
           heldout == other.heldout;
  }
};

// A whole manifest: its properties and its shards.
struct CorpusInfo {
  std::string tokenizer;    // empty when the manifest does not say
  uint32_t vocab_size = 0;  // 0 when the manifest does not say
  TokenFileFormat format = TokenFileFormat::kAloe;
  std::vector<CorpusShardInfo> shards;
};

// Path of the manifest inside corpus directory `dir`.
std::string CorpusManifestPath(const std::string& dir);

// Reads and validates `dir`/manifest.tsv; returns the shards in file order. Errors (messages
// name the manifest path):
//   kNotFound        the manifest does not exist;
//   kInvalidArgument wrong header line, a row without exactly 4 tab-separated fields, an empty
//                    name or file, an absolute file path or one containing "..", a token count
//                    that is not a positive integer, an unknown split, a duplicate name (these
//                    name the 1-based line number), or no train shard at all;
//   kInternal        the manifest exists but cannot be read.
// Does not open the shards; see VerifyCorpusShards.
absl::StatusOr<std::vector<CorpusShardInfo>> LoadCorpusManifest(const std::string& dir);
// The same with the properties; kInvalidArgument also for a malformed or unknown property line
// and for format llmc or uint16 without vocab_size.
absl::StatusOr<CorpusInfo> LoadCorpusInfo(const std::string& dir);

// Writes `shards` as `dir`/manifest.tsv, atomically (temporary file, fsync, rename). `dir` must
// exist. Returns kInvalidArgument, without writing, when `shards` would not load back (same rules
// as LoadCorpusManifest; fields with tabs or newlines), kInternal on I/O failure.
absl::Status WriteCorpusManifest(const std::string& dir,
                                 const std::vector<CorpusShardInfo>& shards);
// The same with the properties of `corpus` (those set) before the rows.
absl::Status WriteCorpusManifest(const std::string& dir, const CorpusInfo& corpus);

// Opens every shard in `shards` (paths relative to `dir`) and checks that its token count
// equals the manifest's and that all shards share one vocab_size (one corpus, one tokenizer).
// Returns the first failure: TokenShard::Open's error (kNotFound for a missing shard), or
// kInvalidArgument naming the shard file when a count or the vocab_size differs.
absl::Status VerifyCorpusShards(const std::string& dir, const std::vector<CorpusShardInfo>& shards);
// The same for shards of corpus.format, whose vocab_size, when set, every shard must have.
absl::Status VerifyCorpus(const std::string& dir, const CorpusInfo& corpus);

// The vocab_size of the corpus in `dir`: the manifest's property, else its first shard's
// header. LoadCorpusInfo's and TokenShard::Open's errors.
absl::StatusOr<uint32_t> CorpusVocabSize(const std::string& dir);

}  // namespace aloe
