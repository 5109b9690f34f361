#include "common/corpus_manifest.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/durable_file.h"
#include "common/status_macros.h"
#include "common/token_shard.h"

namespace aloe {
namespace {

constexpr absl::string_view kTrain = "train";
constexpr absl::string_view kHeldout = "heldout";

// Checks the per-row rules shared by the reader and the writer. Returns an empty string when
// the row is fine, otherwise what is wrong with it.
std::string RowProblem(const CorpusShardInfo& shard) {
  if (shard.name.empty()) return "empty shard name";
  if (shard.file.empty()) return absl::StrFormat("shard %s has an empty file path", shard.name);
  if (shard.file[0] == '/') {
    return absl::StrFormat("shard %s: file \"%s\" must be relative to the corpus directory",
                           shard.name, shard.file);
  }
  for (absl::string_view part : absl::StrSplit(shard.file, '/')) {
    if (part == "..") {
      return absl::StrFormat("shard %s: file \"%s\" must stay inside the corpus directory",
                             shard.name, shard.file);
    }
  }
  if (shard.tokens == 0) return absl::StrFormat("shard %s has zero tokens", shard.name);
  return "";
}

// Reads one "KEY<TAB>VALUE" property line (after its "# ") into `corpus`.
absl::Status ParseProperty(absl::string_view property, CorpusInfo* corpus) {
  std::vector<absl::string_view> kv = absl::StrSplit(property, absl::MaxSplits('\t', 1));
  if (kv.size() != 2 || kv[1].empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "expected \"# KEY<TAB>VALUE\" (tokenizer, vocab_size or format), got \"# %s\"",
        absl::CEscape(property)));
  }
  if (kv[0] == "tokenizer") {
    corpus->tokenizer = std::string(kv[1]);
  } else if (kv[0] == "vocab_size") {
    if (!absl::SimpleAtoi(kv[1], &corpus->vocab_size) || corpus->vocab_size == 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("vocab_size \"%s\" is not a positive integer", absl::CEscape(kv[1])));
    }
  } else if (kv[0] == "format") {
    ALOE_ASSIGN_OR_RETURN(corpus->format, ParseTokenFileFormat(std::string(kv[1])));
  } else {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unknown property \"%s\" (tokenizer, vocab_size or format)", absl::CEscape(kv[0])));
  }
  return absl::OkStatus();
}

}  // namespace

std::string CorpusManifestPath(const std::string& dir) {
  return dir + "/" + kCorpusManifestFileName;
}

absl::StatusOr<std::vector<CorpusShardInfo>> LoadCorpusManifest(const std::string& dir) {
  ALOE_ASSIGN_OR_RETURN(CorpusInfo corpus, LoadCorpusInfo(dir));
  return std::move(corpus.shards);
}

absl::StatusOr<CorpusInfo> LoadCorpusInfo(const std::string& dir) {
  const std::string path = CorpusManifestPath(dir);
  ALOE_ASSIGN_OR_RETURN(const std::string contents, ReadWholeFile(path));
  auto bad_line = [&path](int line_no, const std::string& problem) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: line %d: %s", path, line_no, problem));
  };

  CorpusInfo corpus;
  std::vector<CorpusShardInfo>& shards = corpus.shards;
  absl::flat_hash_map<std::string, int> line_of_name;
  bool any_train = false;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    ++line_no;
    if (absl::EndsWith(line, "\r")) line.remove_suffix(1);  // tolerate CRLF from editors
    if (line_no == 1) {
      if (line != kCorpusManifestHeader) {
        return bad_line(1, absl::StrFormat("expected the header \"%s\" (tab-separated)",
                                           absl::CEscape(kCorpusManifestHeader)));
      }
      continue;
    }
    if (line.empty()) continue;
    if (absl::StartsWith(line, "# ")) {
      if (absl::Status s = ParseProperty(line.substr(2), &corpus); !s.ok()) {
        return bad_line(line_no, std::string(s.message()));
      }
      continue;
    }
    std::vector<absl::string_view> fields = absl::StrSplit(line, '\t');
    if (fields.size() != 4) {
      return bad_line(line_no, absl::StrFormat("expected 4 tab-separated fields "
                                               "(name, file, tokens, split), found %d",
                                               fields.size()));
    }
    CorpusShardInfo shard;
    shard.name = std::string(fields[0]);
    shard.file = std::string(fields[1]);
    if (fields[2].empty() || fields[2].find_first_not_of("0123456789") != absl::string_view::npos ||
        !absl::SimpleAtoi(fields[2], &shard.tokens)) {
      return bad_line(line_no, absl::StrFormat("token count \"%s\" is not an unsigned 64-bit "
                                               "integer",
                                               absl::CEscape(fields[2])));
    }
    if (fields[3] == kTrain) {
      shard.heldout = false;
      any_train = true;
    } else if (fields[3] == kHeldout) {
      shard.heldout = true;
    } else {
      return bad_line(line_no, absl::StrFormat("unknown split \"%s\" (expected train or heldout)",
                                               absl::CEscape(fields[3])));
    }
    if (std::string problem = RowProblem(shard); !problem.empty()) {
      return bad_line(line_no, problem);
    }
    auto [it, inserted] = line_of_name.emplace(shard.name, line_no);
    if (!inserted) {
      return bad_line(line_no, absl::StrFormat("duplicate shard name %s (first on line %d)",
                                               shard.name, it->second));
    }
    shards.push_back(std::move(shard));
  }
  if (!any_train) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: no train shard (a corpus needs at least one)", path));
  }
  if (corpus.format != TokenFileFormat::kAloe && corpus.vocab_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: format %s needs a vocab_size line (the files do not record it)", path,
                        TokenFileFormatName(corpus.format)));
  }
  return corpus;
}

absl::Status WriteCorpusManifest(const std::string& dir,
                                 const std::vector<CorpusShardInfo>& shards) {
  CorpusInfo corpus;
  corpus.shards = shards;
  return WriteCorpusManifest(dir, corpus);
}

absl::Status WriteCorpusManifest(const std::string& dir, const CorpusInfo& corpus) {
  const std::vector<CorpusShardInfo>& shards = corpus.shards;
  const std::string path = CorpusManifestPath(dir);
  std::string out = std::string(kCorpusManifestHeader) + "\n";
  if (corpus.tokenizer.find_first_of("\t\r\n") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: not written: the tokenizer name has a tab or newline", path));
  }
  if (corpus.format != TokenFileFormat::kAloe && corpus.vocab_size == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: not written: format %s needs a vocab_size", path, TokenFileFormatName(corpus.format)));
  }
  if (!corpus.tokenizer.empty()) absl::StrAppend(&out, "# tokenizer\t", corpus.tokenizer, "\n");
  if (corpus.vocab_size != 0) absl::StrAppend(&out, "# vocab_size\t", corpus.vocab_size, "\n");
  if (corpus.format != TokenFileFormat::kAloe) {
    absl::StrAppend(&out, "# format\t", TokenFileFormatName(corpus.format), "\n");
  }
  absl::flat_hash_map<std::string, size_t> index_of_name;
  bool any_train = false;
  for (size_t i = 0; i < shards.size(); ++i) {
    const CorpusShardInfo& shard = shards[i];
    std::string problem = RowProblem(shard);
    if (problem.empty() && (shard.name.find_first_of("\t\r\n") != std::string::npos ||
                            shard.file.find_first_of("\t\r\n") != std::string::npos)) {
      problem = absl::StrFormat("shard \"%s\": name and file must not contain tabs or newlines",
                                absl::CEscape(shard.name));
    }
    if (problem.empty() && !index_of_name.emplace(shard.name, i).second) {
      problem = absl::StrFormat("duplicate shard name %s", shard.name);
    }
    if (!problem.empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: not written: shard %d: %s", path, i, problem));
    }
    any_train |= !shard.heldout;
    absl::StrAppendFormat(&out, "%s\t%s\t%d\t%s\n", shard.name, shard.file, shard.tokens,
                          shard.heldout ? kHeldout : kTrain);
  }
  if (!any_train) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: not written: no train shard (a corpus needs at least one)", path));
  }
  return WriteFileAtomically(path, out);
}

absl::Status VerifyCorpusShards(const std::string& dir,
                                const std::vector<CorpusShardInfo>& shards) {
  CorpusInfo corpus;
  corpus.shards = shards;
  return VerifyCorpus(dir, corpus);
}

absl::Status VerifyCorpus(const std::string& dir, const CorpusInfo& corpus) {
  uint32_t vocab_size = 0;
  std::string vocab_file;
  for (const CorpusShardInfo& info : corpus.shards) {
    const std::string path = dir + "/" + info.file;
    ALOE_ASSIGN_OR_RETURN(std::unique_ptr<TokenShard> shard,
                          TokenShard::Open(path, corpus.format, corpus.vocab_size));
    if (shard->num_tokens() != info.tokens) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: holds %d tokens but %s lists %d for shard %s", path,
                          shard->num_tokens(), CorpusManifestPath(dir), info.tokens, info.name));
    }
    if (vocab_size == 0) {
      vocab_size = shard->vocab_size();
      vocab_file = path;
    } else if (shard->vocab_size() != vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: vocab_size %d differs from %s (vocab_size %d); one corpus uses "
                          "one tokenizer",
                          path, shard->vocab_size(), vocab_file, vocab_size));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> CorpusVocabSize(const std::string& dir) {
  ALOE_ASSIGN_OR_RETURN(const CorpusInfo corpus, LoadCorpusInfo(dir));
  if (corpus.vocab_size != 0) return corpus.vocab_size;
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<TokenShard> shard,
                        TokenShard::Open(dir + "/" + corpus.shards.front().file));
  return shard->vocab_size();
}

}  // namespace aloe
