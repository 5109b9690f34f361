#include "worker/step_graph.h"

#include <ATen/autocast_mode.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <torch/version.h>

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <utility>

#include "common/logging.h"

#if defined(ALOE_WITH_TORCH_CUDA) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3))
#define ALOE_CUDA_GRAPHS 1
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#endif

namespace aloe::worker {
namespace {

// Makes `waiter` wait for the work queued on `waited` so far.
void Follow(const c10::Stream& waiter, const c10::Stream& waited) {
  c10::Event queued(waited.device_type());
  queued.record(waited);
  queued.block(waiter);
}

c10::Stream CurrentStream(const torch::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

// LibTorch's autocast cache off for a scope: a weight's cast cached before a capture would be
// read by the graph without being recorded in it.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : was_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(was_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  const bool was_;
};

}  // namespace

bool CudaGraphsAvailable() {
#if defined(ALOE_CUDA_GRAPHS)
  return true;
#else
  return false;
#endif
}

struct StepGraph::Impl {
  torch::Device device;
  c10::Stream side;
#if defined(ALOE_CUDA_GRAPHS)
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

StepGraph::StepGraph(const torch::Device& device) {
  if (!CudaGraphsAvailable()) {
    throw std::invalid_argument("CUDA graphs need ALOE built against a CUDA LibTorch >= 2.3");
  }
  if (!device.is_cuda()) throw std::invalid_argument("CUDA graphs need a CUDA device");
  impl_ = std::unique_ptr<Impl>(new Impl{
      device, c10::impl::getDeviceGuardImpl(device.type())->getStreamFromGlobalPool(device)});
}

StepGraph::~StepGraph() = default;

void StepGraph::Warmup(const std::function<void()>& step) {
  const c10::Stream current = CurrentStream(impl_->device);
  Follow(impl_->side, current);
  {
    c10::StreamGuard on_side(impl_->side);
    step();
  }
  Follow(current, impl_->side);
}

bool StepGraph::captured() const {
#if defined(ALOE_CUDA_GRAPHS)
  return impl_->graph != nullptr;
#else
  return false;
#endif
}

void StepGraph::Capture(const std::function<void()>& step) {
#if defined(ALOE_CUDA_GRAPHS)
  if (captured()) throw std::logic_error("StepGraph: already captured");
  // The replays follow the work queued before them on the current stream; the capture records
  // nothing of it, so the side stream starts from the same point.
  Follow(impl_->side, CurrentStream(impl_->device));
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  {
    c10::StreamGuard on_side(impl_->side);
    AutocastCacheOff no_cache;
    // Thread-local: the agent's other thread copies rounds in and out on streams of its own
    // meanwhile, and its calls must neither fail nor end this capture.
    graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      step();
    } catch (...) {
      try {
        graph->capture_end();
      } catch (const std::exception&) {
      }
      (void)cudaGetLastError();  // the failed capture's error must not surface in a later launch
      throw;
    }
    try {
      graph->capture_end();
    } catch (...) {
      (void)cudaGetLastError();
      throw;
    }
  }
  impl_->graph = std::move(graph);
  // The warm-up steps' memory is free again and the graph's pool now holds its own: hand the
  // cached blocks back rather than keep the step's memory twice.
  c10::cuda::CUDACachingAllocator::emptyCache();
#else
  (void)step;
  throw std::logic_error("StepGraph: no CUDA graphs in this build");
#endif
}

void StepGraph::Replay() {
#if defined(ALOE_CUDA_GRAPHS)
  if (!captured()) throw std::logic_error("StepGraph: nothing captured to replay");
  impl_->graph->replay();
#else
  throw std::logic_error("StepGraph: no CUDA graphs in this build");
#endif
}

GraphedSteps::GraphedSteps(InnerAdamW* optimizer, const torch::Device& device, Body body,
                           int warmup_steps)
    : optimizer_(optimizer),
      device_(device),
      body_(std::move(body)),
      warmup_left_(std::max(warmup_steps, 0)),
      graph_(device) {
  if (!optimizer_->capturable()) {
    throw std::invalid_argument(
        "GraphedSteps: the optimizer must read its learning rate from the device");
  }
  loss_ = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
}

void GraphedSteps::RunBody() {
  const torch::Tensor loss = body_(batch_);
  torch::NoGradGuard no_grad;
  loss_.copy_(loss.detach());
}

torch::Tensor GraphedSteps::Step(const torch::Tensor& batch, double lr) {
  if (!batch_.defined()) {
    batch_ = torch::empty(batch.sizes(), batch.options().device(device_));
  } else if (batch.sizes() != batch_.sizes() || batch.scalar_type() != batch_.scalar_type()) {
    throw std::invalid_argument("GraphedSteps: every step's batch must have the first's shape");
  }
  {
    torch::NoGradGuard no_grad;
    // Page-locked: the copy does not wait for the device; the pinned block is held until the
    // copy has run.
    batch_.copy_(batch.is_pinned() ? batch : batch.pin_memory(), /*non_blocking=*/true);
  }
  optimizer_->SetLearningRate(lr);
  if (graph_.captured()) {
    graph_.Replay();
  } else if (failed_) {
    RunBody();
  } else if (warmup_left_ > 0) {
    graph_.Warmup([this] { RunBody(); });
    --warmup_left_;
  } else {
    try {
      graph_.Capture([this] { RunBody(); });
    } catch (const std::exception& e) {
      failed_ = true;
      ALOE_LOG_WARNING(
          "worker", "the inner step runs without a CUDA graph: capturing it failed: %s", e.what());
    }
    if (graph_.captured()) {
      ALOE_LOG_INFO("worker", "the inner step runs as a CUDA graph from here on");
      graph_.Replay();
    } else {
      RunBody();
    }
  }
  optimizer_->CountStep();
  return loss_;
}

}  // namespace aloe::worker
