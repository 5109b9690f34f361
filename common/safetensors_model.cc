#include "common/safetensors_model.h"

#include <cmath>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace aloe {
namespace {

const std::map<std::string, std::string>& BlockNames() {
  static const auto* names = new std::map<std::string, std::string>{{"ln1", "ln_1"},
                                                                    {"ln2", "ln_2"},
                                                                    {"attn.qkv", "attn.c_attn"},
                                                                    {"attn.proj", "attn.c_proj"},
                                                                    {"mlp.fc1", "mlp.c_fc"},
                                                                    {"mlp.fc2", "mlp.c_proj"}};
  return *names;
}

uint64_t Elements(const v1::TensorSpec& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace

std::string Gpt2StyleName(const std::string& name) {
  static const auto* fixed =
      new std::map<std::string, std::string>{{"tok_emb.weight", "transformer.wte.weight"},
                                             {"pos_emb.weight", "transformer.wpe.weight"},
                                             {"ln_f.weight", "transformer.ln_f.weight"},
                                             {"ln_f.bias", "transformer.ln_f.bias"},
                                             {"head.weight", "lm_head.weight"}};
  if (const auto it = fixed->find(name); it != fixed->end()) return it->second;
  // blocks.I.<module>.<weight|bias>
  const std::vector<std::string> parts = absl::StrSplit(name, '.');
  uint32_t index = 0;
  if (parts.size() < 4 || parts[0] != "blocks" || !absl::SimpleAtoi(parts[1], &index) ||
      (parts.back() != "weight" && parts.back() != "bias")) {
    return "";
  }
  const std::string module = absl::StrJoin(parts.begin() + 2, parts.end() - 1, ".");
  const auto it = BlockNames().find(module);
  if (it == BlockNames().end()) return "";
  return absl::StrCat("transformer.h.", index, ".", it->second, ".", parts.back());
}

absl::StatusOr<std::vector<SafetensorsTensor>> ModelTensors(
    const v1::ModelSpec& spec, const std::vector<std::vector<float>>& layers, bool gpt2_names) {
  if (layers.size() != static_cast<size_t>(spec.layers_size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d layers, the model spec has %d", layers.size(), spec.layers_size()));
  }
  std::vector<SafetensorsTensor> out;
  for (int l = 0; l < spec.layers_size(); ++l) {
    if (layers[l].size() != spec.layers(l).num_elements()) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %s has %d values, the model spec %d",
                                                        spec.layers(l).name(), layers[l].size(),
                                                        spec.layers(l).num_elements()));
    }
    uint64_t offset = 0;
    for (const v1::TensorSpec& t : spec.layers(l).tensors()) {
      SafetensorsTensor& e = out.emplace_back();
      const std::string gpt2 = gpt2_names ? Gpt2StyleName(t.name()) : "";
      e.name = gpt2.empty() ? t.name() : gpt2;
      e.shape.assign(t.shape().begin(), t.shape().end());
      const uint64_t n = Elements(t);
      e.values.assign(layers[l].begin() + offset, layers[l].begin() + offset + n);
      offset += n;
    }
  }
  return out;
}

std::string TransformerConfigJson(const v1::TransformerConfig& m) {
  return absl::StrFormat(
      "{\n"
      "  \"architectures\": [\"GPT\"],\n"
      "  \"tensor_names\": \"nanoGPT GPT (nn.Linear weights, [out, in])\",\n"
      "  \"vocab_size\": %d,\n"
      "  \"block_size\": %d,\n"
      "  \"n_positions\": %d,\n"
      "  \"n_layer\": %d,\n"
      "  \"n_head\": %d,\n"
      "  \"n_embd\": %d,\n"
      "  \"n_inner\": %d,\n"
      "  \"bias\": true,\n"
      "  \"dropout\": 0.0,\n"
      "  \"activation_function\": \"gelu\",\n"
      "  \"layer_norm_epsilon\": 1e-05,\n"
      "  \"tie_word_embeddings\": false\n"
      "}\n",
      m.vocab_size(), m.seq_len(), m.seq_len(), m.num_layers(), m.num_heads(), m.d_model(),
      m.d_model() * m.ffn_mult());
}

absl::Status SetInitialParameters(const SafetensorsFile& file, const std::string& source,
                                  const v1::ModelSpec& spec,
                                  std::vector<std::vector<float>>* initial) {
  std::map<std::string, const SafetensorsTensor*> by_name;
  for (const SafetensorsTensor& t : file.tensors) by_name[t.name] = &t;
  const auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
  };
  std::set<std::string> used;
  // Per layer, the tensors in spec order (found and checked before anything changes).
  std::vector<std::vector<const SafetensorsTensor*>> found(spec.layers_size());
  for (int l = 0; l < spec.layers_size(); ++l) {
    for (const v1::TensorSpec& t : spec.layers(l).tensors()) {
      const std::string alias = Gpt2StyleName(t.name());
      const auto own = by_name.find(t.name());
      const auto other = alias.empty() ? by_name.end() : by_name.find(alias);
      if (own != by_name.end() && other != by_name.end()) {
        return bad(absl::StrFormat("tensor %s is there twice (also as %s)", t.name(), alias));
      }
      const auto it = own != by_name.end() ? own : other;
      if (it == by_name.end()) {
        return bad(absl::StrFormat("no tensor %s%s", t.name(),
                                   alias.empty() ? "" : absl::StrCat(" (or ", alias, ")")));
      }
      const SafetensorsTensor& e = *it->second;
      if (!std::equal(e.shape.begin(), e.shape.end(), t.shape().begin(), t.shape().end())) {
        return bad(absl::StrFormat("tensor %s has shape [%s], the model [%s]", e.name,
                                   absl::StrJoin(e.shape, ", "), absl::StrJoin(t.shape(), ", ")));
      }
      for (size_t i = 0; i < e.values.size(); ++i) {
        if (!std::isfinite(e.values[i])) {
          return bad(absl::StrFormat("tensor %s holds %g at element %d", e.name, e.values[i], i));
        }
      }
      used.insert(e.name);
      found[l].push_back(&e);
    }
  }
  for (const SafetensorsTensor& t : file.tensors) {
    if (used.count(t.name) == 0) {
      return bad(absl::StrFormat("tensor %s is not one of the model's", t.name));
    }
  }
  initial->resize(spec.layers_size());
  for (int l = 0; l < spec.layers_size(); ++l) {
    std::vector<float>& layer = (*initial)[l];
    if (layer.empty()) continue;  // not held here
    layer.clear();
    for (const SafetensorsTensor* e : found[l]) {
      layer.insert(layer.end(), e->values.begin(), e->values.end());
    }
  }
  return absl::OkStatus();
}

}  // namespace aloe
