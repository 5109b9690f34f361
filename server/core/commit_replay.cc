#include "server/core/commit_replay.h"

#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/executor.h"
#include "common/status_macros.h"
#include "server/core/order_journal.h"
#include "server/core/parameter_store.h"

namespace aloe::server {

std::string ReplayReport::Summary() const {
  return absl::StrFormat(
      "%d commits of %d updates from version %d to %d; %d of %d parameters differ from the "
      "shard processes' (max |shard - replay| = %g, max |replay - initial| = %g); final "
      "versions %s",
      commits, updates, first_version, version, different, parameters, max_diff, max_moved,
      versions_match ? "match" : "DIFFER");
}

absl::StatusOr<ReplayReport> ReplayCommits(const ReplayInputs& in) {
  ALOE_ASSIGN_OR_RETURN(std::vector<v1::ShardOrder> history, CommittedHistory(in.journal));
  ReplayReport report;
  for (const v1::ShardOrder& o : in.journal) {
    if (o.kind() == v1::ShardOrder::RESTORE) {
      report.first_version = o.version();
      break;
    }
  }
  if (report.first_version != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the journal starts at version %d, not at the initial model", report.first_version));
  }
  // The records by (worker, update), merged over the shard processes.
  std::map<std::pair<uint64_t, uint64_t>, std::map<uint32_t, const std::vector<float>*>> updates;
  for (const RecordedUpdate& r : in.records) {
    auto& layers = updates[{r.worker_id, r.update_id}];
    for (const auto& [id, values] : r.layers) {
      auto [it, inserted] = layers.emplace(id, &values);
      if (!inserted && *it->second != values) {
        return absl::FailedPreconditionError(
            absl::StrFormat("update %d of worker %d: two records of layer %d disagree", r.update_id,
                            r.worker_id, id));
      }
    }
  }
  InlineExecutor executor;
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<ParameterStore> store,
                        ParameterStore::Create(in.spec, in.initial, in.optimizer, executor));
  const int num_layers = in.spec.layers_size();
  for (const v1::ShardOrder& commit : history) {
    std::vector<PendingUpdate> step(commit.entries_size());
    std::vector<const PendingUpdate*> pointers;
    std::vector<float> weights;
    for (int i = 0; i < commit.entries_size(); ++i) {
      const v1::CommitEntry& e = commit.entries(i);
      auto it = updates.find({e.worker_id(), e.update_id()});
      step[i].worker_id = e.worker_id();
      step[i].update_id = e.update_id();
      step[i].layers.resize(num_layers);
      for (int l = 0; l < num_layers; ++l) {
        const std::vector<float>* layer = nullptr;
        if (it != updates.end()) {
          auto found = it->second.find(static_cast<uint32_t>(l));
          if (found != it->second.end()) layer = found->second;
        }
        if (layer == nullptr) {
          return absl::FailedPreconditionError(absl::StrFormat(
              "version %d commits update %d of worker %d, whose layer %d was not recorded",
              commit.version(), e.update_id(), e.worker_id(), l));
        }
        step[i].layers[l] = *layer;
      }
      pointers.push_back(&step[i]);
      weights.push_back(e.weight());
    }
    ALOE_RETURN_IF_ERROR(store->ApplyOuterStep(pointers, weights));
    ++report.commits;
    report.updates += commit.entries_size();
  }
  report.version = store->version();
  const ModelSnapshot replayed = store->Snapshot();
  for (int l = 0; l < num_layers; ++l) {
    const std::vector<float>& want = *replayed.layers[l];
    auto got = in.final_params.find(static_cast<uint32_t>(l));
    if (got == in.final_params.end() || got->second.size() != want.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("the final parameters have no layer %d of %d values", l, want.size()));
    }
    for (size_t i = 0; i < want.size(); ++i) {
      const double diff = std::fabs(static_cast<double>(got->second[i]) - want[i]);
      report.different += got->second[i] != want[i];
      report.max_diff = std::max(report.max_diff, diff);
      report.max_moved =
          std::max(report.max_moved, std::fabs(static_cast<double>(want[i]) - in.initial[l][i]));
    }
    report.parameters += want.size();
  }
  report.versions_match = !in.final_versions.empty();
  for (uint64_t v : in.final_versions) report.versions_match &= v == report.version;
  return report;
}

}  // namespace aloe::server
