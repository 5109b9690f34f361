// The tiny transformer the worker's trainer tests train: small enough for a step in
// milliseconds on one core, with every kind of parameter the full model has. Header-only.
#pragma once

#include <cstdint>

#include "common/model_spec.h"
#include "proto/aloe.pb.h"

namespace aloe::testing {

inline constexpr uint32_t kTinyVocab = 16;

// Vocabulary 16, 16 tokens, width 32, 2 blocks of 2 heads.
inline v1::TransformerConfig TinyTransformer() {
  v1::TransformerConfig c;
  c.set_vocab_size(kTinyVocab);
  c.set_seq_len(16);
  c.set_d_model(32);
  c.set_num_layers(2);
  c.set_num_heads(2);
  FillTransformerDefaults(&c);
  return c;
}

}  // namespace aloe::testing
