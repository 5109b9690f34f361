// Inputs shared by the tests of low-rank compression (common/low_rank.h), its wire format and
// its pushes: random matrices and layer specs built tensor by tensor. Header-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "proto/aloe.pb.h"

namespace aloe::testing {

// rows x cols values drawn from N(0, stddev^2), row-major; the same for the same seed.
inline std::vector<float> RandomMatrix(size_t rows, size_t cols, uint32_t seed,
                                       float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, stddev);
  std::vector<float> m(rows * cols);
  for (float& v : m) v = normal(rng);
  return m;
}

// Appends a tensor of `shape` to `layer` and adds its elements to the layer's num_elements.
inline void AddTensor(v1::LayerSpec* layer, const std::string& name,
                      const std::vector<int64_t>& shape) {
  v1::TensorSpec* t = layer->add_tensors();
  t->set_name(name);
  uint64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= static_cast<uint64_t>(d);
  }
  layer->set_num_elements(layer->num_elements() + n);
}

}  // namespace aloe::testing
