// Where a worker keeps its inner optimizer state between runs (aloe-worker --state_dir), so that
// a worker restarted after a preemption or a crash trains on with its AdamW moments instead of
// fresh ones. One file per rank: <dir>/inner-state-<rank>-of-<ranks>.aloeinner, replaced
// atomically (common/durable_file.h).
//
// File layout (little-endian): magic "ALOEINNR" | u32 format (1) | u32 rank | u32 ranks |
// u32 spec digest | u64 steps | u32 layers | per layer: u64 n, n floats exp_avg, n floats
// exp_avg_sq | u32 CRC-32C of everything before it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"

namespace aloe::worker {

// A digest of the spec's tensors (names and shapes, in order): a state saved for another model
// is told apart from this one's.
uint32_t ModelSpecDigest(const v1::ModelSpec& spec);

// Who a state belongs to: the model and the rank of the node.
struct InnerStateOwner {
  uint32_t spec_digest = 0;
  uint32_t rank = 0;
  uint32_t ranks = 1;
};

std::string EncodeInnerState(const InnerStateOwner& owner, const InnerState& state);
// kDataLoss naming `source` and what is wrong for a truncated or damaged file;
// kFailedPrecondition naming `source` when it belongs to another model or rank layout.
absl::StatusOr<InnerState> DecodeInnerState(std::string_view bytes, const InnerStateOwner& owner,
                                            const std::string& source);

class InnerStateStore {
 public:
  InnerStateStore(std::string dir, const InnerStateOwner& owner);

  const std::string& path() const { return path_; }

  // Replaces the file (creating the directory). kUnavailable naming the file and the reason
  // (e.g. no space left); the previous file is then left whole.
  absl::Status Save(const InnerState& state) const;
  // kNotFound when there is no file; else DecodeInnerState's errors.
  absl::StatusOr<InnerState> Load() const;

 private:
  const std::string dir_;
  const InnerStateOwner owner_;
  const std::string path_;
};

}  // namespace aloe::worker
