// libFuzzer target for the safetensors reader (common/safetensors.h) and the model loader on top
// of it (common/safetensors_model.h): a job's init_file, a file from anywhere, goes through
// both. Built with ASan + UBSan (tests/fuzz/CMakeLists.txt).
//
// Input: any bytes, decoded from memory as a safetensors file, then loaded into a tiny built-in
// transformer (tokenizer vocabulary 4, one block of width 2).
//
// Oracle, on every input (a violation aborts, which libFuzzer reports as a crash):
//   - DecodeSafetensors accepts, or refuses with kInvalidArgument whose message starts with the
//     file name.
//   - An accepted file has unique tensor names other than __metadata__, each tensor holds as
//     many values as its shape's product (no overflow), and all of them fit the input's bytes.
//   - Written again by EncodeSafetensors it reads back to the same names, shapes, bit-identical
//     values and metadata, and writing that once more gives the same bytes.
//   - SetInitialParameters either refuses with kInvalidArgument naming the file and leaves the
//     parameters unchanged, or puts each tensor's values, found by its spec or GPT-2-style name,
//     into its place; a shard process holding only some layers gets the same values in those
//     and nothing in the others. The loaded model, exported with ModelTensors under either
//     naming, loads back to the same parameters.
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "common/model_spec.h"
#include "common/safetensors.h"
#include "common/safetensors_model.h"
#include "proto/aloe.pb.h"
#include "tests/fuzz/fuzz_check.h"

namespace aloe {
namespace {

constexpr char kSource[] = "fuzz.safetensors";

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

bool SameParameters(const std::vector<std::vector<float>>& a,
                    const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t l = 0; l < a.size(); ++l) {
    if (!SameBits(a[l], b[l])) return false;
  }
  return true;
}

std::map<std::string, const SafetensorsTensor*> ByName(const SafetensorsFile& file) {
  std::map<std::string, const SafetensorsTensor*> out;
  for (const SafetensorsTensor& t : file.tensors) out[t.name] = &t;
  return out;
}

// The tensors' product of dimensions, or false when it overflows 64 bits.
bool Elements(const std::vector<int64_t>& shape, uint64_t* n) {
  *n = 1;
  for (int64_t d : shape) {
    if (d == 0) {
      *n = 0;
      return true;
    }
  }
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(*n, static_cast<uint64_t>(d), n)) return false;
  }
  return true;
}

void CheckSameFile(const SafetensorsFile& a, const SafetensorsFile& b, const char* what) {
  FUZZ_CHECK(a.metadata == b.metadata, "%s: metadata changed", what);
  FUZZ_CHECK(a.tensors.size() == b.tensors.size(), "%s: %zu tensors became %zu", what,
             a.tensors.size(), b.tensors.size());
  // By name: tensors of no bytes share their offset with another, so data order is not unique.
  const auto b_by_name = ByName(b);
  for (const SafetensorsTensor& t : a.tensors) {
    const auto it = b_by_name.find(t.name);
    FUZZ_CHECK(it != b_by_name.end(), "%s: tensor %s lost", what, t.name.c_str());
    FUZZ_CHECK(it->second->shape == t.shape, "%s: tensor %s changed shape", what, t.name.c_str());
    FUZZ_CHECK(SameBits(it->second->values, t.values), "%s: tensor %s changed values", what,
               t.name.c_str());
  }
}

const v1::ModelSpec& TinySpec() {
  static const v1::ModelSpec* spec = [] {
    v1::TransformerConfig c;
    c.set_vocab_size(4);
    c.set_seq_len(2);
    c.set_d_model(2);
    c.set_num_layers(1);
    c.set_num_heads(1);
    c.set_ffn_mult(1);
    FillTransformerDefaults(&c);
    FUZZ_CHECK(ValidateTransformerConfig(c).ok(), "the tiny transformer does not validate");
    return new v1::ModelSpec(BuildTransformerSpec(c, 1));
  }();
  return *spec;
}

// Loads `file` into the tiny model, whole and as a shard process holding every other layer.
void CheckLoad(const SafetensorsFile& file) {
  const v1::ModelSpec& spec = TinySpec();
  const std::vector<std::vector<float>> before = InitializeParameters(spec, 1);
  std::vector<std::vector<float>> whole = before;
  const absl::Status loaded = SetInitialParameters(file, kSource, spec, &whole);
  std::vector<std::vector<float>> partial = before;
  for (size_t l = 1; l < partial.size(); l += 2) partial[l].clear();
  const std::vector<std::vector<float>> partial_before = partial;
  const absl::Status partial_loaded = SetInitialParameters(file, kSource, spec, &partial);
  FUZZ_CHECK(loaded == partial_loaded, "whole model: %s; shard process: %s",
             loaded.ToString().c_str(), partial_loaded.ToString().c_str());
  if (!loaded.ok()) {
    FUZZ_CHECK(loaded.code() == absl::StatusCode::kInvalidArgument &&
                   absl::StartsWith(loaded.message(), absl::StrCat(kSource, ": ")),
               "load refused with %s", loaded.ToString().c_str());
    FUZZ_CHECK(SameParameters(whole, before), "a refused file changed the parameters");
    FUZZ_CHECK(SameParameters(partial, partial_before), "a refused file changed a shard's");
    return;
  }
  // Every spec tensor under one of its names, in place, and nothing else.
  const auto by_name = ByName(file);
  size_t used = 0;
  for (int l = 0; l < spec.layers_size(); ++l) {
    size_t offset = 0;
    for (const v1::TensorSpec& t : spec.layers(l).tensors()) {
      auto it = by_name.find(t.name());
      if (it == by_name.end()) it = by_name.find(Gpt2StyleName(t.name()));
      FUZZ_CHECK(it != by_name.end(), "loaded without tensor %s", t.name().c_str());
      const std::vector<float>& v = it->second->values;
      FUZZ_CHECK(offset + v.size() <= whole[l].size() &&
                     (v.empty() || std::memcmp(whole[l].data() + offset, v.data(),
                                               v.size() * sizeof(float)) == 0),
                 "tensor %s not in its place", t.name().c_str());
      offset += v.size();
      ++used;
    }
    FUZZ_CHECK(offset == whole[l].size(), "layer %d holds %zu values, its tensors %zu", l,
               whole[l].size(), offset);
    FUZZ_CHECK(l % 2 == 1 ? partial[l].empty() : SameBits(partial[l], whole[l]),
               "the shard process's layer %d differs", l);
  }
  FUZZ_CHECK(used == file.tensors.size(), "loaded a file of %zu tensors for %zu", used,
             file.tensors.size());
  // Export and load again, under both namings.
  for (const bool gpt2 : {false, true}) {
    const absl::StatusOr<std::vector<SafetensorsTensor>> tensors = ModelTensors(spec, whole, gpt2);
    FUZZ_CHECK(tensors.ok(), "export refused: %s", tensors.status().ToString().c_str());
    const absl::StatusOr<SafetensorsFile> exported =
        DecodeSafetensors(EncodeSafetensors(*tensors, {}), kSource);
    FUZZ_CHECK(exported.ok(), "exported model refused: %s", exported.status().ToString().c_str());
    std::vector<std::vector<float>> again = before;
    const absl::Status reloaded = SetInitialParameters(*exported, kSource, spec, &again);
    FUZZ_CHECK(reloaded.ok(), "exported model does not load: %s", reloaded.ToString().c_str());
    FUZZ_CHECK(SameParameters(again, whole), "exported model loads other values");
  }
}

}  // namespace
}  // namespace aloe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace aloe;  // NOLINT(build/namespaces)
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<SafetensorsFile> file = DecodeSafetensors(bytes, kSource);
  if (!file.ok()) {
    FUZZ_CHECK(file.status().code() == absl::StatusCode::kInvalidArgument &&
                   absl::StartsWith(file.status().message(), absl::StrCat(kSource, ": ")),
               "refused with %s", file.status().ToString().c_str());
    return 0;
  }
  std::set<std::string> names;
  uint64_t min_bytes = 0;
  for (const SafetensorsTensor& t : file->tensors) {
    FUZZ_CHECK(t.name != "__metadata__" && names.insert(t.name).second,
               "tensor name %s reserved or twice", t.name.c_str());
    uint64_t n = 0;
    FUZZ_CHECK(Elements(t.shape, &n), "tensor %s: the shape's product overflows", t.name.c_str());
    FUZZ_CHECK(n == t.values.size(), "tensor %s: %zu values for %llu elements", t.name.c_str(),
               t.values.size(), static_cast<unsigned long long>(n));
    min_bytes += 2 * n;  // F16 and BF16 hold 2 bytes per value
  }
  FUZZ_CHECK(min_bytes <= size, "%llu bytes of values from a file of %zu",
             static_cast<unsigned long long>(min_bytes), size);

  const std::string encoded = EncodeSafetensors(file->tensors, file->metadata);
  const absl::StatusOr<SafetensorsFile> back = DecodeSafetensors(encoded, kSource);
  FUZZ_CHECK(back.ok(), "re-encoded file refused: %s", back.status().ToString().c_str());
  CheckSameFile(*file, *back, "re-encoded");
  FUZZ_CHECK(EncodeSafetensors(back->tensors, back->metadata) == encoded, "encoding is not stable");

  CheckLoad(*file);
  return 0;
}
