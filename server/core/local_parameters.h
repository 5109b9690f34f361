// The parameters in this process: the whole model in a ParameterStore, stepped with fixed
// weights or the EDiT pseudo-gradient penalty (paper 000 Alg. 2, per layer), and the staging
// buffers pushes are received into. A single-process server's ParameterBackend.
//
// Not thread-safe: the core serialises calls.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/executor.h"
#include "common/metrics.h"
#include "server/core/parameter_backend.h"

namespace aloe::server {

class LocalParameters final : public ParameterBackend {
 public:
  // `initial`: every layer of `spec`, split into config.partial_sync.groups layer groups
  // (AssignLayerGroups). `config` must be validated. executor, clock and metrics
  // must outlive the backend. The store's and the penalty's errors.
  static absl::StatusOr<std::unique_ptr<LocalParameters>> Create(
      const v1::ServerConfig& config, v1::ModelSpec spec, std::vector<std::vector<float>> initial,
      Executor& executor, const Clock& clock, MetricsSink& metrics);

  uint64_t version() const override { return store_->version(); }
  ModelSnapshot Snapshot() const override { return store_->Snapshot(); }
  uint32_t num_layer_groups() const override { return store_->num_layer_groups(); }
  uint64_t group_version(uint32_t group) const override { return store_->group_version(group); }
  // Only part 0's push address is kept: workers are told it (JoinReply.push_address).
  void SetAddress(uint32_t part, std::string address, std::string push_address) override;
  absl::Status CheckJoin(v1::Role, size_t) const override { return absl::OkStatus(); }
  void DescribeTo(v1::JoinReply& reply) const override;
  // Without the penalty (which measures its own).
  bool wants_layer_squares() const override { return penalty_ == nullptr; }
  std::shared_ptr<FloatBufferPool> staging_buffers() const override { return staging_buffers_; }
  absl::Status CheckShapes(const PendingUpdate& update) const override {
    return store_->CheckShapes(update);
  }
  absl::Status ApplyOuterStep(ApplyBatch& batch) override;
  absl::StatusOr<bool> Admit(const v1::PushHeader& header) override;
  absl::StatusOr<uint32_t> StagePart(uint32_t part, const v1::PushHeader& header) override;
  uint32_t PartsOf(uint32_t) const override { return 0; }
  void Discard(uint64_t, uint64_t) override {}
  void DropUnsubmitted(uint64_t) override {}
  void ForgetWorker(uint64_t worker) override;
  const PseudoGradientPenalty* penalty() const override { return penalty_.get(); }
  void SaveTo(v1::ServerCheckpoint& checkpoint) const override;
  absl::Status RestoreFrom(const v1::ServerCheckpoint& checkpoint) override;
  bool keeps_every_checkpoint() const override { return false; }

 private:
  LocalParameters(const Clock& clock, MetricsSink& metrics) : clock_(clock), metrics_(metrics) {}

  const Clock& clock_;
  MetricsSink& metrics_;
  std::unique_ptr<ParameterStore> store_;
  // Applied updates give their layer buffers back here for the next pushes (UpdateAssembler);
  // at most max_staged_updates updates' worth idle.
  std::shared_ptr<FloatBufferPool> staging_buffers_;
  std::unique_ptr<PseudoGradientPenalty> penalty_;  // null unless config.penalty.enabled
  std::string push_address_;                        // raw pushes; "" = none
};

}  // namespace aloe::server
