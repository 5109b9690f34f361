#include "common/config.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/low_rank_wire.h"
#include "common/lr_schedule.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"

namespace aloe {
namespace {

class CollectingErrors final : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (first_.empty())
      first_ = absl::StrFormat("line %d column %d: %s", line + 1, column + 1, message);
  }
  void AddWarning(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

bool IsJsonPath(const std::string& path) { return absl::EndsWith(path, ".json"); }

absl::Status CheckAddress(const std::string& field, const std::string& address) {
  size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s must be host:port with port in [0, 65535], got \"%s\"", field, address));
  }
  return absl::OkStatus();
}

absl::Status Positive(const char* field, double v) {
  if (!(v > 0)) {
    return absl::InvalidArgumentError(absl::StrFormat("%s must be > 0, got %g", field, v));
  }
  if (!std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be > 0 and finite, got %g", field, v));
  }
  return absl::OkStatus();
}

// [0, 1): momentum and Adam's betas.
absl::Status InUnitInterval(const char* field, float v) {
  if (!(v >= 0 && v < 1)) {
    return absl::InvalidArgumentError(absl::StrFormat("%s must be in [0, 1), got %g", field, v));
  }
  return absl::OkStatus();
}

constexpr uint32_t kMaxDnBufferSize = 1000000;

absl::Status CheckOuterMomentum(const v1::OuterOptimizerConfig& c) {
  return InUnitInterval("outer_optimizer.momentum", c.momentum());
}

absl::Status CheckDelayedNesterov(const v1::OuterOptimizerConfig& c) {
  const uint32_t n = c.dn_buffer_size();
  if (n < 1 || n > kMaxDnBufferSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "outer_optimizer.dn_buffer_size must be in [1, %d], got %d", kMaxDnBufferSize, n));
  }
  // Compared as floats: c is a float, and its upper end is 1/N as the nearest float.
  const float activation = c.dn_momentum_activation();
  if (!(activation >= 0.0f && activation <= MaxDnMomentumActivation(n))) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer_optimizer.dn_momentum_activation must be in [0, 1/N] with N = "
                        "dn_buffer_size = %d, got %.9g",
                        n, activation));
  }
  return absl::OkStatus();
}

// CODEC_LOWRANK needs a rank and a codec that can encode factors; the other codecs take neither.
absl::Status CheckLowRankLayerCodec(const v1::LayerCodec& layer) {
  if (layer.codec() != v1::CODEC_LOWRANK) {
    if (layer.rank() != 0 || layer.factor_codec() != v1::CODEC_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "transport.layer_codecs: layer \"%s\": rank and factor_codec are for CODEC_LOWRANK",
          layer.layer()));
    }
    return absl::OkStatus();
  }
  if (layer.rank() < 1 || layer.rank() > kMaxLowRank) {
    return absl::InvalidArgumentError(
        absl::StrFormat("transport.layer_codecs: layer \"%s\": rank must be in [1, %d], got %d",
                        layer.layer(), kMaxLowRank, layer.rank()));
  }
  const v1::Codec factor = layer.factor_codec();
  if (factor != v1::CODEC_UNSPECIFIED &&
      (!v1::Codec_IsValid(factor) || !IsLowRankFactorCodec(factor))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "transport.layer_codecs: layer \"%s\": factor_codec %d cannot encode low-rank factors",
        layer.layer(), factor));
  }
  return absl::OkStatus();
}

absl::Status CheckAdam(const v1::OuterOptimizerConfig& c) {
  ALOE_RETURN_IF_ERROR(InUnitInterval("outer_optimizer.adam_beta1", c.adam_beta1()));
  ALOE_RETURN_IF_ERROR(InUnitInterval("outer_optimizer.adam_beta2", c.adam_beta2()));
  return Positive("outer_optimizer.adam_eps", c.adam_eps());
}

// True when `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool IsValidUtf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = s[i];
    int extra = 0;
    uint32_t min = 0, cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      extra = 1, min = 0x80, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2, min = 0x800, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3, min = 0x10000, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + extra >= s.size()) return false;
    for (int k = 1; k <= extra; ++k) {
      const unsigned char next = s[i + k];
      if ((next & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (next & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += extra + 1;
  }
  return true;
}

// The path of the first string field (at any depth) that is not UTF-8, or "" when all are. The
// text-format parser accepts any bytes in a string, but proto3 strings must be UTF-8: such a
// config cannot be written as JSON or serialised, so it is refused when loaded.
std::string FirstNonUtf8Field(const google::protobuf::Message& m, const std::string& prefix) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const FieldDescriptor* f : fields) {
    const std::string name = prefix.empty() ? f->name() : absl::StrCat(prefix, ".", f->name());
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_STRING &&
        f->type() == FieldDescriptor::TYPE_STRING) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(m, f); ++i) {
          if (!IsValidUtf8(r->GetRepeatedString(m, f, i))) return absl::StrCat(name, "[", i, "]");
        }
      } else if (!IsValidUtf8(r->GetString(m, f))) {
        return name;
      }
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(m, f); ++i) {
          std::string bad =
              FirstNonUtf8Field(r->GetRepeatedMessage(m, f, i), absl::StrCat(name, "[", i, "]"));
          if (!bad.empty()) return bad;
        }
      } else {
        std::string bad = FirstNonUtf8Field(r->GetMessage(m, f), name);
        if (!bad.empty()) return bad;
      }
    }
  }
  return "";
}

// Partial synchronization (ServerConfig.partial_sync). The group count's upper bound (the
// model's layers) is checked where the model is known (AssignLayerGroups).
absl::Status ValidatePartialSync(const v1::ServerConfig& c) {
  const v1::PartialSyncConfig& p = c.partial_sync();
  if (p.groups() < 1 || p.groups() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrFormat("partial_sync.groups must be in [1, 4096], got %d", p.groups()));
  }
  if (!v1::SyncSchedule_IsValid(p.schedule())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("partial_sync.schedule %d is unknown", p.schedule()));
  }
  if (!(p.mixing_alpha() >= 0 && p.mixing_alpha() < 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("partial_sync.mixing_alpha must be in [0, 1), got %g", p.mixing_alpha()));
  }
  if (p.merge_delay_steps() > 100000) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "partial_sync.merge_delay_steps must be at most 100000, got %d", p.merge_delay_steps()));
  }
  if (p.fill_bubbles() && p.schedule() != v1::SYNC_SCHEDULE_DREAMDDP) {
    return absl::InvalidArgumentError(
        "partial_sync.fill_bubbles needs partial_sync.schedule DREAMDDP");
  }
  if (p.fill_bubbles() && c.aggregation().mode() != v1::AGGREGATION_ASYNC) {
    return absl::InvalidArgumentError(
        "partial_sync.fill_bubbles needs aggregation.mode ASYNC: a sync round takes one push per "
        "worker and group");
  }
  if (p.groups() > 1 && c.shard_processes() > 0 && c.aggregation().mode() == v1::AGGREGATION_SYNC &&
      static_cast<uint64_t>(c.aggregation().min_workers()) * p.groups() > c.max_staged_updates()) {
    // Each trainer may have an update of every group staged while the groups' rounds wait.
    return absl::InvalidArgumentError(absl::StrFormat(
        "aggregation.min_workers (%d) x partial_sync.groups (%d) exceeds max_staged_updates "
        "(%d): in a layer-sharded sync server each trainer may have an update of every layer "
        "group staged while the rounds wait, so the rounds could stop; raise "
        "max_staged_updates to at least trainers x groups",
        c.aggregation().min_workers(), p.groups(), c.max_staged_updates()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ServerConfig> ParseServerConfig(const std::string& text,
                                                   const std::string& path_for_format) {
  v1::ServerConfig config;
  if (IsJsonPath(path_for_format)) {
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    auto status = google::protobuf::util::JsonStringToMessage(text, &config, options);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_for_format, ": ", std::string(status.message())));
    }
    return config;
  }
  google::protobuf::TextFormat::Parser parser;
  CollectingErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &config)) {
    return absl::InvalidArgumentError(absl::StrCat(path_for_format, ": ", errors.first()));
  }
  if (std::string bad = FirstNonUtf8Field(config, ""); !bad.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_for_format, ": ", bad, " is not valid UTF-8 text"));
  }
  return config;
}

absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("config file ", path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  ALOE_ASSIGN_OR_RETURN(v1::ServerConfig config, ParseServerConfig(buffer.str(), path));
  FillServerDefaults(&config);
  absl::Status status = ValidateServerConfig(config);
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
  }
  return config;
}

void FillServerDefaults(v1::ServerConfig* c) {
  if (c->listen_address().empty()) c->set_listen_address("127.0.0.1:7070");
  if (c->metrics_address().empty()) c->set_metrics_address("127.0.0.1:9464");
  // With a bring-your-own model (model_file) there is no transformer to fill in.
  if (c->model_file().empty()) FillTransformerDefaults(c->mutable_model());
  FillInnerOptimizerDefaults(c->mutable_inner_optimizer());
  auto* outer = c->mutable_outer_optimizer();
  if (outer->type() == v1::OUTER_OPTIMIZER_UNSPECIFIED) outer->set_type(v1::OUTER_NESTEROV);
  if (outer->lr() == 0) outer->set_lr(0.7f);
  if (outer->momentum() == 0 &&
      (outer->type() == v1::OUTER_NESTEROV || outer->type() == v1::OUTER_DELAYED_NESTEROV)) {
    outer->set_momentum(0.9f);
  }
  if (outer->dn_buffer_size() == 0) outer->set_dn_buffer_size(1);
  if (outer->adam_beta1() == 0) outer->set_adam_beta1(0.9f);
  if (outer->adam_beta2() == 0) outer->set_adam_beta2(0.999f);
  if (outer->adam_eps() == 0) outer->set_adam_eps(1e-8f);
  if (c->checkpoint().every_versions() == 0) c->mutable_checkpoint()->set_every_versions(10);
  if (c->checkpoint().keep() == 0) c->mutable_checkpoint()->set_keep(3);
  if (c->security().shard_identity().empty()) {
    c->mutable_security()->set_shard_identity("shards");
  }
  auto* transport = c->mutable_transport();
  if (transport->codec() == v1::CODEC_UNSPECIFIED) transport->set_codec(v1::CODEC_FP32);
  if (transport->int8_block_size() == 0) transport->set_int8_block_size(256);
  if (transport->int4_block_size() == 0) transport->set_int4_block_size(64);
  auto* penalty = c->mutable_penalty();
  if (penalty->ema_alpha() == 0) penalty->set_ema_alpha(0.02f);
  if (penalty->z_threshold() == 0) penalty->set_z_threshold(3.0f);
  if (penalty->warmup() == 0) penalty->set_warmup(120);
  if (penalty->temperature() == 0) penalty->set_temperature(1.0f);
  if (penalty->clip_norm() == 0) penalty->set_clip_norm(10.0f);
  auto* agg = c->mutable_aggregation();
  if (agg->mode() == v1::AGGREGATION_UNSPECIFIED) agg->set_mode(v1::AGGREGATION_SYNC);
  if (agg->min_workers() == 0) agg->set_min_workers(1);
  if (c->local_work().mode() == v1::LOCAL_WORK_UNSPECIFIED) {
    c->mutable_local_work()->set_mode(v1::LOCAL_WORK_FIXED);
  }
  if (c->shard_sampling() == v1::SHARD_SAMPLING_UNSPECIFIED) {
    c->set_shard_sampling(v1::SHARD_SAMPLING_LEARNING_PROGRESS);
  }
  if (c->local_steps() == 0) c->set_local_steps(50);
  if (c->seed() == 0) c->set_seed(1);
  // num_shards is the deprecated name of apply_groups; a conflict between the two is left for
  // ValidateServerConfig to refuse.
  if (c->apply_groups() == 0) c->set_apply_groups(c->num_shards() != 0 ? c->num_shards() : 2);
  if (c->apply_threads() == 0) c->set_apply_threads(c->apply_groups());
  if (c->lease_seconds() == 0) c->set_lease_seconds(10);
  if (c->eval_every() == 0) c->set_eval_every(1);
  if (c->max_staged_updates() == 0) c->set_max_staged_updates(8);
  if (c->receive_window_kib() == 0) c->set_receive_window_kib(2048);
  if (c->max_retained_versions() == 0) c->set_max_retained_versions(1);
  auto* partial = c->mutable_partial_sync();
  if (partial->groups() == 0) partial->set_groups(1);
  if (partial->schedule() == v1::SYNC_SCHEDULE_UNSPECIFIED) {
    partial->set_schedule(v1::SYNC_SCHEDULE_STRIDED);
  }
}

absl::Status ValidateServerConfig(const v1::ServerConfig& c) {
  ALOE_RETURN_IF_ERROR(CheckAddress("listen_address", c.listen_address()));
  if (c.metrics_address() != "off") {
    ALOE_RETURN_IF_ERROR(CheckAddress("metrics_address", c.metrics_address()));
  }
  if (c.model_file().empty()) {
    ALOE_RETURN_IF_ERROR(ValidateTransformerConfig(c.model()));
  } else if (c.has_model()) {
    return absl::InvalidArgumentError(
        "model and model_file are exclusive: model describes the built-in transformer, "
        "model_file an imported one (vocab_size and seq_len come from the file)");
  }
  ALOE_RETURN_IF_ERROR(ValidateInnerOptimizerConfig(c.inner_optimizer()));
  const auto& outer = c.outer_optimizer();
  ALOE_RETURN_IF_ERROR(ValidateOuterOptimizerConfig(outer));
  // The fields this type ignores too, so that a config changed to another type later never
  // meets an out-of-range value there.
  ALOE_RETURN_IF_ERROR(CheckOuterMomentum(outer));
  ALOE_RETURN_IF_ERROR(CheckDelayedNesterov(outer));
  ALOE_RETURN_IF_ERROR(CheckAdam(outer));
  const auto& transport = c.transport();
  if (!v1::Codec_IsValid(transport.codec())) {
    return absl::InvalidArgumentError("transport.codec is not a known codec");
  }
  if (transport.int8_block_size() < 1 || transport.int8_block_size() > 65536) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "transport.int8_block_size must be in [1, 65536], got %d", transport.int8_block_size()));
  }
  if (transport.int4_block_size() < 2 || transport.int4_block_size() > 65536 ||
      transport.int4_block_size() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("transport.int4_block_size must be even and in [2, 65536], got %d",
                        transport.int4_block_size()));
  }
  if (transport.codec() == v1::CODEC_LOWRANK) {
    return absl::InvalidArgumentError(
        "transport.codec: CODEC_LOWRANK is chosen per layer (transport.layer_codecs, with a rank)");
  }
  for (const auto& layer : transport.layer_codecs()) {
    if (!v1::Codec_IsValid(layer.codec()) || layer.codec() == v1::CODEC_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrFormat("transport.layer_codecs: layer \"%s\" needs a codec", layer.layer()));
    }
    ALOE_RETURN_IF_ERROR(CheckLowRankLayerCodec(layer));
  }
  if (c.model_file().empty() && !transport.layer_codecs().empty()) {
    // The built-in model's tensors are known here; an imported model's are checked when the
    // server reads the file (ServerCore::Create).
    ALOE_RETURN_IF_ERROR(
        ValidateLowRankLayers(transport, BuildTransformerSpec(c.model(), 1), kMaxChunkBytes));
  }
  ALOE_RETURN_IF_ERROR(ValidatePenaltyConfig(c.penalty()));
  if (!v1::AggregationMode_IsValid(c.aggregation().mode())) {
    return absl::InvalidArgumentError("aggregation.mode is not a known mode");
  }
  if (!(c.aggregation().grace_seconds() >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("aggregation.grace_seconds must be >= 0 (inf allowed), got %g",
                        c.aggregation().grace_seconds()));
  }
  if (!v1::LocalWorkMode_IsValid(c.local_work().mode())) {
    return absl::InvalidArgumentError("local_work.mode is not a known mode");
  }
  if (c.local_work().mode() == v1::LOCAL_WORK_TIME_BUDGET) {
    ALOE_RETURN_IF_ERROR(
        Positive("local_work.time_budget_seconds", c.local_work().time_budget_seconds()));
  }
  if (!v1::ShardSampling_IsValid(c.shard_sampling())) {
    return absl::InvalidArgumentError("shard_sampling is not a known sampling mode");
  }
  if (c.aggregation().min_workers() > 4096) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "aggregation.min_workers must be <= 4096, got %d", c.aggregation().min_workers()));
  }
  if (c.local_steps() < 1 || c.local_steps() > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrFormat("local_steps must be in [1, 1000000], got %d", c.local_steps()));
  }
  if (c.corpus_dir().empty()) {
    return absl::InvalidArgumentError("corpus_dir must name the prepared corpus directory");
  }
  if (c.num_shards() != 0 && c.num_shards() != c.apply_groups()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_shards (%d) and apply_groups (%d) differ: num_shards is the deprecated name of "
        "apply_groups, set only apply_groups",
        c.num_shards(), c.apply_groups()));
  }
  if (c.apply_groups() < 1 || c.apply_groups() > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s must be in [1, 1024], got %d",
        c.num_shards() != 0 ? "num_shards (deprecated name of apply_groups)" : "apply_groups",
        c.apply_groups()));
  }
  if (c.apply_threads() < 1 || c.apply_threads() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrFormat("apply_threads must be in [1, 1024], got %d", c.apply_threads()));
  }
  if (c.shard_processes() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard_processes must be in [0, 1024], got %d", c.shard_processes()));
  }
  if (c.checkpoint().replicate_shards() && c.checkpoint().dir().empty()) {
    return absl::InvalidArgumentError(
        "checkpoint.replicate_shards needs checkpoint.dir (where the coordinator keeps the copies "
        "and each shard process its own checkpoints)");
  }
  if (c.max_staged_updates() < 1 || c.max_staged_updates() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_staged_updates must be in [1, 4096], got %d", c.max_staged_updates()));
  }
  if (c.shard_processes() > 0 && c.aggregation().mode() == v1::AGGREGATION_SYNC &&
      c.aggregation().min_workers() > c.max_staged_updates()) {
    // Every update of a sync round stays staged on every shard process until the round commits.
    return absl::InvalidArgumentError(absl::StrFormat(
        "aggregation.min_workers (%d) exceeds max_staged_updates (%d): a sync round of a "
        "layer-sharded server commits only once all of its updates are staged at once, so it "
        "could never commit; raise max_staged_updates to at least the number of trainers",
        c.aggregation().min_workers(), c.max_staged_updates()));
  }
  ALOE_RETURN_IF_ERROR(ValidatePartialSync(c));
  if (c.max_retained_versions() < 1 || c.max_retained_versions() > 4096) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_retained_versions must be in [1, 4096], got %d", c.max_retained_versions()));
  }
  if (c.receive_window_kib() < 64 || c.receive_window_kib() > 262144) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "receive_window_kib must be in [64, 262144], got %d", c.receive_window_kib()));
  }
  ALOE_RETURN_IF_ERROR(Positive("lease_seconds", c.lease_seconds()));
  if (!(c.max_seconds() >= 0) || !std::isfinite(c.max_seconds())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_seconds must be >= 0, got %g", c.max_seconds()));
  }
  return absl::OkStatus();
}

absl::Status ValidateLowRankLayers(const v1::TransportConfig& transport, const v1::ModelSpec& spec,
                                   size_t max_chunk_bytes) {
  const BlockSizes blocks = TransportBlockSizes(transport);
  for (const v1::LayerSpec& layer : spec.layers()) {
    // The last override of a layer wins, as on the worker.
    const v1::LayerCodec* codec = nullptr;
    for (const v1::LayerCodec& o : transport.layer_codecs()) {
      if (o.layer() == layer.name()) codec = &o;
    }
    if (codec == nullptr || codec->codec() != v1::CODEC_LOWRANK) continue;
    const v1::Codec factor =
        codec->factor_codec() == v1::CODEC_UNSPECIFIED ? v1::CODEC_FP32 : codec->factor_codec();
    for (const v1::TensorSpec& tensor : layer.tensors()) {
      const uint32_t rank = LowRankTensorRank(tensor, codec->rank());
      if (rank == 0) continue;
      const uint32_t cols = LowRankMatrixShape(tensor)->second;
      const uint64_t bytes = LowRankMinChunkBytes(cols, rank, factor, blocks.Of(factor));
      if (bytes <= max_chunk_bytes) continue;
      return absl::InvalidArgumentError(absl::StrFormat(
          "transport.layer_codecs: layer \"%s\", tensor %s: at rank %d its Q (%d columns x %d "
          "in %s) with the header and one row of P takes %d bytes, above the chunk limit of %d "
          "bytes; at most rank %d fits",
          layer.name(), tensor.name(), rank, cols, rank, v1::Codec_Name(factor), bytes,
          max_chunk_bytes, LowRankMaxChunkRank(cols, factor, blocks.Of(factor), max_chunk_bytes)));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateOuterOptimizerConfig(const v1::OuterOptimizerConfig& c) {
  if (!v1::OuterOptimizerType_IsValid(c.type())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer_optimizer.type %d is not a known outer optimizer", c.type()));
  }
  ALOE_RETURN_IF_ERROR(Positive("outer_optimizer.lr", c.lr()));
  ALOE_RETURN_IF_ERROR(ValidateStalenessExponent(c));
  switch (c.type()) {
    case v1::OUTER_SGD:
      return absl::OkStatus();
    case v1::OUTER_DELAYED_NESTEROV:
      ALOE_RETURN_IF_ERROR(CheckOuterMomentum(c));
      return CheckDelayedNesterov(c);
    case v1::OUTER_ADAM:
      return CheckAdam(c);
    default:  // OUTER_NESTEROV and OUTER_OPTIMIZER_UNSPECIFIED
      return CheckOuterMomentum(c);
  }
}

absl::Status ValidateStalenessExponent(const v1::OuterOptimizerConfig& c) {
  const float a = c.staleness_exponent();
  if (!(a >= 0) || !std::isfinite(a)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer_optimizer.staleness_exponent must be >= 0 and finite, got %g", a));
  }
  return absl::OkStatus();
}

float MaxDnMomentumActivation(uint32_t n) { return n == 0 ? 0.0f : static_cast<float>(1.0 / n); }

absl::Status ValidatePenaltyConfig(const v1::PenaltyConfig& c) {
  if (!(c.ema_alpha() > 0 && c.ema_alpha() <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("penalty.ema_alpha must be in (0, 1], got %g", c.ema_alpha()));
  }
  ALOE_RETURN_IF_ERROR(Positive("penalty.z_threshold", c.z_threshold()));
  ALOE_RETURN_IF_ERROR(Positive("penalty.temperature", c.temperature()));
  return Positive("penalty.clip_norm", c.clip_norm());
}

}  // namespace aloe
