// A model's parameters as safetensors (common/safetensors.h): what aloe-export writes and what
// ServerConfig.init_file starts a job from.
//
// Tensors go by the model spec's names. The built-in transformer's tensors also have GPT-2-style
// names, those of nanoGPT's GPT module (nn.Linear weights, [out, in]), which the same
// architecture has: pre-LN blocks, fused qkv in the order q, k, v, exact GELU, learned positions,
// an untied head:
//   tok_emb.weight -> transformer.wte.weight     pos_emb.weight -> transformer.wpe.weight
//   blocks.I.ln1 / ln2 -> transformer.h.I.ln_1 / ln_2
//   blocks.I.attn.qkv / proj -> transformer.h.I.attn.c_attn / c_proj
//   blocks.I.mlp.fc1 / fc2 -> transformer.h.I.mlp.c_fc / c_proj
//   ln_f -> transformer.ln_f                      head.weight -> lm_head.weight
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/safetensors.h"
#include "proto/aloe.pb.h"

namespace aloe {

// The GPT-2-style name of a built-in transformer tensor; "" for any other name.
std::string Gpt2StyleName(const std::string& name);

// The spec's tensors of `layers` (one flat buffer per spec layer), in spec order, under their
// spec names or, with gpt2_names, their GPT-2-style names where they have one.
// kInvalidArgument when a layer's size is not the spec's.
absl::StatusOr<std::vector<SafetensorsTensor>> ModelTensors(
    const v1::ModelSpec& spec, const std::vector<std::vector<float>>& layers, bool gpt2_names);

// config.json for GPT-2-style code: the built-in transformer's sizes under nanoGPT's and
// Hugging Face GPT-2's keys, with the activation and layer-norm settings this model uses.
std::string TransformerConfigJson(const v1::TransformerConfig& model);

// Replaces the layers of `initial` that are held (non-empty; a shard process holds only its own)
// by the tensors of `file`, each found by its spec name or its GPT-2-style name. Checks every
// tensor of the spec whether held or not, so that every process of a job refuses alike.
// kInvalidArgument naming `source` and the tensor for a tensor missing, found under both names,
// of another shape, holding NaN or Inf, or in the file but not in the model; `initial` is then
// unchanged.
absl::Status SetInitialParameters(const SafetensorsFile& file, const std::string& source,
                                  const v1::ModelSpec& spec,
                                  std::vector<std::vector<float>>* initial);

}  // namespace aloe
