// aloe-sim: the deterministic straggler simulator (sim/simulator.h). Runs the real server
// core against k simulated workers in virtual time, with either the real LibTorch trainer
// (worker::LocalTrainer: real gradients, one trainer with its own AdamW state per simulated
// worker) or the cheap synthetic objective (sim/synthetic_trainer.h).
//
// This file is the one place where server code and worker code meet (docs/architecture.md):
// worker::LocalTrainer, a TrainerInterface, is wired into the simulator here and nowhere else.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/corpus_manifest.h"
#include "common/flags_usage.h"
#include "common/imported_model.h"
#include "common/logging.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "common/token_shard.h"
#include "common/trainer_interface.h"
#include "server/core/shard_sampler.h"
#include "sim/simulator.h"
#include "sim/synthetic_trainer.h"
#include "worker/trainer.h"

ABSL_FLAG(std::string, config, "",
          "ServerConfig file (.textproto/.pbtxt/.json). Its aggregation, outer optimizer, "
          "penalty, local work (H, DyLU, A-EDiT budget), shard sampling, inner optimizer, model, "
          "lease and stop settings are what is simulated; addresses are ignored");
ABSL_FLAG(std::string, speeds, "1,0.77,0.38,0.17",
          "Constant speed profiles: steps per second of each simulated worker, comma-separated "
          "(one worker per item). Ignored when --trace is given");
ABSL_FLAG(std::string, trace, "",
          "Step-time trace file: lines 'worker_index,seconds_per_step'; each worker's lines in "
          "file order form a cycle replayed forever ('#' comments and blank lines skipped; "
          "workers numbered 0..k-1)");
ABSL_FLAG(std::string, events, "",
          "Membership events 'join@T:i,leave@T:i,crash@T:i' (T virtual seconds, i worker "
          "index). A worker whose first event is a join starts absent; leave = graceful Leave, "
          "in-flight work lost; crash = silent stop, dropped when its lease expires");
ABSL_FLAG(std::string, trainer, "torch",
          "torch (worker::LocalTrainer over the corpus' token shards) | synthetic (noisy SGD on "
          "per-shard quadratics, no LibTorch work)");
ABSL_FLAG(std::string, corpus_dir, "",
          "Prepared corpus directory (manifest.tsv); default: the config's corpus_dir. The "
          "synthetic trainer uses its shard names and sizes when it exists, else "
          "--synthetic_shards equal shards");
ABSL_FLAG(int32_t, eval_every, -1,
          "Evaluate the global model every this many versions (plus version 0 and the final "
          "one); 0 = only those two; -1 = the config's eval_every");
ABSL_FLAG(int32_t, eval_sequences, 64, "Held-out sequences per evaluation (torch trainer)");
ABSL_FLAG(int64_t, max_versions, 0,
          "Stop once the global version reaches this; 0 = only the config's max_versions");
ABSL_FLAG(int64_t, max_local_steps, 0,
          "Stop once the pushed updates total this many local steps; 0 = no limit");
ABSL_FLAG(double, max_virtual_seconds, 0, "Stop at this virtual time; 0 = no limit");
ABSL_FLAG(std::string, out, "aloe-sim.csv", "CSV output path (one row per push; see --help)");
ABSL_FLAG(int64_t, seed, 0,
          "Overrides the config's seed (model init, task seeds, synthetic targets); 0 = keep");
ABSL_FLAG(double, tick, 0.05,
          "Virtual seconds between Tick / WAIT retries while some worker waits");
ABSL_FLAG(int32_t, torch_threads, 1, "LibTorch intra-op threads for the simulated trainers");
ABSL_FLAG(std::string, torchscript, "",
          "Torch trainer with a config whose model_file is an imported model: the TorchScript "
          "file it was imported from (aloe-import-model), trained by every simulated worker as "
          "aloe-worker --torchscript does");
ABSL_FLAG(std::string, links, "",
          "Network links of the simulated workers: RATE_MBIT:LATENCY_MS or "
          "UP_MBIT/DOWN_MBIT:LATENCY_MS, one item for every worker or one per worker "
          "(comma-separated; 'inf' = infinitely fast; latency one way). Empty = every transfer "
          "instant");
ABSL_FLAG(std::string, server_link, "",
          "The server's own link, shared by every worker, in --links' item format (the up rate "
          "carries the pushes into the server, the down rate the pulls): transfers queue there "
          "behind the other workers' (FIFO). Empty = unlimited");
ABSL_FLAG(std::string, overlap, "off",
          "off | delayed | eager: overlapped communication as aloe-worker --overlap (the push "
          "of a round and the pull of the next round's base go while the next round trains)");
ABSL_FLAG(double, peak_window, 1,
          "Window of the peak bytes/s per worker and direction, virtual seconds");
ABSL_FLAG(std::string, target_loss, "",
          "A held-out loss: report the virtual seconds at which an evaluation first reached it "
          "(empty = none)");
ABSL_FLAG(std::string, workers_out, "",
          "Per-worker CSV path (compute seconds and utilization, bytes and peak bytes/s up and "
          "down); empty = not written");
ABSL_FLAG(double, synthetic_lr, 0.05, "Synthetic trainer: per-coordinate SGD step in (0, 1]");
ABSL_FLAG(double, synthetic_noise, 0.1, "Synthetic trainer: gradient noise std per coordinate");
ABSL_FLAG(double, synthetic_spread, 0.5, "Synthetic trainer: std of each shard's target offset");
ABSL_FLAG(int32_t, synthetic_shards, 8,
          "Synthetic trainer without a corpus: number of equal fabricated shards");

namespace aloe::sim {
namespace {

absl::Status Main() {
  const absl::Time wall_start = absl::Now();  // reported only; the simulation never reads it
  const std::string config_path = absl::GetFlag(FLAGS_config);
  if (config_path.empty()) return absl::InvalidArgumentError("--config is required (see --help)");
  ALOE_ASSIGN_OR_RETURN(v1::ServerConfig config, LoadServerConfig(config_path));
  if (absl::GetFlag(FLAGS_seed) != 0) config.set_seed(absl::GetFlag(FLAGS_seed));
  if (!absl::GetFlag(FLAGS_corpus_dir).empty()) {
    config.set_corpus_dir(absl::GetFlag(FLAGS_corpus_dir));
  }
  ALOE_RETURN_IF_ERROR(ValidateServerConfig(config));

  SimulatorOptions options;
  if (!absl::GetFlag(FLAGS_trace).empty()) {
    ALOE_ASSIGN_OR_RETURN(options.workers, LoadTrace(absl::GetFlag(FLAGS_trace)));
  } else {
    ALOE_ASSIGN_OR_RETURN(options.workers, ParseSpeeds(absl::GetFlag(FLAGS_speeds)));
  }
  ALOE_ASSIGN_OR_RETURN(options.events, ParseEvents(absl::GetFlag(FLAGS_events)));
  const int eval_every = absl::GetFlag(FLAGS_eval_every);
  options.eval_every = eval_every < 0 ? config.eval_every() : static_cast<uint32_t>(eval_every);
  if (absl::GetFlag(FLAGS_max_versions) < 0 || absl::GetFlag(FLAGS_max_local_steps) < 0) {
    return absl::InvalidArgumentError("--max_versions and --max_local_steps must be >= 0");
  }
  options.max_versions = static_cast<uint64_t>(absl::GetFlag(FLAGS_max_versions));
  options.max_local_steps = static_cast<uint64_t>(absl::GetFlag(FLAGS_max_local_steps));
  options.max_virtual_seconds = absl::GetFlag(FLAGS_max_virtual_seconds);
  options.tick_seconds = absl::GetFlag(FLAGS_tick);
  ALOE_ASSIGN_OR_RETURN(options.links, ParseLinks(absl::GetFlag(FLAGS_links)));
  ALOE_ASSIGN_OR_RETURN(const std::vector<LinkSpec> server_link,
                        ParseLinks(absl::GetFlag(FLAGS_server_link)));
  if (server_link.size() > 1) {
    return absl::InvalidArgumentError("--server_link takes one link, not a list");
  }
  if (!server_link.empty()) options.server_link = server_link.front();
  ALOE_ASSIGN_OR_RETURN(options.overlap, ParseOverlap(absl::GetFlag(FLAGS_overlap)));
  options.peak_window_seconds = absl::GetFlag(FLAGS_peak_window);
  if (const std::string target = absl::GetFlag(FLAGS_target_loss); !target.empty()) {
    double loss = 0;
    if (!absl::SimpleAtod(target, &loss) || !std::isfinite(loss)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--target_loss must be a finite number, got '", target, "'"));
    }
    options.target_loss = loss;
  }
  const size_t k = options.workers.size();

  // The corpus: training shards for the core, held-out split for evaluation.
  std::vector<server::DataShard> train;
  std::string heldout_file;
  absl::StatusOr<std::vector<CorpusShardInfo>> corpus = LoadCorpusManifest(config.corpus_dir());
  if (corpus.ok()) {
    for (const CorpusShardInfo& s : *corpus) {
      if (s.heldout) {
        if (heldout_file.empty()) heldout_file = s.file;
      } else {
        train.push_back(server::DataShard{s.name, s.file, s.tokens});
      }
    }
  }

  // The model the core trains: the built-in transformer, or config.model_file's imported one.
  ALOE_ASSIGN_OR_RETURN(const ServerModel model, LoadServerModel(config, kNoLayers));
  const v1::ModelSpec& spec = model.spec;
  options.model_fingerprint = model.fingerprint;
  const std::string torchscript = absl::GetFlag(FLAGS_torchscript);
  if (!torchscript.empty() && config.model_file().empty()) {
    return absl::InvalidArgumentError(
        "--torchscript is for a config with model_file (an imported model); this config trains "
        "the built-in transformer");
  }
  std::vector<std::unique_ptr<TrainerInterface>> trainers;
  std::unique_ptr<TrainerInterface> eval_trainer;
  // Objects the trainers borrow; declared before the simulator so they outlive it.
  std::unique_ptr<SyntheticObjective> objective;
  std::unique_ptr<TokenShardCache> cache;

  const std::string kind = absl::GetFlag(FLAGS_trainer);
  if (kind == "synthetic") {
    if (!corpus.ok()) {
      const int n = absl::GetFlag(FLAGS_synthetic_shards);
      if (n < 1) return absl::InvalidArgumentError("--synthetic_shards must be >= 1");
      ALOE_LOG_INFO("sim", "no corpus at '%s' (%s): using %d equal synthetic shards",
                    config.corpus_dir(), corpus.status().message(), n);
      for (int i = 0; i < n; ++i) {
        train.push_back(server::DataShard{absl::StrCat("synthetic_", i),
                                          absl::StrCat("synthetic_", i, ".tok"), 100000});
      }
    }
    SyntheticObjectiveOptions o;
    o.seed = config.seed();
    o.lr = absl::GetFlag(FLAGS_synthetic_lr);
    o.noise_std = absl::GetFlag(FLAGS_synthetic_noise);
    o.shard_spread = absl::GetFlag(FLAGS_synthetic_spread);
    o.tokens_per_step =
        static_cast<uint64_t>(config.inner_optimizer().batch_size()) * model.seq_len;
    ALOE_ASSIGN_OR_RETURN(objective, SyntheticObjective::Create(spec, train, o));
    for (size_t i = 0; i < k; ++i)
      trainers.push_back(std::make_unique<SyntheticTrainer>(*objective));
    eval_trainer = std::make_unique<SyntheticTrainer>(*objective);
  } else if (kind == "torch") {
    if (!corpus.ok()) return corpus.status();
    if (heldout_file.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(CorpusManifestPath(config.corpus_dir()), " has no heldout shard"));
    }
    if (absl::GetFlag(FLAGS_eval_sequences) < 1) {
      return absl::InvalidArgumentError("--eval_sequences must be >= 1");
    }
    worker::ConfigureAllocatorForTraining();
    worker::SetTrainerThreads(absl::GetFlag(FLAGS_torch_threads));
    cache = std::make_unique<TokenShardCache>(config.corpus_dir());
    ALOE_RETURN_IF_ERROR(cache->Get(heldout_file).status());
    options.open_shard = [&cache](const std::string& file) -> absl::StatusOr<const TokenSource*> {
      return cache->Get(file);
    };
    options.eval_sequences = static_cast<uint32_t>(absl::GetFlag(FLAGS_eval_sequences));
    if (!config.model_file().empty() && torchscript.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model_file ", config.model_file(),
          ": the torch trainer needs --torchscript, the TorchScript file it was imported from "
          "(or use --trainer synthetic)"));
    }
    for (size_t i = 0; i <= k; ++i) {
      std::unique_ptr<worker::LocalTrainer> t;
      if (torchscript.empty()) {
        ALOE_ASSIGN_OR_RETURN(
            t, worker::LocalTrainer::Create(config.model(), config.inner_optimizer(), spec,
                                            config.seed()));
      } else {
        // Each simulated worker loads its own copy, as each aloe-worker process does.
        std::string fingerprint;
        ALOE_ASSIGN_OR_RETURN(worker::ScriptModelPtr script,
                              worker::OpenScriptModel(torchscript, &fingerprint));
        if (fingerprint != model.fingerprint) {
          return absl::FailedPreconditionError(
              absl::StrCat("--torchscript ", torchscript, " is not the module model_file ",
                           config.model_file(), " was imported from (architecture fingerprints ",
                           fingerprint, " vs ", model.fingerprint, ")"));
        }
        ALOE_ASSIGN_OR_RETURN(t, worker::LocalTrainer::CreateForScript(
                                     std::move(script), model.vocab_size, model.seq_len,
                                     config.inner_optimizer(), spec));
      }
      if (i < k) {
        trainers.push_back(std::move(t));
      } else {
        eval_trainer = std::move(t);
      }
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--trainer must be torch or synthetic, got '", kind, "'"));
  }

  ALOE_ASSIGN_OR_RETURN(
      std::unique_ptr<Simulator> simulator,
      Simulator::Create(config, std::move(train), heldout_file, std::move(options),
                        std::move(trainers), std::move(eval_trainer)));
  ALOE_ASSIGN_OR_RETURN(SimResult result, simulator->Run());

  const std::string out_path = absl::GetFlag(FLAGS_out);
  {
    std::ofstream out(out_path, std::ios::binary | std::ios::trunc);
    out << FormatCsv(result);
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", out_path));
  }
  if (const std::string path = absl::GetFlag(FLAGS_workers_out); !path.empty()) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << FormatWorkersCsv(result);
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  for (const std::string& r : result.rejections) ALOE_LOG_INFO("sim", "rejected push: %s", r);
  std::printf("%s\n", FormatSummary(result).c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "aloe-sim: wall_seconds=%.2f csv=%s\n",
               absl::ToDoubleSeconds(absl::Now() - wall_start), out_path.c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace aloe::sim

int main(int argc, char** argv) {
  aloe::SetUsage(
      "aloe-sim --config FILE [--speeds 1,0.77,0.38,0.17 | --trace FILE] [--events ...]\n"
      "         [--trainer torch|synthetic] [--out sim.csv] [flags]\n"
      "Deterministic straggler simulator: runs the real aloe-server core (aggregation, outer\n"
      "optimizer, penalty, DyLU / A-EDiT local work, shard sampler, leases) with a virtual clock\n"
      "against k simulated workers. Local work is real (true pseudo-gradients from the chosen\n"
      "trainer, computed at once); only its duration is virtual: the sum of the worker's step\n"
      "times. Same inputs and seed -> bit-identical CSV.\n"
      "\n"
      "Speed profiles:\n"
      "  --speeds S0,S1,...   worker i runs at Si steps per second (constant step time 1/Si).\n"
      "  --trace FILE         lines 'worker_index,seconds_per_step'; worker i's lines, in file\n"
      "                       order, form a cycle of step times replayed across its tasks.\n"
      "  A task of H steps takes the sum of the next H step times; with an A-EDiT budget\n"
      "  (local_work { mode: LOCAL_WORK_TIME_BUDGET }) the worker runs until the first step\n"
      "  end at or after the budget, capped at the task's local_steps.\n"
      "Models: the config's built-in transformer, or its model_file (an imported model) with\n"
      "  --torchscript FILE, the TorchScript file it was imported from.\n"
      "Membership: --events 'join@T:i,leave@T:i,crash@T:i'. Workers join at t = 0 unless their\n"
      "  first event is a join. Work in flight at a leave or crash is lost.\n"
      "Network: --links RATE_MBIT:LATENCY_MS[,...] (or UP/DOWN:LATENCY_MS; one item = every\n"
      "  worker): each worker's uplink and downlink are FIFOs; a transfer of B bytes takes\n"
      "  latency + B / rate from when the one before it on that direction arrived. A round's\n"
      "  compute starts when its base (the model as float32) has arrived; its push (encoded\n"
      "  with the config's transport codecs) reaches the server when its upload arrives.\n"
      "  --overlap delayed|eager pushes and pulls in the background of the next round, as\n"
      "  aloe-worker --overlap does. --server_link RATE_MBIT:LATENCY_MS adds the server's own\n"
      "  link: every transfer also queues there (FIFO across workers) and arrives when both\n"
      "  links have delivered it. Without --links or --server_link transfers are instant.\n"
      "Pushes: every worker encodes its pseudo-gradient with the config's transport as\n"
      "  aloe-worker does (per-layer codecs, error feedback, low-rank factors with warm starts)\n"
      "  and the core applies what the server decodes from those bytes, so lossy codecs change\n"
      "  the training as they would in a real run. With transport.adaptive_rank (adaptive rank,\n"
      "  paper 001 Alg. 3) each push is compressed at the ranks its task names and reports the\n"
      "  effective ranks it observed, and the server core picks ranks and local steps from them.\n"
      "\n"
      "Output: --out CSV, one row per push plus evaluation rows, columns\n"
      "  virtual_time  virtual seconds since the start (6 decimals)\n"
      "  version       global model version after the event\n"
      "  worker        simulated worker index (empty on eval rows)\n"
      "  staleness     version before this update's outer step - its base version\n"
      "  shard         data shard of the task\n"
      "  steps         local steps done\n"
      "  eval_loss     held-out loss of `version`, empty unless that version was evaluated\n"
      "                (version 0, every --eval_every versions, the final version)\n"
      "  outcome       applied (this push completed an outer step) | accepted (waits in an\n"
      "                open round/window) | rejected (nothing applied) | eval (an evaluation of\n"
      "                a version no push row produced: version 0, or one completed by a leave)\n"
      "and one summary line on stdout: stop reason, final eval loss, virtual seconds, versions,\n"
      "total local steps, accepted updates per worker, rejected pushes, pushed bytes (payload\n"
      "of every push that reached the server), per worker compute\n"
      "utilization (compute / present virtual time), bytes up and down, peak bytes/s up and\n"
      "down (most bytes received in any --peak_window, divided by it), and with --target_loss\n"
      "the virtual seconds to reach it. --workers_out writes the per-worker numbers as CSV.\n"
      "Wall time goes to stderr.");
  absl::ParseCommandLine(argc, argv);
  absl::Status status = aloe::sim::Main();
  if (!status.ok()) {
    ALOE_LOG_ERROR("sim", "%s", status.ToString());
    return 1;
  }
  return 0;
}
