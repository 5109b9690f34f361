#include "worker/fsdp.h"

#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <utility>

#if defined(ALOE_WITH_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/lr_schedule.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "worker/script_model.h"
#include "worker/torch_util.h"
#include "worker/transformer.h"

namespace aloe::worker {
namespace {

// Broadcast and all-reduce over a c10d group whose tensors live on `device` (Gloo: the CPU;
// NCCL: the rank's GPU); the subclasses add the layer collectives.
template <typename Group>
class GroupCollectives : public Collectives {
 public:
  GroupCollectives(c10::intrusive_ptr<Group> group, int rank, int size, torch::Device device)
      : group_(std::move(group)), rank_(rank), size_(size), device_(device) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status Broadcast(std::string* bytes, int root) override {
    try {
      c10d::BroadcastOptions options;
      options.rootRank = root;
      std::vector<at::Tensor> size = {
          torch::full({1}, static_cast<int64_t>(bytes->size()),
                      torch::TensorOptions().dtype(torch::kInt64).device(device_))};
      group_->broadcast(size, options)->wait();
      const int64_t n = size[0].item<int64_t>();
      if (rank_ != root) bytes->resize(n);
      if (n == 0) return absl::OkStatus();
      at::Tensor host = torch::from_blob(bytes->data(), {n}, torch::kUInt8);
      std::vector<at::Tensor> data = {device_.is_cpu() ? host : host.to(device_)};
      group_->broadcast(data, options)->wait();
      if (!device_.is_cpu()) host.copy_(data[0]);
    } catch (const std::exception& e) {
      return LibTorchError("broadcast", e);
    }
    return absl::OkStatus();
  }

  absl::Status AllReduceSumFloats(float* values, size_t n) override {
    if (n == 0) return absl::OkStatus();
    try {
      at::Tensor host = torch::from_blob(values, {static_cast<int64_t>(n)}, torch::kFloat32);
      std::vector<at::Tensor> t = {device_.is_cpu() ? host : host.to(device_)};
      group_->allreduce(t)->wait();
      if (!device_.is_cpu()) host.copy_(t[0]);
    } catch (const std::exception& e) {
      return LibTorchError("all-reduce", e);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<double> AllReduceSum(double value) override {
    try {
      std::vector<at::Tensor> t = {
          torch::full({1}, value, torch::TensorOptions().dtype(torch::kFloat64).device(device_))};
      group_->allreduce(t)->wait();
      return t[0].item<double>();
    } catch (const std::exception& e) {
      return LibTorchError("all-reduce", e);
    }
  }

 protected:
  c10::intrusive_ptr<Group> group_;
  const int rank_;
  const int size_;
  const torch::Device device_;
};

// Gloo collectives. Gloo in LibTorch 1.13 has no reduce_scatter: it is an all-to-all of the
// ranks' chunks followed by a local sum in rank order (deterministic).
class GlooCollectives final : public GroupCollectives<c10d::ProcessGroupGloo> {
 public:
  GlooCollectives(c10::intrusive_ptr<c10d::ProcessGroupGloo> group, int rank, int size)
      : GroupCollectives(std::move(group), rank, size, torch::Device(torch::kCPU)) {}

  absl::Status AllGather(const float* shard, size_t n, float* full) override {
    try {
      std::vector<at::Tensor> input = {
          torch::from_blob(const_cast<float*>(shard), {static_cast<int64_t>(n)}, torch::kFloat32)};
      std::vector<std::vector<at::Tensor>> output(1);
      for (int r = 0; r < size_; ++r) {
        output[0].push_back(
            torch::from_blob(full + r * n, {static_cast<int64_t>(n)}, torch::kFloat32));
      }
      group_->allgather(output, input)->wait();
    } catch (const std::exception& e) {
      return LibTorchError("all-gather", e);
    }
    return absl::OkStatus();
  }

  absl::Status ReduceScatterSum(const float* full, size_t n, float* shard) override {
    try {
      const int64_t total = static_cast<int64_t>(n) * size_;
      at::Tensor input = torch::from_blob(const_cast<float*>(full), {total}, torch::kFloat32);
      if (received_.numel() != total) received_ = torch::empty({total}, torch::kFloat32);
      std::vector<int64_t> splits;  // equal chunks
      group_->alltoall_base(received_, input, splits, splits)->wait();
      const float* in = received_.data_ptr<float>();
      std::memcpy(shard, in, n * sizeof(float));
      for (int r = 1; r < size_; ++r) {
        const float* chunk = in + r * n;
        for (size_t i = 0; i < n; ++i) shard[i] += chunk[i];
      }
    } catch (const std::exception& e) {
      return LibTorchError("reduce-scatter", e);
    }
    return absl::OkStatus();
  }

 private:
  at::Tensor received_;  // reused all-to-all output
};

#if defined(ALOE_WITH_NCCL)
// NCCL collectives between the ranks' GPUs (rank r on the device SetTrainerDevice chose). The
// trainer's tensor forms stay on the device (_allgather_base and _reduce_scatter_base on flat
// buffers); the pointer forms and the small messages are copied through it.
class NcclCollectives final : public GroupCollectives<c10d::ProcessGroupNCCL> {
 public:
  NcclCollectives(c10::intrusive_ptr<c10d::ProcessGroupNCCL> group, int rank, int size,
                  torch::Device device)
      : GroupCollectives(std::move(group), rank, size, device) {}

  // LibTorch 2.x: a ProcessGroupNCCL destroyed without shutdown() warns that
  // destroy_process_group() was not called and aborts its communicators; on an H200 with
  // LibTorch 2.11 the test process hung right after that warning (and no longer does with this
  // call). shutdown() is what destroy_process_group() does: it flushes the group's work, stops
  // its watchdog and destroys the communicators.
  ~NcclCollectives() override {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
    try {
      group_->shutdown();
    } catch (const std::exception& e) {
      ALOE_LOG_WARNING("fsdp", "%s", LibTorchError("shutting the NCCL group down", e).ToString());
    }
#endif
  }

  absl::Status AllGather(const float* shard, size_t n, float* full) override {
    try {
      const int64_t count = static_cast<int64_t>(n);
      at::Tensor in = Host(const_cast<float*>(shard), count).to(device_);
      at::Tensor out = torch::empty({count * size_}, in.options());
      ALOE_RETURN_IF_ERROR(AllGatherTensor(in, out));
      Host(full, count * size_).copy_(out);
    } catch (const std::exception& e) {
      return LibTorchError("all-gather", e);
    }
    return absl::OkStatus();
  }

  absl::Status ReduceScatterSum(const float* full, size_t n, float* shard) override {
    try {
      const int64_t count = static_cast<int64_t>(n);
      at::Tensor in = Host(const_cast<float*>(full), count * size_).to(device_);
      at::Tensor out = torch::empty({count}, in.options());
      ALOE_RETURN_IF_ERROR(ReduceScatterSumTensor(in, out));
      Host(shard, count).copy_(out);
    } catch (const std::exception& e) {
      return LibTorchError("reduce-scatter", e);
    }
    return absl::OkStatus();
  }

  absl::Status AllGatherTensor(const at::Tensor& shard, const at::Tensor& full) override {
    try {
      at::Tensor in = shard;
      at::Tensor out = full;
      group_->_allgather_base(out, in)->wait();
    } catch (const std::exception& e) {
      return LibTorchError("all-gather", e);
    }
    return absl::OkStatus();
  }

  absl::Status ReduceScatterSumTensor(const at::Tensor& full, const at::Tensor& shard) override {
    try {
      at::Tensor in = full;
      at::Tensor out = shard;
      c10d::ReduceScatterOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      group_->_reduce_scatter_base(out, in, options)->wait();
    } catch (const std::exception& e) {
      return LibTorchError("reduce-scatter", e);
    }
    return absl::OkStatus();
  }

 private:
  static at::Tensor Host(float* data, int64_t n) {
    return torch::from_blob(data, {n}, torch::kFloat32);
  }
};
#endif  // ALOE_WITH_NCCL

// Forms the node's process groups over one FileStore rendezvous (group g > 0 under the prefix
// "group<g>"); group 0 is NCCL on `device` when it is a GPU, every other group Gloo.
absl::StatusOr<std::vector<std::unique_ptr<Collectives>>> ConnectGroups(
    const std::string& store_path, int rank, int size, int groups, double timeout_seconds,
    const torch::Device& device) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d of %d: need 0 <= rank < size and size >= 1", rank, size));
  }
  if (groups < 1) return absl::InvalidArgumentError("need at least one process group");
  if (!(timeout_seconds > 0)) {
    return absl::InvalidArgumentError("the rendezvous timeout must be > 0 seconds");
  }
#if !defined(ALOE_WITH_NCCL)
  if (device.is_cuda()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "device %s: this aloe-worker's LibTorch has no NCCL, so the ranks of a GPU node cannot "
        "form a process group; build against a CUDA LibTorch (README: GPU workers)",
        device.str()));
  }
#endif
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  try {
    auto store = c10::make_intrusive<c10d::FileStore>(store_path, size);
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->timeout = timeout;
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    std::vector<std::unique_ptr<Collectives>> out;
    for (int g = 0; g < groups; ++g) {
      c10::intrusive_ptr<c10d::Store> prefixed = store;
      if (g > 0) {
        prefixed = c10::make_intrusive<c10d::PrefixStore>(absl::StrFormat("group%d", g), store);
      }
#if defined(ALOE_WITH_NCCL)
      if (g == 0 && device.is_cuda()) {
        auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
        nccl_options->timeout = timeout;
        auto group =
            c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, nccl_options);
        out.push_back(std::make_unique<NcclCollectives>(std::move(group), rank, size, device));
        continue;
      }
#endif
      auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options);
      out.push_back(std::make_unique<GlooCollectives>(std::move(group), rank, size));
    }
    return out;
  } catch (const std::exception& e) {
    return LibTorchError("forming the node's process groups", e);
  }
}

// A flat contiguous float32 host tensor's elements, or kFailedPrecondition.
absl::StatusOr<float*> HostFloats(const at::Tensor& t, const char* what) {
  if (!t.device().is_cpu() || t.scalar_type() != torch::kFloat32 || !t.is_contiguous()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: this process group moves contiguous float32 host memory; got a %s tensor on %s "
        "(a GPU node forms its trainer's group over NCCL: ConnectNodeGroups)",
        what, std::string(c10::toString(t.scalar_type())), t.device().str()));
  }
  return t.data_ptr<float>();
}

}  // namespace

absl::Status Collectives::AllGatherTensor(const at::Tensor& shard, const at::Tensor& full) {
  ALOE_ASSIGN_OR_RETURN(float* in, HostFloats(shard, "all-gather"));
  ALOE_ASSIGN_OR_RETURN(float* out, HostFloats(full, "all-gather"));
  if (full.numel() != shard.numel() * size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("all-gather of %d elements per rank into %d (want %d ranks x)",
                        shard.numel(), full.numel(), size()));
  }
  return AllGather(in, static_cast<size_t>(shard.numel()), out);
}

absl::Status Collectives::ReduceScatterSumTensor(const at::Tensor& full, const at::Tensor& shard) {
  ALOE_ASSIGN_OR_RETURN(float* in, HostFloats(full, "reduce-scatter"));
  ALOE_ASSIGN_OR_RETURN(float* out, HostFloats(shard, "reduce-scatter"));
  if (full.numel() != shard.numel() * size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("reduce-scatter of %d elements into %d per rank (want %d ranks x)",
                        full.numel(), shard.numel(), size()));
  }
  return ReduceScatterSum(in, static_cast<size_t>(shard.numel()), out);
}

absl::StatusOr<std::vector<std::unique_ptr<Collectives>>> ConnectGlooGroups(
    const std::string& store_path, int rank, int size, int groups, double timeout_seconds) {
  return ConnectGroups(store_path, rank, size, groups, timeout_seconds, torch::Device(torch::kCPU));
}

absl::StatusOr<std::vector<std::unique_ptr<Collectives>>> ConnectNodeGroups(
    const std::string& store_path, int rank, int size, int groups, double timeout_seconds) {
  return ConnectGroups(store_path, rank, size, groups, timeout_seconds, TrainingDevice());
}

absl::StatusOr<std::unique_ptr<Collectives>> ConnectGloo(const std::string& store_path, int rank,
                                                         int size, double timeout_seconds) {
  ALOE_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Collectives>> groups,
                        ConnectGlooGroups(store_path, rank, size, 1, timeout_seconds));
  return std::move(groups[0]);
}

ShardLayout::ShardLayout(const v1::ModelSpec& spec, int num_ranks, int rank)
    : num_ranks(num_ranks), rank(rank) {
  for (const v1::LayerSpec& layer : spec.layers()) {
    const size_t n = layer.num_elements();
    elements_.push_back(n);
    slice_.push_back((n + num_ranks - 1) / num_ranks);
  }
}

size_t ShardLayout::begin(int layer) const {
  return SliceRange(elements_[layer], num_ranks, rank).first;
}

size_t ShardLayout::end(int layer) const {
  return SliceRange(elements_[layer], num_ranks, rank).second;
}

size_t ShardLayout::total_owned() const {
  size_t total = 0;
  for (size_t l = 0; l < slice_.size(); ++l) total += owned(static_cast<int>(l));
  return total;
}

struct FsdpTrainer::Impl {
  v1::TransformerConfig model_config;
  v1::InnerOptimizerConfig inner;
  v1::ModelSpec spec;
  Collectives* collectives = nullptr;
  ShardLayout layout{v1::ModelSpec(), 1, 0};
  TransformerLM model{nullptr};                // the built-in transformer, or
  ScriptModelPtr script;                       // a bring-your-own TorchScript model
  torch::Device device{torch::kCPU};           // where every buffer below lives
  std::vector<torch::Tensor> params;           // module parameters in spec order
  std::vector<std::vector<int>> layer_params;  // indices into params, per layer
  std::vector<std::vector<int64_t>> shapes;    // per parameter, from the spec
  std::vector<int64_t> numels;                 // per parameter
  // Per layer, flat, padded to the slice length (elements past owned() stay 0):
  std::vector<torch::Tensor> shard;  // owned parameters
  std::vector<torch::Tensor> grad;   // owned gradient of the last step
  std::vector<torch::Tensor> m, v;   // AdamW moments
  // Per layer, the runs [offset, offset + length) of the owned slice that belong to matrices
  // (weight decay applies to them only).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> decay_runs;
  std::vector<torch::Tensor> full;  // gathered layers during a step
  uint64_t step = 0;

  int N() const { return layout.num_ranks; }
  torch::TensorOptions Floats() const {
    return torch::TensorOptions().dtype(torch::kFloat32).device(device);
  }
  // This rank's owned elements of layer l in host memory (a view, without a copy, on the CPU).
  torch::Tensor HostSlice(int l) const {
    return shard[l].narrow(0, 0, static_cast<int64_t>(layout.owned(l))).to(torch::kCPU);
  }

  // Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (this rank's rows).
  torch::Tensor Loss(const torch::Tensor& tokens) {
    return script ? ScriptLoss(*script, tokens, model_config.vocab_size()) : model->Loss(tokens);
  }
  void SetTraining(bool on) {
    if (script) {
      script->module.train(on);
    } else {
      model->train(on);
    }
  }

  // With `params` set: the per-parameter shapes, this rank's slices of `initial` (one buffer per
  // spec layer) on the device, the weight-decay runs and zero moments; then drops the module's full
  // tensors.
  absl::Status Init(const std::vector<std::vector<float>>& initial) {
    try {
      int index = 0;
      for (int l = 0; l < spec.layers_size(); ++l) {
        const int64_t slice = static_cast<int64_t>(layout.slice(l));
        layer_params.emplace_back();
        decay_runs.emplace_back();
        const int64_t b = static_cast<int64_t>(layout.begin(l));
        const int64_t e = static_cast<int64_t>(layout.end(l));
        int64_t offset = 0;
        for (const v1::TensorSpec& t : spec.layers(l).tensors()) {
          layer_params.back().push_back(index++);
          shapes.emplace_back(t.shape().begin(), t.shape().end());
          int64_t numel = 1;
          for (int64_t d : t.shape()) numel *= d;
          numels.push_back(numel);
          // Decoupled weight decay on matrices only, as LocalTrainer's parameter groups.
          const int64_t first = std::max(offset, b), last = std::min(offset + numel, e);
          if (t.shape_size() >= 2 && first < last) {
            decay_runs.back().emplace_back(first - b, last - first);
          }
          offset += numel;
        }
        const int64_t owned = e - b;
        shard.push_back(torch::zeros({slice}, Floats()));
        shard.back()
            .narrow(0, 0, owned)
            .copy_(torch::from_blob(const_cast<float*>(initial[l].data()) + b, {owned},
                                    torch::kFloat32));
        grad.push_back(torch::zeros({slice}, Floats()));
        m.push_back(torch::zeros({slice}, Floats()));
        v.push_back(torch::zeros({slice}, Floats()));
      }
      Release();  // the module's own full-size initial tensors are not kept
    } catch (const std::exception& e) {
      return LibTorchError("placing the parameter slices", e);
    }
    return absl::OkStatus();
  }

  // Gathers every layer and points the module's parameters at the gathered buffers.
  absl::Status Materialize() {
    full.resize(spec.layers_size());
    for (int l = 0; l < spec.layers_size(); ++l) {
      const int64_t slice = static_cast<int64_t>(layout.slice(l));
      full[l] = torch::empty({slice * N()}, Floats());
      ALOE_RETURN_IF_ERROR(collectives->AllGatherTensor(shard[l], full[l]));
      int64_t offset = 0;
      for (int index : layer_params[l]) {
        const int64_t numel = numels[index];
        params[index].set_data(full[l].narrow(0, offset, numel).view(shapes[index]));
        offset += numel;
      }
    }
    return absl::OkStatus();
  }

  // Drops the gathered parameters and the full gradients: between steps only slices remain.
  void Release() {
    for (torch::Tensor& p : params) {
      p.mutable_grad() = torch::Tensor();
      p.set_data(torch::empty({0}, Floats()));
    }
    full.clear();
  }

  // Reduce-scatters the gradients of the module into `grad` (mean over ranks) and returns the
  // squared L2 norm of this rank's owned part.
  absl::StatusOr<double> ScatterGradients() {
    torch::Tensor squared =
        torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device));
    for (int l = 0; l < spec.layers_size(); ++l) {
      const int64_t slice = static_cast<int64_t>(layout.slice(l));
      torch::Tensor flat = torch::zeros({slice * N()}, Floats());
      int64_t offset = 0;
      for (int index : layer_params[l]) {
        const torch::Tensor& p = params[index];
        const int64_t numel = p.numel();
        if (p.grad().defined()) flat.narrow(0, offset, numel).copy_(p.grad().reshape({numel}));
        offset += numel;
      }
      ALOE_RETURN_IF_ERROR(collectives->ReduceScatterSumTensor(flat, grad[l]));
      grad[l].mul_(1.0 / N());
      squared.add_(grad[l].to(torch::kFloat64).square().sum());
    }
    return squared.item<double>();
  }

  // One AdamW step on the owned slices with learning rate `lr`, with LibTorch's AdamW tensor
  // operations (float32 arithmetic, scalars rounded to float): p *= 1 - lr * wd (matrices only);
  // m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) +
  // eps).
  void AdamWStep(double lr) {
    ++step;
    const double b1 = inner.beta1();
    const double b2 = inner.beta2();
    const double bc1 = 1 - std::pow(b1, static_cast<double>(step));
    const double bc2 = 1 - std::pow(b2, static_cast<double>(step));
    const double wd = inner.weight_decay();
    for (int l = 0; l < spec.layers_size(); ++l) {
      torch::Tensor& p = shard[l];
      const torch::Tensor& g = grad[l];
      if (wd != 0) {
        for (const auto& [offset, length] : decay_runs[l]) {
          p.narrow(0, offset, length).mul_(1 - lr * wd);
        }
      }
      m[l].mul_(b1).add_(g, 1 - b1);
      v[l].mul_(b2).addcmul_(g, g, 1 - b2);
      const torch::Tensor denom = (v[l].sqrt() / std::sqrt(bc2)).add_(inner.eps());
      p.addcdiv_(m[l], denom, -lr / bc1);
    }
  }
};

FsdpTrainer::FsdpTrainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FsdpTrainer::~FsdpTrainer() = default;

const ShardLayout& FsdpTrainer::layout() const { return impl_->layout; }

size_t FsdpTrainer::optimizer_state_elements() const { return 2 * impl_->layout.total_owned(); }

uint64_t FsdpTrainer::optimizer_steps() const { return impl_->step; }

namespace {

absl::Status CheckNodeBatch(const v1::InnerOptimizerConfig& inner, int ranks) {
  if (inner.batch_size() % ranks != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "inner_optimizer.batch_size %d (the node's batch per step) must be a multiple of the %d "
        "ranks",
        inner.batch_size(), ranks));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<FsdpTrainer>> FsdpTrainer::Create(
    const v1::TransformerConfig& model, const v1::InnerOptimizerConfig& inner,
    const v1::ModelSpec& spec, uint64_t seed, Collectives& collectives) {
  ALOE_RETURN_IF_ERROR(ValidateTransformerConfig(model));
  ALOE_RETURN_IF_ERROR(ValidateInnerOptimizerConfig(inner));
  ALOE_RETURN_IF_ERROR(CheckNodeBatch(inner, collectives.size()));
  auto impl = std::make_unique<Impl>();
  impl->model_config = model;
  impl->inner = inner;
  impl->spec = spec;
  impl->collectives = &collectives;
  impl->layout = ShardLayout(spec, collectives.size(), collectives.rank());
  try {
    ApplyTrainerThreads();
    impl->model = TransformerLM(model);
  } catch (const std::exception& e) {
    return LibTorchError("building the model", e);
  }
  ALOE_RETURN_IF_ERROR(CheckParametersMatchSpec(*impl->model, spec));
  impl->params = impl->model->parameters();
  impl->device = TrainingDevice();
  ALOE_RETURN_IF_ERROR(CheckAttentionKernelRuns(model, impl->device));
  ALOE_RETURN_IF_ERROR(impl->Init(InitializeParameters(spec, seed)));
  return std::unique_ptr<FsdpTrainer>(new FsdpTrainer(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<FsdpTrainer>> FsdpTrainer::CreateForScript(
    ScriptModelPtr model, uint32_t vocab_size, uint32_t seq_len,
    const v1::InnerOptimizerConfig& inner, const v1::ModelSpec& spec, Collectives& collectives) {
  ALOE_RETURN_IF_ERROR(ValidateInnerOptimizerConfig(inner));
  ALOE_RETURN_IF_ERROR(CheckNodeBatch(inner, collectives.size()));
  auto impl = std::make_unique<Impl>();
  ALOE_ASSIGN_OR_RETURN(impl->model_config, ScriptDataShape(vocab_size, seq_len));
  impl->inner = inner;
  impl->spec = spec;
  impl->collectives = &collectives;
  impl->layout = ShardLayout(spec, collectives.size(), collectives.rank());
  impl->device = TrainingDevice();
  ALOE_RETURN_IF_ERROR(MoveScriptModel(*model, impl->device));
  ALOE_ASSIGN_OR_RETURN(impl->params, ParametersInSpecOrder(*model, spec));
  // The module's own values, one flat buffer per layer (every rank loaded the same file).
  std::vector<std::vector<float>> initial;
  ALOE_RETURN_IF_ERROR(CopyParametersIntoLayers(impl->params, spec, &initial));
  impl->script = std::move(model);
  ALOE_RETURN_IF_ERROR(impl->Init(initial));
  return std::unique_ptr<FsdpTrainer>(new FsdpTrainer(std::move(impl)));
}

absl::Status FsdpTrainer::SetParameterShards(const std::vector<std::vector<float>>& shards) {
  const v1::ModelSpec& spec = impl_->spec;
  if (shards.size() != static_cast<size_t>(spec.layers_size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "got %d layer slices, the model spec has %d layers", shards.size(), spec.layers_size()));
  }
  for (int l = 0; l < spec.layers_size(); ++l) {
    if (shards[l].size() != impl_->layout.owned(l)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "slice of layer %d \"%s\" has %d elements, rank %d owns %d", l, spec.layers(l).name(),
          shards[l].size(), impl_->layout.rank, impl_->layout.owned(l)));
    }
  }
  try {
    for (int l = 0; l < spec.layers_size(); ++l) {
      const int64_t owned = static_cast<int64_t>(shards[l].size());
      impl_->shard[l]
          .narrow(0, 0, owned)
          .copy_(torch::from_blob(const_cast<float*>(shards[l].data()), {owned}, torch::kFloat32));
    }
  } catch (const std::exception& e) {
    return LibTorchError("setting the parameter slices", e);
  }
  return absl::OkStatus();
}

absl::Status FsdpTrainer::GetParameterShards(std::vector<std::vector<float>>* shards) const {
  shards->resize(impl_->spec.layers_size());
  try {
    for (int l = 0; l < impl_->spec.layers_size(); ++l) {
      const torch::Tensor host = impl_->HostSlice(l);
      const float* data = host.data_ptr<float>();
      (*shards)[l].assign(data, data + host.numel());
    }
  } catch (const std::exception& e) {
    return LibTorchError("reading the parameter slices", e);
  }
  return absl::OkStatus();
}

absl::Status FsdpTrainer::PseudoGradientShards(const std::vector<std::vector<float>>& base,
                                               std::vector<std::vector<float>>* out) const {
  const v1::ModelSpec& spec = impl_->spec;
  if (base.size() != static_cast<size_t>(spec.layers_size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "base has %d layer slices, the model spec has %d layers", base.size(), spec.layers_size()));
  }
  for (int l = 0; l < spec.layers_size(); ++l) {
    if (base[l].size() != impl_->layout.owned(l)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "base slice of layer %d \"%s\" has %d elements, rank %d owns %d", l,
          spec.layers(l).name(), base[l].size(), impl_->layout.rank, impl_->layout.owned(l)));
    }
  }
  ALOE_RETURN_IF_ERROR(GetParameterShards(out));
  for (size_t l = 0; l < base.size(); ++l) {
    const float* b = base[l].data();
    float* g = (*out)[l].data();
    for (size_t i = 0; i < base[l].size(); ++i) g[i] = b[i] - g[i];
  }
  return absl::OkStatus();
}

absl::Status FsdpTrainer::GatherParameters(std::vector<std::vector<float>>* layers) {
  const v1::ModelSpec& spec = impl_->spec;
  layers->resize(spec.layers_size());
  try {
    for (int l = 0; l < spec.layers_size(); ++l) {
      const int64_t slice = static_cast<int64_t>(impl_->layout.slice(l));
      torch::Tensor full = torch::empty({slice * impl_->N()}, impl_->Floats());
      ALOE_RETURN_IF_ERROR(impl_->collectives->AllGatherTensor(impl_->shard[l], full));
      const torch::Tensor host =
          full.narrow(0, 0, static_cast<int64_t>(spec.layers(l).num_elements())).to(torch::kCPU);
      (*layers)[l].assign(host.data_ptr<float>(), host.data_ptr<float>() + host.numel());
    }
  } catch (const std::exception& e) {
    return LibTorchError("gathering the parameters", e);
  }
  return absl::OkStatus();
}

absl::Status FsdpTrainer::SetParameters(const std::vector<std::vector<float>>& shards) {
  return SetParameterShards(shards);
}

absl::Status FsdpTrainer::PseudoGradient(const std::vector<std::vector<float>>& base,
                                         std::vector<std::vector<float>>* out) const {
  return PseudoGradientShards(base, out);
}

absl::StatusOr<TrainStats> FsdpTrainer::Train(const TrainRequest& request) {
  if (request.data == nullptr) return absl::InvalidArgumentError("no training data");
  if (request.slowdown != 1.0) {
    return absl::InvalidArgumentError("a multi-rank node does not emulate a slowdown");
  }
  return Train(*request.data, request.steps, request.lr_step, request.seed,
               request.time_budget_seconds, request.interrupt);
}

absl::StatusOr<double> FsdpTrainer::Evaluate(const EvalRequest& request) {
  return absl::FailedPreconditionError("a multi-rank node does not evaluate");
}

absl::StatusOr<InnerState> FsdpTrainer::SaveInnerState() const {
  const Impl& s = *impl_;
  InnerState state;
  state.steps = s.step;
  try {
    for (int l = 0; l < s.spec.layers_size(); ++l) {
      const int64_t owned = static_cast<int64_t>(s.layout.owned(l));
      for (auto [moments, out] : {std::pair{&s.m, &state.first}, std::pair{&s.v, &state.second}}) {
        const torch::Tensor host = (*moments)[l].narrow(0, 0, owned).to(torch::kCPU).contiguous();
        out->emplace_back(host.data_ptr<float>(), host.data_ptr<float>() + owned);
      }
    }
  } catch (const std::exception& e) {
    return LibTorchError("saving the AdamW state", e);
  }
  return state;
}

absl::Status FsdpTrainer::RestoreInnerState(const InnerState& state) {
  Impl& s = *impl_;
  const size_t layers = static_cast<size_t>(s.spec.layers_size());
  if (state.first.size() != layers || state.second.size() != layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the state has %d and %d layers, the model spec has %d", state.first.size(),
                        state.second.size(), layers));
  }
  for (size_t l = 0; l < layers; ++l) {
    const size_t owned = s.layout.owned(l);
    if (state.first[l].size() != owned || state.second[l].size() != owned) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d \"%s\": the state has %d and %d elements, this rank owns %d", l,
          s.spec.layers(l).name(), state.first[l].size(), state.second[l].size(), owned));
    }
  }
  try {
    for (size_t l = 0; l < layers; ++l) {
      const int64_t owned = static_cast<int64_t>(s.layout.owned(l));
      for (auto [moments, in] : {std::pair{&s.m, &state.first}, std::pair{&s.v, &state.second}}) {
        float* data = const_cast<float*>((*in)[l].data());  // from_blob only reads here
        (*moments)[l].narrow(0, 0, owned).copy_(torch::from_blob(data, {owned}, torch::kFloat32));
      }
    }
  } catch (const std::exception& e) {
    return LibTorchError("restoring the AdamW state", e);
  }
  s.step = state.steps;
  return absl::OkStatus();
}

absl::StatusOr<TrainStats> FsdpTrainer::Train(const TokenSource& data, uint32_t steps,
                                              uint64_t lr_step, uint64_t seed,
                                              double time_budget_seconds,
                                              const std::atomic<bool>* interrupt) {
  Impl& s = *impl_;
  if (!(time_budget_seconds >= 0) || !std::isfinite(time_budget_seconds)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("time budget must be a finite number >= 0, got %g", time_budget_seconds));
  }
  const int64_t seq_len = s.model_config.seq_len();
  const int64_t window = seq_len + 1;
  const uint32_t batch = s.inner.batch_size();
  const uint32_t rows = batch / s.N();
  const uint64_t n = data.num_tokens();
  if (n < static_cast<uint64_t>(window)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "training data has %d tokens, fewer than one window of seq_len + 1 = %d", n, window));
  }
  // Every rank draws the node's whole batch from the task seed (the same windows LocalTrainer
  // draws) and trains on its rows of it.
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint64_t> start_dist(0, n - window);
  std::vector<uint64_t> starts(batch);
  TrainStats stats;
  double loss_sum = 0;
  const bool may_stop_early = time_budget_seconds > 0 || interrupt != nullptr;
  const auto round_start = std::chrono::steady_clock::now();
  try {
    ApplyTrainerThreads();
    s.SetTraining(true);
    for (uint32_t i = 0; i < steps; ++i) {
      if (may_stop_early) {
        // Every rank takes part in the vote, so they all stop after the same step.
        bool stop = interrupt != nullptr && interrupt->load();
        if (time_budget_seconds > 0 && i > 0) {
          stop |= std::chrono::duration<double>(std::chrono::steady_clock::now() - round_start)
                      .count() >= time_budget_seconds;
        }
        ALOE_ASSIGN_OR_RETURN(double votes, s.collectives->AllReduceSum(stop ? 1.0 : 0.0));
        if (votes > 0) break;
      }
      const auto t0 = std::chrono::steady_clock::now();
      for (uint64_t& start : starts) start = start_dist(rng);
      const std::vector<uint64_t> mine(starts.begin() + s.layout.rank * rows,
                                       starts.begin() + (s.layout.rank + 1) * rows);
      ALOE_ASSIGN_OR_RETURN(torch::Tensor tokens,
                            ReadBatch(data, mine, window, s.model_config.vocab_size()));
      tokens = tokens.to(s.device);
      const double lr = InnerLearningRate(s.inner, lr_step + i);  // paper 002 Eq. 3
      ALOE_RETURN_IF_ERROR(s.Materialize());
      torch::Tensor loss;
      {
        TrainingAutocast autocast;  // --autocast bf16: the forward pass only
        loss = s.Loss(tokens);
      }
      loss.backward();
      ALOE_ASSIGN_OR_RETURN(double squared, s.ScatterGradients());
      ALOE_ASSIGN_OR_RETURN(double node_loss, s.collectives->AllReduceSum(loss.item<double>()));
      s.Release();
      if (s.inner.grad_clip() > 0) {
        ALOE_ASSIGN_OR_RETURN(double total, s.collectives->AllReduceSum(squared));
        const double clip = s.inner.grad_clip() / (std::sqrt(total) + 1e-6);
        if (clip < 1) {
          for (torch::Tensor& g : s.grad) g.mul_(clip);
        }
      }
      s.AdamWStep(lr);
      loss_sum += node_loss / s.N();
      ++stats.steps;
      stats.compute_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  } catch (const std::exception& e) {
    s.Release();
    return LibTorchError("training step", e);
  }
  stats.tokens = static_cast<uint64_t>(stats.steps) * batch * seq_len;
  stats.mean_loss = stats.steps > 0 ? loss_sum / stats.steps : 0.0;
  return stats;
}

absl::StatusOr<std::unique_ptr<TrainerInterface>> TrainerFor(
    const v1::JoinReply& joined, ScriptModelPtr script, Collectives* node,
    std::optional<StepSlowdowns> step_slowdowns) {
  const v1::TransformerConfig& model = joined.model();
  if (node != nullptr && step_slowdowns.has_value()) {
    return absl::InvalidArgumentError("a multi-rank node does not replay a step-time trace");
  }
  if (node != nullptr && script != nullptr) {
    return FsdpTrainer::CreateForScript(std::move(script), model.vocab_size(), model.seq_len(),
                                        joined.inner_optimizer(), joined.model_spec(), *node);
  }
  if (node != nullptr) {
    return FsdpTrainer::Create(model, joined.inner_optimizer(), joined.model_spec(), joined.seed(),
                               *node);
  }
  absl::StatusOr<std::unique_ptr<LocalTrainer>> local =
      script != nullptr
          ? LocalTrainer::CreateForScript(std::move(script), model.vocab_size(), model.seq_len(),
                                          joined.inner_optimizer(), joined.model_spec())
          : LocalTrainer::Create(model, joined.inner_optimizer(), joined.model_spec(),
                                 joined.seed());
  if (local.ok() && step_slowdowns.has_value()) {
    (*local)->SetStepSlowdowns(*std::move(step_slowdowns));
  }
  if (!local.ok()) return local.status();
  return std::unique_ptr<TrainerInterface>(*std::move(local));
}

}  // namespace aloe::worker
