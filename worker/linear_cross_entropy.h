// The language-model head and its loss in one pass over row chunks: the mean cross-entropy of
// predicting `targets` from logits = hidden weight^T, without the [N, V] logits and their float32
// log-probabilities and gradient in memory all at once. Each chunk's logits, log-probabilities
// and the gradients for `hidden` and `weight` are made in the forward pass; backward only scales
// them by the loss's incoming gradient. Per chunk the logits take the log-softmax into float32
// and one pass back into the logits' precision (the gradient the products take); the unfused
// loss also fills a float32 gradient of the pick, runs the log-softmax backward over it and
// casts the result, each over [N, V] at once.
//
// Under autocast the products run in its lower precision as the unfused head's would, the
// log-softmax and the gradient at the targets in float32. Includes LibTorch.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace aloe::worker {

// hidden: [N, d] floating; weight: [V, d] floating; targets: [N] int64 in [0, V). chunk_rows >= 1
// rows a chunk. Returns the mean over the N rows of logsumexp(z_i) - z_i[targets_i], a float32
// scalar, with gradients for hidden and weight where they require them. Under no_grad only the
// loss is computed.
torch::Tensor LinearCrossEntropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                 const torch::Tensor& targets, int64_t chunk_rows);

// The chunk for a vocabulary of `vocab` entries: rows x vocab float32 logits of at most 256 MiB.
int64_t LinearCrossEntropyChunkRows(int64_t vocab);

}  // namespace aloe::worker
