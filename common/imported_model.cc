#include "common/imported_model.h"

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/model_spec.h"
#include "common/safetensors.h"
#include "common/safetensors_model.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/token_shard.h"

namespace aloe {
namespace {

bool IsNumber(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

uint64_t Fnv1a64(absl::string_view text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string ShapeText(const google::protobuf::RepeatedField<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::Status Invalid(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("imported model: ", what));
}

}  // namespace

std::string LayerNameOf(absl::string_view parameter) {
  const std::vector<absl::string_view> parts = absl::StrSplit(parameter, '.');
  if (parts.size() == 1) return "root";
  if (parts.size() >= 3 && IsNumber(parts[1])) return absl::StrCat(parts[0], ".", parts[1]);
  return std::string(parts[0]);
}

std::vector<v1::LayerSpec> GroupIntoLayers(const std::vector<ParameterShape>& parameters) {
  std::vector<v1::LayerSpec> layers;
  std::map<std::string, size_t> index;
  for (const ParameterShape& p : parameters) {
    const std::string layer = LayerNameOf(p.name);
    auto [it, inserted] = index.emplace(layer, layers.size());
    if (inserted) {
      layers.emplace_back();
      layers.back().set_id(static_cast<uint32_t>(it->second));
      layers.back().set_name(layer);
    }
    v1::LayerSpec& spec = layers[it->second];
    v1::TensorSpec* t = spec.add_tensors();
    t->set_name(p.name);
    uint64_t elements = 1;
    for (int64_t d : p.shape) {
      t->add_shape(d);
      elements *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
    }
    spec.set_num_elements(spec.num_elements() + elements);
  }
  return layers;
}

std::string ModelFingerprint(const v1::ImportedModel& model) {
  std::string text = absl::StrCat("output=", v1::ModelOutput_Name(model.output()), ";");
  for (const v1::LayerSpec& layer : model.layers()) {
    absl::StrAppend(&text, "layer=", layer.name(), ":");
    for (const v1::TensorSpec& t : layer.tensors()) {
      absl::StrAppend(&text, t.name(), ShapeText(t.shape()), ";");
    }
  }
  return absl::StrFormat("byo1-%016x", Fnv1a64(text));
}

absl::Status ValidateImportedModel(const v1::ImportedModel& model) {
  if (model.format() != kImportedModelFormat) {
    return Invalid(absl::StrFormat("format %d is unknown (expected %d)", model.format(),
                                   kImportedModelFormat));
  }
  if (model.vocab_size() < 2) {
    return Invalid(absl::StrFormat("vocab_size must be >= 2, got %d", model.vocab_size()));
  }
  if (model.seq_len() < 1 || model.seq_len() > kMaxImportedSeqLen) {
    return Invalid(
        absl::StrFormat("seq_len must be in [1, %d], got %d", kMaxImportedSeqLen, model.seq_len()));
  }
  if (model.output() != v1::MODEL_OUTPUT_LOSS && model.output() != v1::MODEL_OUTPUT_LOGITS) {
    return Invalid(absl::StrFormat(
        "output must be MODEL_OUTPUT_LOSS or MODEL_OUTPUT_LOGITS, got %d", model.output()));
  }
  if (model.layers_size() < 1 || model.layers_size() > static_cast<int>(kMaxImportedLayers)) {
    return Invalid(absl::StrFormat("must have 1 to %d layers, has %d", kMaxImportedLayers,
                                   model.layers_size()));
  }
  if (model.layer_params_size() != model.layers_size()) {
    return Invalid(absl::StrFormat("has %d layers but parameters for %d", model.layers_size(),
                                   model.layer_params_size()));
  }
  std::set<std::string> layer_names;
  std::set<std::string> tensor_names;
  double total = 0;
  for (int l = 0; l < model.layers_size(); ++l) {
    const v1::LayerSpec& layer = model.layers(l);
    const std::string where = absl::StrFormat("layer %d \"%s\"", l, layer.name());
    if (layer.id() != static_cast<uint32_t>(l)) {
      return Invalid(absl::StrFormat("%s has id %d", where, layer.id()));
    }
    if (layer.name().empty() || !layer_names.insert(layer.name()).second) {
      return Invalid(absl::StrCat(where, ": layer names must be non-empty and unique"));
    }
    if (layer.tensors_size() == 0) return Invalid(absl::StrCat(where, " has no tensors"));
    double elements = 0;
    for (const v1::TensorSpec& t : layer.tensors()) {
      if (t.name().empty() || !tensor_names.insert(t.name()).second) {
        return Invalid(
            absl::StrFormat("%s: tensor name \"%s\" is empty or not unique", where, t.name()));
      }
      double n = 1;
      for (int64_t d : t.shape()) {
        if (d < 1) {
          return Invalid(
              absl::StrFormat("%s: tensor \"%s\" has shape %s (every dimension must "
                              "be >= 1)",
                              where, t.name(), ShapeText(t.shape())));
        }
        n *= static_cast<double>(d);
      }
      elements += n;
    }
    total += elements;
    if (total > kMaxModelParameters) {
      return Invalid(absl::StrFormat("has more than %g parameters", kMaxModelParameters));
    }
    if (static_cast<double>(layer.num_elements()) != elements) {
      return Invalid(absl::StrFormat("%s has num_elements %d but its tensors hold %.0f", where,
                                     layer.num_elements(), elements));
    }
    const std::string& bytes = model.layer_params(l);
    if (bytes.size() != layer.num_elements() * sizeof(float)) {
      return Invalid(absl::StrFormat("%s: parameters are %d bytes, expected %d (4 x %d)", where,
                                     bytes.size(), layer.num_elements() * sizeof(float),
                                     layer.num_elements()));
    }
    std::vector<float> values(layer.num_elements());
    absl::Status finite = DecodeFloats(bytes, absl::MakeSpan(values));  // also rejects NaN/Inf
    if (!finite.ok()) return Invalid(absl::StrCat(where, ": ", finite.message()));
  }
  const std::string expected = ModelFingerprint(model);
  if (model.fingerprint() != expected) {
    return Invalid(absl::StrFormat("fingerprint \"%s\" does not match its layers (%s)",
                                   model.fingerprint(), expected));
  }
  return absl::OkStatus();
}

absl::Status WriteImportedModel(const std::string& path, const v1::ImportedModel& model) {
  ALOE_RETURN_IF_ERROR(ValidateImportedModel(model));
  std::string bytes(kImportedModelMagic, sizeof(kImportedModelMagic));
  if (!model.AppendToString(&bytes)) {
    return absl::InvalidArgumentError("imported model: too large to serialize (2 GiB at most)");
  }
  return WriteFileAtomically(path, bytes);
}

absl::StatusOr<v1::ImportedModel> ReadImportedModel(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  if (bytes.size() < sizeof(kImportedModelMagic) ||
      bytes.compare(0, sizeof(kImportedModelMagic), kImportedModelMagic,
                    sizeof(kImportedModelMagic)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not an imported-model file (write one with aloe-import-model)"));
  }
  v1::ImportedModel model;
  if (!model.ParseFromArray(bytes.data() + sizeof(kImportedModelMagic),
                            static_cast<int>(bytes.size() - sizeof(kImportedModelMagic)))) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": imported model is truncated or corrupt"));
  }
  absl::Status valid = ValidateImportedModel(model);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", valid.message()));
  return model;
}

namespace {

// The model without ServerConfig.init_file.
absl::StatusOr<ServerModel> LoadModelOf(const v1::ServerConfig& config, int64_t params_of) {
  ServerModel out;
  // Layer-sharded across processes: each layer's shard is the shard process that owns it;
  // otherwise its apply group.
  const uint32_t shards =
      config.shard_processes() > 0 ? config.shard_processes() : config.apply_groups();
  if (config.model_file().empty()) {
    out.spec = BuildTransformerSpec(config.model(), shards);
    if (params_of != kNoLayers)
      out.initial = InitializeParameters(out.spec, config.seed(), params_of);
    out.vocab_size = config.model().vocab_size();
    out.seq_len = config.model().seq_len();
    return out;
  }
  absl::StatusOr<v1::ImportedModel> model = ReadImportedModel(config.model_file());
  if (!model.ok()) {
    return absl::Status(model.status().code(),
                        absl::StrCat("model_file: ", model.status().message()));
  }
  for (int l = 0; l < model->layers_size(); ++l) *out.spec.add_layers() = model->layers(l);
  AssignShards(shards, &out.spec);
  if (params_of != kNoLayers) {
    for (int l = 0; l < model->layers_size(); ++l) {
      std::vector<float>& values = out.initial.emplace_back();
      if (params_of != kAllLayers && out.spec.layers(l).shard() != params_of) continue;
      values.resize(model->layers(l).num_elements());
      ALOE_RETURN_IF_ERROR(DecodeFloats(model->layer_params(l), absl::MakeSpan(values)));
    }
  }
  out.fingerprint = model->fingerprint();
  out.vocab_size = model->vocab_size();
  out.seq_len = model->seq_len();
  return out;
}

}  // namespace

absl::StatusOr<ServerModel> LoadServerModel(const v1::ServerConfig& config, int64_t params_of) {
  ALOE_ASSIGN_OR_RETURN(ServerModel out, LoadModelOf(config, params_of));
  if (config.init_file().empty()) return out;
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(config.init_file());
  if (!file.ok()) {
    return absl::Status(file.status().code(), absl::StrCat("init_file: ", file.status().message()));
  }
  // A coordinator holds no parameters but refuses a file its shard processes would refuse.
  std::vector<std::vector<float>> none;
  absl::Status set = SetInitialParameters(*file, config.init_file(), out.spec,
                                          params_of == kNoLayers ? &none : &out.initial);
  if (!set.ok()) return absl::Status(set.code(), absl::StrCat("init_file: ", set.message()));
  return out;
}

}  // namespace aloe
