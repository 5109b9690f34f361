#include "worker/inner_state_store.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/byte_io.h"
#include "common/durable_file.h"
#include "common/status_macros.h"

namespace aloe::worker {
namespace {

constexpr char kMagic[8] = {'A', 'L', 'O', 'E', 'I', 'N', 'N', 'R'};
constexpr uint32_t kFormat = 1;

void AppendFloats(const std::vector<float>& values, std::string* out) {
  out->append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

}  // namespace

uint32_t ModelSpecDigest(const v1::ModelSpec& spec) {
  std::string text;
  for (const v1::LayerSpec& layer : spec.layers()) {
    for (const v1::TensorSpec& tensor : layer.tensors()) {
      absl::StrAppend(&text, tensor.name(), ":");
      for (int64_t d : tensor.shape()) absl::StrAppend(&text, d, "x");
      text += ';';
    }
    text += '|';
  }
  return Crc32c(text);
}

std::string EncodeInnerState(const InnerStateOwner& owner, const InnerState& state) {
  std::string out(kMagic, sizeof(kMagic));
  AppendPod<uint32_t>(kFormat, &out);
  AppendPod<uint32_t>(owner.rank, &out);
  AppendPod<uint32_t>(owner.ranks, &out);
  AppendPod<uint32_t>(owner.spec_digest, &out);
  AppendPod<uint64_t>(state.steps, &out);
  AppendPod<uint32_t>(static_cast<uint32_t>(state.first.size()), &out);
  for (size_t l = 0; l < state.first.size(); ++l) {
    AppendPod<uint64_t>(state.first[l].size(), &out);
    AppendFloats(state.first[l], &out);
    AppendFloats(state.second[l], &out);
  }
  AppendPod<uint32_t>(Crc32c(out), &out);
  return out;
}

absl::StatusOr<InnerState> DecodeInnerState(std::string_view bytes, const InnerStateOwner& owner,
                                            const std::string& source) {
  const auto damaged = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(source, ": ", what));
  };
  if (bytes.size() < sizeof(kMagic) + sizeof(uint32_t)) {
    return damaged(absl::StrFormat("truncated (%d bytes)", bytes.size()));
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return damaged("not an inner optimizer state (bad magic)");
  }
  std::string_view body = bytes.substr(0, bytes.size() - sizeof(uint32_t));
  std::string_view tail = bytes.substr(body.size());
  uint32_t crc = 0;
  ReadPod(&tail, &crc);
  if (Crc32c(body) != crc) return damaged("checksum mismatch (damaged or truncated)");
  body.remove_prefix(sizeof(kMagic));
  uint32_t format = 0, rank = 0, ranks = 0, digest = 0, layers = 0;
  InnerState state;
  if (!ReadPod(&body, &format) || !ReadPod(&body, &rank) || !ReadPod(&body, &ranks) ||
      !ReadPod(&body, &digest) || !ReadPod(&body, &state.steps) || !ReadPod(&body, &layers)) {
    return damaged("truncated header");
  }
  if (format != kFormat) return damaged(absl::StrFormat("unknown format %d", format));
  if (digest != owner.spec_digest) {
    return absl::FailedPreconditionError(
        absl::StrCat(source, ": saved for another model (its tensors differ from this job's)"));
  }
  if (rank != owner.rank || ranks != owner.ranks) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: saved by rank %d of %d, this is rank %d of %d", source, rank, ranks,
                        owner.rank, owner.ranks));
  }
  state.first.resize(layers);
  state.second.resize(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    uint64_t n = 0;
    if (!ReadPod(&body, &n) || body.size() / (2 * sizeof(float)) < n) {
      return damaged(absl::StrFormat("layer %d truncated", l));
    }
    for (std::vector<float>* moments : {&state.first[l], &state.second[l]}) {
      moments->resize(n);
      std::memcpy(moments->data(), body.data(), n * sizeof(float));
      body.remove_prefix(n * sizeof(float));
    }
  }
  if (!body.empty()) return damaged(absl::StrFormat("%d bytes past the last layer", body.size()));
  return state;
}

InnerStateStore::InnerStateStore(std::string dir, const InnerStateOwner& owner)
    : dir_(std::move(dir)),
      owner_(owner),
      path_(absl::StrFormat("%s/inner-state-%d-of-%d.aloeinner", dir_, owner.rank, owner.ranks)) {}

absl::Status InnerStateStore::Save(const InnerState& state) const {
  ALOE_RETURN_IF_ERROR(MakeDirectories(dir_));
  return WriteFileAtomically(path_, EncodeInnerState(owner_, state));
}

absl::StatusOr<InnerState> InnerStateStore::Load() const {
  ALOE_ASSIGN_OR_RETURN(const std::string bytes, ReadWholeFile(path_));
  return DecodeInnerState(bytes, owner_, path_);
}

}  // namespace aloe::worker
