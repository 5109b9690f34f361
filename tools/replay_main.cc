// aloe-replay: replays a layer-sharded run in one process (server/core/commit_replay.h) from the
// coordinator's --order_journal and the shard processes' --record_commits files, and compares
// the result with the shard processes' newest checkpoints. Exit 0 when every parameter and
// version is equal, 1 when not, 2 for unusable input. scripts/soak runs it after every sharded
// run.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/config.h"
#include "common/flags_usage.h"
#include "common/imported_model.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "server/core/checkpoint_store.h"
#include "server/core/commit_replay.h"
#include "server/core/order_journal.h"

ABSL_FLAG(std::string, config, "", "The run's server config (model, outer optimizer, seed)");
ABSL_FLAG(std::string, journal, "", "The coordinator's --order_journal file");
ABSL_FLAG(std::string, records, "", "The shard processes' --record_commits files, comma-separated");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Where the shard processes' checkpoints are (shard-<i> below it; default: the config's "
          "checkpoint.dir)");

namespace aloe::server {
namespace {

absl::StatusOr<ReplayReport> Run() {
  const std::string path = absl::GetFlag(FLAGS_config);
  if (path.empty()) return absl::InvalidArgumentError("--config is required (see --help)");
  ALOE_ASSIGN_OR_RETURN(v1::ServerConfig config, LoadServerConfig(path));
  if (config.shard_processes() == 0) {
    return absl::InvalidArgumentError("the config has no shard processes to compare with");
  }
  if (config.penalty().enabled()) {
    return absl::InvalidArgumentError("the EDiT penalty's weights are not in the journal");
  }
  ALOE_ASSIGN_OR_RETURN(ServerModel model, LoadServerModel(config));
  ReplayInputs in;
  in.spec = model.spec;
  in.initial = std::move(model.initial);
  in.optimizer = config.outer_optimizer();
  absl::StatusOr<std::vector<v1::ShardOrder>> journal =
      ReadOrderJournal(absl::GetFlag(FLAGS_journal));
  ALOE_RETURN_IF_ERROR(journal.status());
  in.journal = *std::move(journal);
  for (absl::string_view file :
       absl::StrSplit(absl::GetFlag(FLAGS_records), ',', absl::SkipEmpty())) {
    bool cut = false;
    ALOE_ASSIGN_OR_RETURN(std::vector<RecordedUpdate> records,
                          ReadCommitRecords(std::string(file), &cut));
    if (cut) std::printf("%s: a cut last record (a killed process) was dropped\n", file.data());
    for (RecordedUpdate& r : records) in.records.push_back(std::move(r));
  }
  std::string dir = absl::GetFlag(FLAGS_checkpoint_dir);
  if (dir.empty()) dir = config.checkpoint().dir();
  for (uint32_t shard = 0; shard < config.shard_processes(); ++shard) {
    ALOE_ASSIGN_OR_RETURN(auto last,
                          CheckpointStore(absl::StrFormat("%s/shard-%d", dir, shard), 1 << 20)
                              .LoadLatest<v1::ShardCheckpoint>());
    in.final_versions.push_back(last.checkpoint.version());
    for (int i = 0; i < last.checkpoint.layer_ids_size(); ++i) {
      const std::string& bytes = last.checkpoint.layer_params(i);
      std::vector<float>& values = in.final_params[last.checkpoint.layer_ids(i)];
      values.resize(bytes.size() / sizeof(float));
      ALOE_RETURN_IF_ERROR(DecodeFloats(bytes, absl::MakeSpan(values)));
    }
  }
  return ReplayCommits(in);
}

}  // namespace
}  // namespace aloe::server

int main(int argc, char** argv) {
  aloe::SetUsage(
      "aloe-replay --config FILE --journal FILE --records A,B [--checkpoint_dir DIR]\n"
      "Replays a layer-sharded run in one process: the initial model, then the coordinator's\n"
      "committed updates in the committed order (values from the shard processes'\n"
      "--record_commits files), and compares the result with the shard processes' newest\n"
      "checkpoints. Exit 0: equal bit for bit; 1: they differ; 2: unusable input.");
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<aloe::server::ReplayReport> report = aloe::server::Run();
  if (!report.ok()) {
    std::fprintf(stderr, "aloe-replay: %s\n", report.status().ToString().c_str());
    std::printf("replay refused: %s\n", std::string(report.status().message()).c_str());
    return 2;
  }
  std::printf("%s\n", report->Summary().c_str());
  return report->different == 0 && report->versions_match ? 0 : 1;
}
