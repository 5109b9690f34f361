#include "server/core/status_report.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/core/server_metrics.h"

namespace aloe::server {
namespace {

// A JSON string literal of `s` (quotes and control characters escaped).
std::string Quote(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", c);
        } else if (c == '<') {
          out += "\\u003c";  // never "</script>" inside a page
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// A JSON number; null for NaN and infinities, which JSON cannot hold.
std::string Number(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.10g", v);
}

std::string Seconds(absl::Duration d) { return Number(absl::ToDoubleSeconds(d)); }

std::string Pairs(const std::vector<std::pair<std::string, double>>& pairs) {
  std::string out = "[";
  for (size_t i = 0; i < pairs.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", "[", Quote(pairs[i].first), ",", Number(pairs[i].second),
                    "]");
  }
  return out + "]";
}

const char* RoleName(v1::Role role) {
  if (role == v1::ROLE_EVALUATOR) return "evaluator";
  return role == v1::ROLE_OBSERVER ? "observer" : "trainer";
}

std::string CodecName(v1::Codec codec) {
  return codec == v1::CODEC_UNSPECIFIED ? "fp32" : CodecLabel(codec);
}

// The checkpoint gauges (WriteCheckpoint); nullopt before the first checkpoint.
void ReadCheckpoint(const MetricsReader& metrics, StatusSnapshot& s) {
  const double at = metrics.Value(kCheckpointTimestamp);
  if (at <= 0) return;
  s.checkpoint_time = absl::UnixEpoch() + absl::Seconds(at);
  s.checkpoint_version = static_cast<uint64_t>(metrics.Value(kCheckpointVersion));
}

}  // namespace

std::vector<std::pair<std::string, std::string>> JobSummary(const v1::ServerConfig& config) {
  std::vector<std::pair<std::string, std::string>> job;
  const bool async = config.aggregation().mode() == v1::AGGREGATION_ASYNC;
  std::string aggregation = async ? "async" : "sync (DiLoCo rounds)";
  if (async && config.aggregation().grace_seconds() > 0) {
    absl::StrAppendFormat(&aggregation, ", grace window %g s",
                          config.aggregation().grace_seconds());
  }
  absl::StrAppendFormat(&aggregation, ", min workers %d", config.aggregation().min_workers());
  job.emplace_back("aggregation", aggregation);
  const v1::OuterOptimizerConfig& outer = config.outer_optimizer();
  std::string optimizer;
  switch (outer.type()) {
    case v1::OUTER_SGD:
      optimizer = absl::StrFormat("SGD, lr %g", outer.lr());
      break;
    case v1::OUTER_DELAYED_NESTEROV:
      optimizer = absl::StrFormat("Delayed Nesterov, lr %g, momentum %g, buffer N=%d", outer.lr(),
                                  outer.momentum(), outer.dn_buffer_size());
      break;
    case v1::OUTER_ADAM:
      optimizer = absl::StrFormat("Adam, lr %g", outer.lr());
      break;
    default:
      optimizer = absl::StrFormat("Nesterov, lr %g, momentum %g", outer.lr(), outer.momentum());
  }
  if (outer.max_staleness() > 0) {
    absl::StrAppendFormat(&optimizer, ", max staleness %d", outer.max_staleness());
  }
  job.emplace_back("outer optimizer", optimizer);
  std::string work;
  switch (config.local_work().mode()) {
    case v1::LOCAL_WORK_DYLU:
      work = absl::StrFormat("DyLU (H=%d for the fastest)", config.local_steps());
      break;
    case v1::LOCAL_WORK_TIME_BUDGET:
      work = absl::StrFormat("time budget %g s", config.local_work().time_budget_seconds());
      break;
    default:
      work = absl::StrFormat("fixed H=%d", config.local_steps());
  }
  job.emplace_back("local work", work);
  const v1::TransformerConfig& m = config.model();
  job.emplace_back(
      "model",
      config.model_file().empty()
          ? absl::StrFormat("transformer: %d layers, d_model %d, %d heads, vocab %d, "
                            "seq_len %d",
                            m.num_layers(), m.d_model(), m.num_heads(), m.vocab_size(), m.seq_len())
          : absl::StrCat("imported: ", config.model_file()));
  job.emplace_back("inner optimizer",
                   absl::StrFormat("AdamW, lr %g, batch %d", config.inner_optimizer().lr(),
                                   config.inner_optimizer().batch_size()));
  job.emplace_back("codec",
                   absl::StrCat(CodecName(config.transport().codec()),
                                config.transport().error_feedback() ? " with error feedback" : ""));
  job.emplace_back("data shards", config.shard_sampling() == v1::SHARD_SAMPLING_PROPORTIONAL
                                      ? "sampled by size"
                                      : "sampled by learning progress");
  if (config.partial_sync().groups() > 1) {
    job.emplace_back("partial sync",
                     absl::StrFormat("%d layer groups", config.partial_sync().groups()));
  }
  job.emplace_back("parameters held",
                   config.shard_processes() > 0
                       ? absl::StrFormat("%d shard processes", config.shard_processes())
                       : "in this process");
  if (config.penalty().enabled()) job.emplace_back("penalty", "EDiT pseudo-gradient penalty");
  job.emplace_back("checkpoints", config.checkpoint().dir().empty()
                                      ? "none"
                                      : absl::StrFormat("every %d versions in %s",
                                                        config.checkpoint().every_versions(),
                                                        config.checkpoint().dir()));
  job.emplace_back("stop", config.max_versions() > 0
                               ? absl::StrFormat("after %d versions", config.max_versions())
                           : config.max_seconds() > 0
                               ? absl::StrFormat("after %g s", config.max_seconds())
                               : "never (until stopped)");
  return job;
}

StatusSnapshot CaptureStatus(const ServerCore& core, const v1::ServerConfig& config,
                             std::string role, absl::Time now,
                             const std::function<std::string(uint64_t)>& identity_of,
                             const MetricsReader& metrics, size_t max_evals) {
  StatusSnapshot s;
  s.role = std::move(role);
  s.now = now;
  s.job = JobSummary(config);
  for (const auto& layer : core.spec().layers()) s.parameters += layer.num_elements();
  s.version = core.version();
  s.max_versions = config.max_versions();
  s.updates_applied = core.updates_applied();
  s.stopping = core.stopping();
  s.draining = core.draining();
  for (LiveWorker& w : core.LiveWorkers()) {
    std::string identity = identity_of ? identity_of(w.id) : "";
    s.workers.push_back({std::move(w), std::move(identity)});
  }
  if (const ShardCommitLog* log = core.shard_log(); log != nullptr) {
    v1::JoinReply addresses;
    log->DescribeTo(addresses);
    for (uint32_t i = 0; i < config.shard_processes(); ++i) {
      StatusSnapshot::ShardProcess p;
      p.index = i;
      if (static_cast<int>(i) < addresses.shard_addresses_size()) {
        p.address = addresses.shard_addresses(static_cast<int>(i));
      }
      p.version = log->version();
      p.applied_version =
          static_cast<uint64_t>(metrics.Value(kShardProcessAppliedVersion, {std::to_string(i)}));
      s.shard_processes.push_back(std::move(p));
    }
  }
  const DataShardSampler& sampler = core.sampler();
  const std::vector<double> p = sampler.Probabilities();
  for (size_t i = 0; i < sampler.size(); ++i) {
    s.data_shards.push_back({sampler.shard(i).name, sampler.shard(i).tokens,
                             sampler.tokens_learned(i), sampler.tokens_in_flight(i),
                             i < p.size() ? p[i] : 0.0});
  }
  for (const char* reason : kRejectReasons) {
    s.rejections.emplace_back(reason, metrics.Value(kUpdatesRejected, {reason}));
  }
  ReadCheckpoint(metrics, s);
  const std::vector<EvalPoint>& evals = core.eval_history();
  const size_t first = evals.size() > max_evals ? evals.size() - max_evals : 0;
  s.evals.assign(evals.begin() + static_cast<std::ptrdiff_t>(first), evals.end());
  return s;
}

StatusSnapshot CaptureShardProcessStatus(const v1::ServerConfig& config, uint32_t shard_index,
                                         absl::Time now, const MetricsReader& metrics) {
  StatusSnapshot s;
  s.role = absl::StrFormat("shard process %d of %d", shard_index, config.shard_processes());
  s.now = now;
  s.job = JobSummary(config);
  s.version = static_cast<uint64_t>(metrics.Value(kModelVersion));
  s.max_versions = config.max_versions();
  s.figures.emplace_back("staged updates", metrics.Value(kStagedUpdates));
  s.figures.emplace_back("staged bytes", metrics.Value(kStagedBytes));
  double received = 0;
  for (int codec = 0; codec < v1::Codec_ARRAYSIZE; ++codec) {
    if (!v1::Codec_IsValid(codec) || codec == v1::CODEC_UNSPECIFIED) continue;
    received += metrics.Value(kReceivedBytes, {CodecLabel(static_cast<v1::Codec>(codec))});
  }
  s.figures.emplace_back("received bytes", received);
  s.figures.emplace_back("raw push bytes", metrics.Value(kRawPushBytes));
  ReadCheckpoint(metrics, s);
  return s;
}

void StatusHistory::Record(absl::Time now, uint64_t version, absl::Span<const EvalPoint> evals) {
  if (versions_.empty() || versions_.back().version != version) {
    if (versions_.size() >= 2 && now - versions_.back().time < kMinGap) {
      versions_.back().version = version;
    } else {
      versions_.push_back({now, version});
    }
    while (versions_.size() > capacity_) versions_.pop_front();
  }
  // Evaluations come in version order; a history that went back (a coordinator restored to a
  // checkpoint) is taken as seen from its newest on.
  if (!evals.empty() && last_eval_ && evals.back().version < *last_eval_) {
    last_eval_ = evals.back().version;
  }
  for (const EvalPoint& e : evals) {
    if (last_eval_ && e.version <= *last_eval_) continue;
    losses_.push_back({now, e.version, e.loss});
    last_eval_ = e.version;
  }
  while (losses_.size() > capacity_) losses_.pop_front();
}

std::string StatusJson(const StatusSnapshot& s, const StatusHistory& history) {
  std::string out = "{";
  absl::StrAppend(&out, "\"role\":", Quote(s.role),
                  ",\"now\":", Number(absl::ToDoubleSeconds(s.now - absl::UnixEpoch())));
  out += ",\"job\":[";
  for (size_t i = 0; i < s.job.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", "[", Quote(s.job[i].first), ",", Quote(s.job[i].second),
                    "]");
  }
  absl::StrAppend(&out, "],\"parameters\":", s.parameters, ",\"version\":", s.version,
                  ",\"max_versions\":", s.max_versions, ",\"updates_applied\":", s.updates_applied,
                  ",\"stopping\":", s.stopping ? "true" : "false",
                  ",\"draining\":", s.draining ? "true" : "false");
  out += ",\"workers\":[";
  for (size_t i = 0; i < s.workers.size(); ++i) {
    const LiveWorker& w = s.workers[i].live;
    absl::StrAppend(&out, i ? "," : "", "{\"id\":", w.id, ",\"name\":", Quote(w.name),
                    ",\"identity\":", Quote(s.workers[i].identity),
                    ",\"role\":", Quote(RoleName(w.role)), ",\"state\":", Quote(w.state),
                    ",\"steps_per_second\":", Number(w.steps_per_second), ",\"tokens_per_second\":",
                    Number(w.steps_per_second * static_cast<double>(w.tokens_per_step)),
                    ",\"planned_steps\":", w.planned_steps,
                    ",\"last_push_age\":", w.last_push ? Seconds(s.now - *w.last_push) : "null",
                    ",\"staleness\":", w.last_staleness, ",\"pushes\":", w.pushes,
                    ",\"received_bytes\":", w.received_bytes,
                    ",\"joined_age\":", Seconds(s.now - w.joined), "}");
  }
  out += "],\"shard_processes\":[";
  for (size_t i = 0; i < s.shard_processes.size(); ++i) {
    const StatusSnapshot::ShardProcess& p = s.shard_processes[i];
    absl::StrAppend(&out, i ? "," : "", "{\"index\":", p.index, ",\"address\":", Quote(p.address),
                    ",\"version\":", p.version, ",\"applied_version\":", p.applied_version, "}");
  }
  // Shares: of the tokens learned so far, and of the corpus' tokens.
  uint64_t learned = 0;
  uint64_t tokens = 0;
  for (const StatusSnapshot::DataShard& d : s.data_shards) {
    learned += d.tokens_learned;
    tokens += d.tokens;
  }
  out += "],\"data_shards\":[";
  for (size_t i = 0; i < s.data_shards.size(); ++i) {
    const StatusSnapshot::DataShard& d = s.data_shards[i];
    absl::StrAppend(
        &out, i ? "," : "", "{\"name\":", Quote(d.name), ",\"tokens\":", d.tokens,
        ",\"tokens_learned\":", d.tokens_learned, ",\"tokens_in_flight\":", d.tokens_in_flight,
        ",\"learned_share\":",
        Number(learned > 0 ? static_cast<double>(d.tokens_learned) / learned : 0.0),
        ",\"size_share\":", Number(tokens > 0 ? static_cast<double>(d.tokens) / tokens : 0.0),
        ",\"probability\":", Number(d.probability), "}");
  }
  absl::StrAppend(&out, "],\"rejections\":", Pairs(s.rejections));
  out += ",\"checkpoint\":";
  if (s.checkpoint_time) {
    absl::StrAppend(&out, "{\"version\":", s.checkpoint_version.value_or(0),
                    ",\"age\":", Seconds(s.now - *s.checkpoint_time), "}");
  } else {
    out += "null";
  }
  out += ",\"evals\":[";
  for (size_t i = 0; i < s.evals.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", "[", s.evals[i].version, ",", Number(s.evals[i].loss), "]");
  }
  absl::StrAppend(&out, "],\"figures\":", Pairs(s.figures));
  out += ",\"history\":{\"versions\":[";
  bool first = true;
  for (const auto& v : history.versions()) {
    absl::StrAppend(&out, first ? "" : ",", "[", Seconds(v.time - s.now), ",", v.version, "]");
    first = false;
  }
  out += "],\"losses\":[";
  first = true;
  for (const auto& l : history.losses()) {
    absl::StrAppend(&out, first ? "" : ",", "[", Seconds(l.time - s.now), ",", l.version, ",",
                    Number(l.loss), "]");
    first = false;
  }
  return out + "]}}";
}

}  // namespace aloe::server
