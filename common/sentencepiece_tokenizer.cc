#include "common/sentencepiece_tokenizer.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace aloe {

// The C interface of libaloe_sentencepiece.so (common/sentencepiece_module).
struct SentencePieceApi {
  void* (*load)(const char* path, char** error);
  void (*free_model)(void* model);
  void (*free_buffer)(void* buffer);
  int (*piece_size)(const void* model);
  int (*encode)(const void* model, const char* text, size_t len, int** ids, size_t* count,
                char** error);
  char* (*decode)(const void* model, const int* ids, size_t count);
  int (*train)(const char* const* names, const char* const* values, size_t count, char** error);
};

namespace {

constexpr char kModuleName[] = "libaloe_sentencepiece.so";

// The directory of the running executable, with a trailing '/'; empty when unknown.
std::string ExecutableDir() {
  char path[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "";
  const std::string exe(path, static_cast<size_t>(n));
  return exe.substr(0, exe.rfind('/') + 1);
}

absl::StatusOr<SentencePieceApi> OpenModule() {
  // RTLD_DEEPBIND: the module's copy of protobuf-lite must not meet the process's libprotobuf.
  constexpr int kFlags = RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND;
  const std::string beside = ExecutableDir() + kModuleName;
  void* handle = ::dlopen(beside.c_str(), kFlags);
  if (handle == nullptr) handle = ::dlopen(kModuleName, kFlags);
  if (handle == nullptr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "SentencePiece is unavailable: cannot load %s (built with the executables from "
        "libsentencepiece-dev): %s",
        beside, ::dlerror()));
  }
  SentencePieceApi api;
  bool missing = false;
  auto bind = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(handle, name));
    missing = missing || fn == nullptr;
  };
  bind(api.load, "aloe_spm_load");
  bind(api.free_model, "aloe_spm_free_model");
  bind(api.free_buffer, "aloe_spm_free_buffer");
  bind(api.piece_size, "aloe_spm_piece_size");
  bind(api.encode, "aloe_spm_encode");
  bind(api.decode, "aloe_spm_decode");
  bind(api.train, "aloe_spm_train");
  if (missing) {
    return absl::FailedPreconditionError(
        absl::StrFormat("SentencePiece is unavailable: %s lacks a function", beside));
  }
  return api;
}

// The module, loaded once per process and never unloaded.
absl::StatusOr<const SentencePieceApi*> Api() {
  static const absl::StatusOr<SentencePieceApi>* const api =
      new absl::StatusOr<SentencePieceApi>(OpenModule());
  if (!api->ok()) return api->status();
  return &**api;
}

// Takes a malloc'ed message from the module.
std::string TakeError(const SentencePieceApi& api, char* error) {
  std::string message = error != nullptr ? error : "unknown error";
  api.free_buffer(error);
  return message;
}

}  // namespace

namespace {

// Calls f(sentence) for each non-empty line of `text`, cutting lines longer than
// kMaxSentenceBytes at their last whitespace before the limit (or, without one, at a UTF-8
// character boundary). SentencePiece skips training sentences above 4192 bytes, and its pieces
// do not span whitespace, so the cut changes no ids.
template <typename F>
void ForEachSentence(std::string_view text, F&& f) {
  constexpr size_t kMaxSentenceBytes = 4000;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    while (line.size() > kMaxSentenceBytes) {
      size_t cut = line.find_last_of(" \t\r", kMaxSentenceBytes);
      if (cut == std::string_view::npos || cut == 0) {
        cut = kMaxSentenceBytes;
        while (cut > 0 && (static_cast<unsigned char>(line[cut]) & 0xc0) == 0x80) --cut;
      }
      f(line.substr(0, cut));
      line.remove_prefix(cut);
    }
    if (!line.empty()) f(line);
    start = end + 1;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::Load(
    const std::string& path) {
  if (::access(path.c_str(), F_OK) != 0) {
    return absl::NotFoundError(absl::StrFormat("%s: no such file", path));
  }
  ALOE_ASSIGN_OR_RETURN(const SentencePieceApi* api, Api());
  char* error = nullptr;
  void* model = api->load(path.c_str(), &error);
  if (model == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: not a SentencePiece model: %s", path, TakeError(*api, error)));
  }
  const int pieces = api->piece_size(model);
  if (pieces <= 0) {
    api->free_model(model);
    return absl::InvalidArgumentError(absl::StrFormat("%s: the model has no pieces", path));
  }
  return std::unique_ptr<SentencePieceTokenizer>(
      new SentencePieceTokenizer(*api, model, static_cast<uint32_t>(pieces)));
}

SentencePieceTokenizer::~SentencePieceTokenizer() { api_.free_model(model_); }

absl::Status SentencePieceTokenizer::Train(const std::string& input_file,
                                           const std::string& model_path,
                                           const SentencePieceTrainOptions& options) {
  if (!absl::EndsWith(model_path, ".model")) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: a SentencePiece model path must end in .model", model_path));
  }
  std::vector<std::pair<std::string, std::string>> args = {
      {"input", input_file},
      {"model_prefix", model_path.substr(0, model_path.size() - 6)},
      {"vocab_size", absl::StrCat(options.vocab_size)},
      {"model_type", options.model_type},
      {"byte_fallback", "true"},
      // Deterministic output for the same text: all sentences, in file order.
      {"input_sentence_size", "0"},
      {"shuffle_input_sentence", "false"},
  };
  // Extra options come last and replace earlier values of the same name.
  for (absl::string_view option : absl::StrSplit(options.extra_options, ' ', absl::SkipEmpty())) {
    const size_t eq = option.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "SentencePiece option \"%s\": expected name=value (spm_train's options without the "
          "leading --)",
          option));
    }
    std::string name(option.substr(0, eq));
    if (absl::StartsWith(name, "--")) name = name.substr(2);
    std::pair<std::string, std::string> arg(name, std::string(option.substr(eq + 1)));
    auto same =
        std::find_if(args.begin(), args.end(), [&](const auto& a) { return a.first == name; });
    if (same != args.end()) {
      *same = std::move(arg);
    } else {
      args.push_back(std::move(arg));
    }
  }
  ALOE_ASSIGN_OR_RETURN(const SentencePieceApi* api, Api());
  std::vector<const char*> names, values;
  for (const auto& [name, value] : args) {
    names.push_back(name.c_str());
    values.push_back(value.c_str());
  }
  char* error = nullptr;
  if (api->train(names.data(), values.data(), args.size(), &error) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "training a SentencePiece model on %s (vocab_size %d, model_type %s) failed: %s",
        input_file, options.vocab_size, options.model_type, TakeError(*api, error)));
  }
  return absl::OkStatus();
}

std::vector<uint32_t> SentencePieceTokenizer::Encode(std::string_view text) const {
  std::vector<uint32_t> out;
  ForEachSentence(text, [&](std::string_view sentence) {
    int* ids = nullptr;
    size_t count = 0;
    char* error = nullptr;
    // A loaded model fails to encode only on bad handles: there is nothing to report.
    if (api_.encode(model_, sentence.data(), sentence.size(), &ids, &count, &error) == 0) {
      out.insert(out.end(), ids, ids + count);
      api_.free_buffer(ids);
    } else {
      api_.free_buffer(error);
    }
  });
  return out;
}

void SentencePieceTokenizer::AppendTrainingLines(std::string_view text, std::string* out) {
  ForEachSentence(text, [out](std::string_view sentence) {
    out->append(sentence);
    out->push_back('\n');
  });
}

std::string SentencePieceTokenizer::Decode(const std::vector<uint32_t>& ids) const {
  const std::vector<int> signed_ids(ids.begin(), ids.end());
  char* text = api_.decode(model_, signed_ids.data(), signed_ids.size());
  std::string out(text);
  api_.free_buffer(text);
  return out;
}

}  // namespace aloe
