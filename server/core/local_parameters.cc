#include "server/core/local_parameters.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/layer_groups.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "kernels/cpu/outer_kernels.h"
#include "server/core/server_metrics.h"

namespace aloe::server {

absl::StatusOr<std::unique_ptr<LocalParameters>> LocalParameters::Create(
    const v1::ServerConfig& config, v1::ModelSpec spec, std::vector<std::vector<float>> initial,
    Executor& executor, const Clock& clock, MetricsSink& metrics) {
  std::unique_ptr<LocalParameters> local(new LocalParameters(clock, metrics));
  size_t bytes = 0;
  for (const v1::LayerSpec& layer : spec.layers()) bytes += layer.num_elements() * sizeof(float);
  const int layers = spec.layers_size();
  ALOE_ASSIGN_OR_RETURN(
      std::vector<uint32_t> layer_groups,
      AssignLayerGroups(spec, std::max<uint32_t>(1, config.partial_sync().groups())));
  ALOE_ASSIGN_OR_RETURN(local->store_, ParameterStore::Create(std::move(spec), std::move(initial),
                                                              config.outer_optimizer(), executor,
                                                              std::move(layer_groups)));
  // Idle buffers for every receive slot (max_staged_updates pushes are received at once), as a
  // shard process keeps for its staging slots: with 2 updates' worth, 4 full-speed pushers kept
  // freeing buffers and zero-filling new ones (memset, 6% of the process's CPU). No more memory
  // at the peak than the slots themselves: Take reuses first.
  local->staging_buffers_ =
      FloatBufferPool::Create(std::max<size_t>(config.max_staged_updates(), 2) * bytes);
  if (config.penalty().enabled()) {
    ALOE_ASSIGN_OR_RETURN(local->penalty_, PseudoGradientPenalty::Create(config.penalty(), layers));
  }
  return local;
}

void LocalParameters::SetAddress(uint32_t part, std::string, std::string push_address) {
  if (part == 0) push_address_ = std::move(push_address);
}

void LocalParameters::DescribeTo(v1::JoinReply& reply) const {
  reply.set_push_address(push_address_);
}

absl::Status LocalParameters::ApplyOuterStep(ApplyBatch& batch) {
  const absl::Time start = clock_.Now();
  std::vector<const PendingUpdate*> updates;
  for (const PendingUpdate& u : batch.updates) updates.push_back(&u);
  if (penalty_ == nullptr) {
    // Per (update, layer) norms; with the penalty on, it reports them itself. Measured while
    // the update was received when it was (layer_squares), else read from the update.
    for (const PendingUpdate* u : updates) {
      const bool measured = u->layer_squares.size() == u->layers.size();
      for (size_t l = 0; l < u->layers.size(); ++l) {
        const std::vector<float>& layer = u->layers[l];
        if (u->by_group && layer.empty()) continue;  // another layer group's
        metrics_.Observe(kPseudoGradientNorm,
                         std::sqrt(measured ? u->layer_squares[l]
                                            : kernels::SquaredL2Norm(layer.data(), layer.size())));
      }
    }
  }
  const uint64_t copied = store_->copied_layer_steps();
  absl::Status status;
  if (penalty_ != nullptr) {
    // The penalty's per-layer weights replace the batch's (paper 000 Alg. 2).
    PenaltyAggregation aggregation(*penalty_);
    status = store_->ApplyOuterStep(updates, aggregation);
    if (status.ok()) ReportPenalty(aggregation.reports(), version(), "server", metrics_);
  } else {
    status = store_->ApplyOuterStep(updates, batch.weights);
  }
  if (store_->copied_layer_steps() > copied) {
    metrics_.Add(kLayerStepsCopied, static_cast<double>(store_->copied_layer_steps() - copied));
  }
  if (!status.ok()) {
    // Shapes were checked on submission: this is an invariant violation, not bad input.
    return absl::InternalError(absl::StrCat("outer step failed: ", status.message()));
  }
  metrics_.Observe(kApplyLatency, absl::ToDoubleSeconds(clock_.Now() - start));
  for (PendingUpdate& u : batch.updates) {
    for (std::vector<float>& layer : u.layers) staging_buffers_->Give(std::move(layer));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> LocalParameters::Admit(const v1::PushHeader&) {
  return absl::FailedPreconditionError("not a layer-sharded coordinator");
}

absl::StatusOr<uint32_t> LocalParameters::StagePart(uint32_t part, const v1::PushHeader&) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "shard %d reported a staged update, but this coordinator has 0 shard processes", part));
}

void LocalParameters::ForgetWorker(uint64_t worker) {
  // Worker ids are never reused: its norm statistics can go. (An update of this worker still
  // waiting in an open round would start a fresh entry when applied.)
  if (penalty_ != nullptr) penalty_->ForgetStream(worker);
}

void LocalParameters::SaveTo(v1::ServerCheckpoint& c) const {
  const ModelSnapshot snapshot = Snapshot();
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    AppendFloats(*snapshot.layers[l], c.add_layer_params());
    store_->SaveOptimizerState(l, c.add_optimizer_state());
  }
  if (penalty_ != nullptr) penalty_->SaveState(c.mutable_penalty_state());
  if (store_->num_layer_groups() > 1) {
    for (uint64_t v : snapshot.group_versions) c.add_group_versions(v);
  }
}

absl::Status LocalParameters::RestoreFrom(const v1::ServerCheckpoint& c) {
  std::vector<std::vector<float>> params(c.layer_params_size());
  for (int l = 0; l < c.layer_params_size(); ++l) {
    params[l].resize(c.layer_params(l).size() / sizeof(float));
    absl::Status s = DecodeFloats(c.layer_params(l), absl::MakeSpan(params[l]));
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("checkpoint parameters of layer %d: %s", l, s.message()));
    }
  }
  std::vector<std::string> states(c.optimizer_state().begin(), c.optimizer_state().end());
  std::string old_penalty;
  if (penalty_ != nullptr) {
    penalty_->SaveState(&old_penalty);
    ALOE_RETURN_IF_ERROR(penalty_->LoadState(c.penalty_state()));
  }
  const std::vector<uint64_t> group_versions(c.group_versions().begin(), c.group_versions().end());
  absl::Status restored = store_->Restore(c.version(), params, states, group_versions);
  if (!restored.ok() && penalty_ != nullptr) (void)penalty_->LoadState(old_penalty);
  return restored;
}

}  // namespace aloe::server
