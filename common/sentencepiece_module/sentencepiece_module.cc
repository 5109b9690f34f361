// libaloe_sentencepiece.so: a C interface to Debian's libsentencepiece, loaded at run time by
// common/sentencepiece_tokenizer.cc with RTLD_DEEPBIND.
//
// Why a separate module: libsentencepiece carries its own copy of protobuf-lite (an older
// version) with exported symbols. Linked into a process that also uses the system libprotobuf,
// one library's calls land in the other's copy and protobuf aborts at start-up. Loaded with
// RTLD_LOCAL | RTLD_DEEPBIND, the module and libsentencepiece resolve their symbols among
// themselves first, and the rest of the process never sees them. This file includes no
// Abseil headers: SentencePiece's headers declare their own absl::string_view.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

// Exported by libsentencepiece, not declared in its public headers.
namespace sentencepiece::logging {
void SetMinLogLevel(int v);
}  // namespace sentencepiece::logging

namespace {

// SentencePiece's log lines go to std::cerr, and under RTLD_DEEPBIND the library binds to an
// unconstructed std::cerr (the executable holds the live copy). Only FATAL stays, which aborts
// anyway; failures come back as Status.
const bool kQuiet = [] {
  sentencepiece::logging::SetMinLogLevel(3);
  return true;
}();

char* CopyString(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  return out;
}

}  // namespace

extern "C" {

// Returns a model handle, or null with *error set (free it with aloe_spm_free_buffer).
void* aloe_spm_load(const char* path, char** error) {
  auto* processor = new sentencepiece::SentencePieceProcessor();
  const sentencepiece::util::Status status = processor->Load(path);
  if (!status.ok()) {
    *error = CopyString(status.ToString());
    delete processor;
    return nullptr;
  }
  return processor;
}

void aloe_spm_free_model(void* model) {
  delete static_cast<sentencepiece::SentencePieceProcessor*>(model);
}

void aloe_spm_free_buffer(void* buffer) { std::free(buffer); }

int aloe_spm_piece_size(const void* model) {
  return static_cast<const sentencepiece::SentencePieceProcessor*>(model)->GetPieceSize();
}

// Encodes text[0, len) into a malloc'ed array *ids of *count ids; 0 on success, else -1 with
// *error set.
int aloe_spm_encode(const void* model, const char* text, size_t len, int** ids, size_t* count,
                    char** error) {
  std::vector<int> out;
  const sentencepiece::util::Status status =
      static_cast<const sentencepiece::SentencePieceProcessor*>(model)->Encode(
          std::string_view(text, len), &out);
  if (!status.ok()) {
    *error = CopyString(status.ToString());
    return -1;
  }
  *count = out.size();
  *ids = static_cast<int*>(std::malloc(sizeof(int) * (out.empty() ? 1 : out.size())));
  std::memcpy(*ids, out.data(), sizeof(int) * out.size());
  return 0;
}

// The text of ids[0, count), malloc'ed.
char* aloe_spm_decode(const void* model, const int* ids, size_t count) {
  std::string text;
  static_cast<const sentencepiece::SentencePieceProcessor*>(model)
      ->Decode(std::vector<int>(ids, ids + count), &text)
      .IgnoreError();
  return CopyString(text);
}

// Trains with spm_train's options as `count` name/value pairs; 0 on success, else -1 with
// *error set.
int aloe_spm_train(const char* const* names, const char* const* values, size_t count,
                   char** error) {
  std::unordered_map<std::string, std::string> kwargs;
  for (size_t i = 0; i < count; ++i) kwargs[names[i]] = values[i];
  const sentencepiece::util::Status status = sentencepiece::SentencePieceTrainer::Train(kwargs);
  if (!status.ok()) {
    *error = CopyString(status.ToString());
    return -1;
  }
  return 0;
}

}  // extern "C"
