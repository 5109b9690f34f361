#include "common/model_spec.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace aloe {
namespace {

void AddTensor(v1::LayerSpec* layer, const std::string& name, std::vector<int64_t> shape,
               v1::InitKind init, float init_std = 0.0f) {
  v1::TensorSpec* t = layer->add_tensors();
  t->set_name(name);
  for (int64_t dim : shape) t->add_shape(dim);
  t->set_init(init);
  if (init == v1::INIT_NORMAL) t->set_init_std(init_std);
  uint64_t n = 1;
  for (int64_t dim : shape) n *= static_cast<uint64_t>(dim);
  layer->set_num_elements(layer->num_elements() + n);
}

void AddLayerNorm(v1::LayerSpec* layer, const std::string& prefix, int64_t d) {
  AddTensor(layer, prefix + ".weight", {d}, v1::INIT_ONES);
  AddTensor(layer, prefix + ".bias", {d}, v1::INIT_ZEROS);
}

// SplitMix64 finaliser: turns (seed, layer id) into well-separated engine seeds.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

absl::Status PositiveField(const char* field, uint64_t v) {
  if (v == 0) return absl::InvalidArgumentError(absl::StrCat("model.", field, " must be > 0"));
  return absl::OkStatus();
}

}  // namespace

void FillTransformerDefaults(v1::TransformerConfig* c) {
  if (c->vocab_size() == 0) c->set_vocab_size(256);
  if (c->seq_len() == 0) c->set_seq_len(128);
  if (c->d_model() == 0) c->set_d_model(256);
  if (c->num_layers() == 0) c->set_num_layers(4);
  if (c->num_heads() == 0) c->set_num_heads(4);
  if (c->ffn_mult() == 0) c->set_ffn_mult(4);
  if (c->init_std() == 0) c->set_init_std(0.02f);
}

absl::Status ValidateTransformerConfig(const v1::TransformerConfig& c) {
  for (absl::Status s :
       {PositiveField("vocab_size", c.vocab_size()), PositiveField("seq_len", c.seq_len()),
        PositiveField("d_model", c.d_model()), PositiveField("num_layers", c.num_layers()),
        PositiveField("num_heads", c.num_heads()), PositiveField("ffn_mult", c.ffn_mult())}) {
    if (!s.ok()) return s;
  }
  if (!(c.init_std() > 0) || !std::isfinite(c.init_std())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("model.init_std must be > 0, got %g", c.init_std()));
  }
  if (c.d_model() % c.num_heads() != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model.num_heads (%d) must divide model.d_model (%d)", c.num_heads(), c.d_model()));
  }
  if (c.num_layers() > kMaxTransformerBlocks) {
    return absl::InvalidArgumentError(absl::StrFormat("model.num_layers must be at most %d, got %d",
                                                      kMaxTransformerBlocks, c.num_layers()));
  }
  if (const double n = TransformerParameters(c); n > kMaxModelParameters) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model describes %.3g parameters, more than the limit of %.3g (check vocab_size, "
        "seq_len, d_model, ffn_mult)",
        n, kMaxModelParameters));
  }
  return absl::OkStatus();
}

double TransformerParameters(const v1::TransformerConfig& c) {
  const double vocab = c.vocab_size(), seq = c.seq_len(), d = c.d_model();
  const double f = static_cast<double>(c.ffn_mult()) * d;
  // Per block: ln1, qkv (weight + bias), proj, ln2, fc1, fc2.
  const double block =
      2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (f * d + f) + (d * f + d);
  return (vocab + seq) * d + c.num_layers() * block + 2 * d + vocab * d;
}

v1::ModelSpec BuildTransformerSpec(const v1::TransformerConfig& c, uint32_t num_shards) {
  const int64_t vocab = c.vocab_size();
  const int64_t seq = c.seq_len();
  const int64_t d = c.d_model();
  const int64_t f = static_cast<int64_t>(c.ffn_mult()) * d;
  const uint32_t num_layers = c.num_layers();
  const float init_std = c.init_std();
  // GPT-2: residual projections scaled by 1/sqrt(2L) so the residual stream's variance does not
  // grow with depth.
  const float proj_std = static_cast<float>(init_std / std::sqrt(2.0 * num_layers));

  v1::ModelSpec spec;
  uint32_t id = 0;
  v1::LayerSpec* embed = spec.add_layers();
  embed->set_id(id++);
  embed->set_name("embed");
  AddTensor(embed, "tok_emb.weight", {vocab, d}, v1::INIT_NORMAL, init_std);
  AddTensor(embed, "pos_emb.weight", {seq, d}, v1::INIT_NORMAL, init_std);

  for (uint32_t i = 0; i < num_layers; ++i) {
    v1::LayerSpec* block = spec.add_layers();
    block->set_id(id++);
    const std::string p = absl::StrCat("blocks.", i);
    block->set_name(p);
    AddLayerNorm(block, p + ".ln1", d);
    AddTensor(block, p + ".attn.qkv.weight", {3 * d, d}, v1::INIT_NORMAL, init_std);
    AddTensor(block, p + ".attn.qkv.bias", {3 * d}, v1::INIT_ZEROS);
    AddTensor(block, p + ".attn.proj.weight", {d, d}, v1::INIT_NORMAL, proj_std);
    AddTensor(block, p + ".attn.proj.bias", {d}, v1::INIT_ZEROS);
    AddLayerNorm(block, p + ".ln2", d);
    AddTensor(block, p + ".mlp.fc1.weight", {f, d}, v1::INIT_NORMAL, init_std);
    AddTensor(block, p + ".mlp.fc1.bias", {f}, v1::INIT_ZEROS);
    AddTensor(block, p + ".mlp.fc2.weight", {d, f}, v1::INIT_NORMAL, proj_std);
    AddTensor(block, p + ".mlp.fc2.bias", {d}, v1::INIT_ZEROS);
  }

  v1::LayerSpec* head = spec.add_layers();
  head->set_id(id++);
  head->set_name("head");
  AddLayerNorm(head, "ln_f", d);
  AddTensor(head, "head.weight", {vocab, d}, v1::INIT_NORMAL, init_std);

  AssignShards(num_shards, &spec);
  return spec;
}

void AssignShards(uint32_t num_shards, v1::ModelSpec* spec) {
  // Greedy longest-processing-time balancing of bytes over the apply groups or shard processes.
  const uint32_t shards = std::max<uint32_t>(num_shards, 1);
  spec->set_num_shards(shards);
  std::vector<int> order(spec->layers_size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return spec->layers(a).num_elements() > spec->layers(b).num_elements();
  });
  std::vector<uint64_t> load(shards, 0);
  for (int l : order) {
    const uint32_t target =
        static_cast<uint32_t>(std::min_element(load.begin(), load.end()) - load.begin());
    spec->mutable_layers(l)->set_shard(target);
    load[target] += spec->layers(l).num_elements() * sizeof(float);
  }
}

uint64_t TotalElements(const v1::ModelSpec& spec) {
  uint64_t total = 0;
  for (const v1::LayerSpec& layer : spec.layers()) total += layer.num_elements();
  return total;
}

double TrainingFlopsPerToken(const v1::ModelSpec& spec, const v1::TransformerConfig& model) {
  const bool builtin = model.num_layers() > 0;
  double multiplied = 0;
  for (const v1::LayerSpec& layer : spec.layers()) {
    for (const v1::TensorSpec& t : layer.tensors()) {
      if (builtin && (t.name() == "tok_emb.weight" || t.name() == "pos_emb.weight")) continue;
      double n = 1;
      for (int64_t d : t.shape()) n *= static_cast<double>(d);
      multiplied += n;
    }
  }
  const double attention =
      builtin ? 12.0 * model.num_layers() * model.d_model() * model.seq_len() : 0.0;
  return 6 * multiplied + attention;
}

std::vector<std::vector<float>> InitializeParameters(const v1::ModelSpec& spec, uint64_t seed,
                                                     int64_t only_shard_process) {
  std::vector<std::vector<float>> params;
  params.reserve(spec.layers_size());
  for (int l = 0; l < spec.layers_size(); ++l) {
    const v1::LayerSpec& layer = spec.layers(l);
    std::vector<float> buffer;
    if (only_shard_process != kAllLayers && layer.shard() != only_shard_process) {
      params.push_back(std::move(buffer));
      continue;
    }
    buffer.reserve(layer.num_elements());
    std::mt19937_64 engine(Mix(seed ^ Mix(static_cast<uint64_t>(l))));
    for (const v1::TensorSpec& t : layer.tensors()) {
      uint64_t n = 1;
      for (int64_t dim : t.shape()) n *= static_cast<uint64_t>(dim);
      switch (t.init()) {
        case v1::INIT_NORMAL: {
          if (!(t.init_std() > 0)) {  // N(0, 0) is not a valid distribution
            buffer.insert(buffer.end(), n, 0.0f);
            break;
          }
          std::normal_distribution<float> normal(0.0f, t.init_std());
          for (uint64_t i = 0; i < n; ++i) buffer.push_back(normal(engine));
          break;
        }
        case v1::INIT_ONES:
          buffer.insert(buffer.end(), n, 1.0f);
          break;
        default:  // INIT_ZEROS, INIT_UNSPECIFIED
          buffer.insert(buffer.end(), n, 0.0f);
          break;
      }
    }
    params.push_back(std::move(buffer));
  }
  return params;
}

std::pair<uint64_t, uint64_t> SliceRange(uint64_t elements, uint32_t slices, uint32_t slice) {
  const uint64_t length = (elements + slices - 1) / slices;
  return {std::min(elements, slice * length), std::min(elements, (slice + 1) * length)};
}

absl::Status CheckSlice(uint32_t slice, uint32_t slices) {
  if (slices > kMaxSlices || (slices > 1 && slice >= slices) || (slices <= 1 && slice != 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("slice %d of %d: need slice < slices <= %d (slices 0 or 1 = whole layers)",
                        slice, slices, kMaxSlices));
  }
  return absl::OkStatus();
}

}  // namespace aloe
