// libFuzzer target for the config loader: the input is parsed as a text-format ServerConfig
// and as JSON (ParseServerConfig with a .textproto and a .json path, the two paths
// LoadServerConfig takes), then completed with FillServerDefaults and checked with
// ValidateServerConfig. Built with ASan + UBSan (tests/fuzz/CMakeLists.txt).
//
// Oracle (a violation aborts, which libFuzzer reports as a crash):
//   - Every error is kInvalidArgument with a non-empty message.
//   - FillServerDefaults is idempotent.
//   - A config that validates survives a round trip through text format and through JSON
//     unchanged (NaN equal to NaN), and validates again.
//   - For a valid config whose model is small enough to describe quickly, BuildTransformerSpec
//     describes exactly the parameter count of the layout documented in common/model_spec.h.
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/field_comparator.h>
#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "common/config.h"
#include "common/model_spec.h"
#include "proto/aloe.pb.h"
#include "tests/fuzz/fuzz_check.h"

namespace aloe {
namespace {

// Same meaning: NaN equals NaN, and a field set to its default value equals an unset one (a
// text-format `max_seconds: -0` is a set -0.0 in proto3, which JSON prints as an unset 0).
bool SameConfig(const v1::ServerConfig& a, const v1::ServerConfig& b) {
  google::protobuf::util::DefaultFieldComparator comparator;
  comparator.set_treat_nan_as_equal(true);
  google::protobuf::util::MessageDifferencer differencer;
  differencer.set_field_comparator(&comparator);
  differencer.set_message_field_comparison(google::protobuf::util::MessageDifferencer::EQUIVALENT);
  return differencer.Compare(a, b);
}

void CheckError(const absl::Status& s, const char* what) {
  FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument && !s.message().empty(), "%s: %s", what,
             s.ToString().c_str());
}

// Parameters of the documented layout (common/model_spec.h), in double so that absurd sizes
// cannot overflow the check itself.
double ExpectedParameters(const v1::TransformerConfig& m) {
  const double v = m.vocab_size(), s = m.seq_len(), d = m.d_model();
  const double f = static_cast<double>(m.ffn_mult()) * d;
  const double block =
      2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (f * d + f) + (d * f + d);
  return (v * d + s * d) + m.num_layers() * block + (2 * d + v * d);
}

void CheckValidConfig(const v1::ServerConfig& config) {
  v1::ServerConfig again = config;
  FillServerDefaults(&again);
  FUZZ_CHECK(SameConfig(again, config), "FillServerDefaults is not idempotent:\n%s",
             config.DebugString().c_str());

  std::string text;
  FUZZ_CHECK(google::protobuf::TextFormat::PrintToString(config, &text), "cannot print");
  absl::StatusOr<v1::ServerConfig> from_text = ParseServerConfig(text, "roundtrip.textproto");
  FUZZ_CHECK(from_text.ok(), "printed config does not parse: %s\n%s",
             from_text.status().ToString().c_str(), text.c_str());
  FUZZ_CHECK(SameConfig(*from_text, config), "text round trip changed the config:\n%s",
             text.c_str());
  FUZZ_CHECK(ValidateServerConfig(*from_text).ok(), "text round trip no longer validates");

  std::string json;
  FUZZ_CHECK(google::protobuf::util::MessageToJsonString(config, &json).ok(), "no JSON");
  absl::StatusOr<v1::ServerConfig> from_json = ParseServerConfig(json, "roundtrip.json");
  FUZZ_CHECK(from_json.ok(), "printed JSON does not parse: %s\n%s",
             from_json.status().ToString().c_str(), json.c_str());
  FUZZ_CHECK(SameConfig(*from_json, config), "JSON round trip changed the config:\n%s",
             json.c_str());

  // Only models that are cheap to describe: the config does not bound the sizes (see the
  // report in tests/fuzz/README.md), and a billion-layer spec is not a decoder bug.
  const v1::TransformerConfig& m = config.model();
  const double expected = ExpectedParameters(m);
  if (m.num_layers() <= 64 && expected <= 1e15) {
    const v1::ModelSpec spec = BuildTransformerSpec(m, config.apply_groups());
    FUZZ_CHECK(spec.layers_size() == static_cast<int>(m.num_layers()) + 2, "%d layers",
               spec.layers_size());
    FUZZ_CHECK(static_cast<double>(TotalElements(spec)) == expected,
               "spec has %llu parameters, the layout %g",
               static_cast<unsigned long long>(TotalElements(spec)), expected);
    for (const v1::LayerSpec& layer : spec.layers()) {
      FUZZ_CHECK(layer.shard() < config.apply_groups(), "layer %s in apply group %u of %u",
                 layer.name().c_str(), layer.shard(), config.apply_groups());
    }
  }
}

void Run(const std::string& text, const char* path) {
  absl::StatusOr<v1::ServerConfig> parsed = ParseServerConfig(text, path);
  if (!parsed.ok()) {
    CheckError(parsed.status(), path);
    return;
  }
  v1::ServerConfig config = *std::move(parsed);
  FillServerDefaults(&config);
  const absl::Status valid = ValidateServerConfig(config);
  if (!valid.ok()) {
    CheckError(valid, "ValidateServerConfig");
    return;
  }
  CheckValidConfig(config);
}

}  // namespace
}  // namespace aloe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  aloe::Run(text, "fuzz.textproto");
  aloe::Run(text, "fuzz.json");
  return 0;
}
