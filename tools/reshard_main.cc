// aloe-reshard: converts a stopped job's newest checkpoint to another process layout (one
// process, or a coordinator and N shard processes), for the server to resume from.
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/config.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/app/process_support.h"
#include "tools/reshard.h"

ABSL_FLAG(std::string, config, "",
          "The server config to convert for: its model, outer optimizer, penalty, corpus and "
          "shard_processes (text-format .textproto/.pbtxt or .json)");
ABSL_FLAG(std::string, from, "",
          "The checkpoint directory of the stopped job: of one process, or of a coordinator with "
          "the shard-<i> directories of its shard processes copied beside it");
ABSL_FLAG(std::string, to, "",
          "Where the converted checkpoint goes, a new or empty directory (default: the config's "
          "checkpoint.dir); start the server with it as checkpoint.dir and --resume");
ABSL_FLAG(int32_t, shard_processes, -1,
          "Override shard_processes, the layout to convert to (0: one process; N > 0: a "
          "coordinator and N shard processes)");
ABSL_FLAG(std::string, corpus_dir, "", "Override corpus_dir");

namespace aloe::server {
namespace {

absl::Status Run() {
  const std::string path = absl::GetFlag(FLAGS_config);
  if (path.empty()) return absl::InvalidArgumentError("--config is required (see --help)");
  const std::string from = absl::GetFlag(FLAGS_from);
  if (from.empty()) return absl::InvalidArgumentError("--from is required (see --help)");
  ALOE_ASSIGN_OR_RETURN(v1::ServerConfig config, LoadServerConfig(path));
  if (!absl::GetFlag(FLAGS_to).empty()) {
    config.mutable_checkpoint()->set_dir(absl::GetFlag(FLAGS_to));
  }
  if (!absl::GetFlag(FLAGS_corpus_dir).empty()) {
    config.set_corpus_dir(absl::GetFlag(FLAGS_corpus_dir));
  }
  if (const int32_t n = absl::GetFlag(FLAGS_shard_processes); n != -1) {
    if (n < 0) return absl::InvalidArgumentError("--shard_processes must be >= 0");
    config.set_shard_processes(static_cast<uint32_t>(n));
  }
  ALOE_RETURN_IF_ERROR(ValidateServerConfig(config));
  ALOE_ASSIGN_OR_RETURN(Corpus corpus, LoadCorpus(config));
  return Reshard(config, from, corpus.train, corpus.heldout_file);
}

}  // namespace
}  // namespace aloe::server

int main(int argc, char** argv) {
  aloe::SetUsage(
      "aloe-reshard --config FILE --from DIR [--to DIR] [--shard_processes N]\n"
      "Converts the newest checkpoint in DIR to the process layout of the config (and\n"
      "--shard_processes) and writes it to a new or empty directory, from where aloe-server\n"
      "resumes (--resume). Writes nothing on error.");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status status = aloe::server::Run(); !status.ok()) {
    ALOE_LOG_ERROR("reshard", "%s", status.ToString());
    return 1;
  }
  return 0;
}
