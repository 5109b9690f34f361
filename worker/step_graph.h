// The inner step as one CUDA graph: captured once after a few eager steps, then replayed, so
// that a step costs the host one launch instead of one per kernel (several hundred for a
// transformer's forward, backward, clip and AdamW) and the GPU runs the kernels back to back.
//
// A graph replays exactly the kernels it recorded, on the same memory: the step must read every
// input that changes between steps from device tensors that stay in place (the batch, the
// learning rate: InnerAdamW::capturable()), keep its shapes, and never make the host wait for
// the device. The built-in transformer's step does all of that; a TorchScript model's step is
// not known to, and runs eagerly.
//
// Includes <torch/torch.h>: only for translation units that use LibTorch anyway.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>

#include "worker/inner_adamw.h"

namespace aloe::worker {

// Whether this build can capture CUDA graphs: linked against a CUDA LibTorch of 2.3 or newer.
bool CudaGraphsAvailable();

// One CUDA graph, captured on a side stream of its device and replayed on the current stream.
// Not thread-safe.
class StepGraph {
 public:
  // Throws std::invalid_argument for a device that is not CUDA or a build without CUDA graphs.
  explicit StepGraph(const torch::Device& device);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Runs `step` eagerly on the side stream, after the work queued on the current stream so far;
  // the current stream then waits for it. Whatever a step initialises lazily for a stream
  // (cuBLAS workspaces, ...) is then made before the capture, not inside it.
  void Warmup(const std::function<void()>& step);

  // Records `step` on the side stream: its kernels are captured, not run, and what it allocates
  // comes from the graph's own memory pool, held for the replays. LibTorch's autocast cache is
  // off during the capture (a cast made before it would not be recorded). Only this thread's
  // calls are checked by the capture: another thread's copies on streams of their own go on.
  // Throws when the capture fails; no capture is then left open and captured() stays false.
  void Capture(const std::function<void()>& step);
  bool captured() const;

  // Launches the captured kernels on the current stream, after the work queued there.
  void Replay();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Training steps of one model on a GPU through a StepGraph: `warmup_steps` eager steps on the
// graph's side stream, then one capture, then replays. Each step copies its batch into a device
// tensor that stays in place and writes its learning rate into the optimizer's device tensor.
// When the capture fails, the reason is logged and every later step runs eagerly: the same
// arithmetic, one launch per kernel. Not thread-safe.
class GraphedSteps {
 public:
  // One step on the device batch it is given ([rows, window] int64): clears the gradients, takes
  // the loss, runs backward and launches the AdamW step with optimizer->LaunchStep (never Step).
  // Returns the loss.
  using Body = std::function<torch::Tensor(const torch::Tensor& batch)>;

  // `optimizer` must be capturable() and outlive this object; `body` steps its parameters.
  GraphedSteps(InnerAdamW* optimizer, const torch::Device& device, Body body, int warmup_steps = 3);

  // One step on `batch` (int64 on the host; every call the same shape, else
  // std::invalid_argument) at learning rate `lr`, counted by the optimizer. Returns the step's
  // loss, a 0-dim float32 tensor on the device that the next step overwrites.
  torch::Tensor Step(const torch::Tensor& batch, double lr);

  // Whether steps now replay the graph (false while warming up and after a failed capture).
  bool replaying() const { return graph_.captured(); }
  // Whether the capture failed (every step then runs eagerly).
  bool failed() const { return failed_; }

 private:
  void RunBody();

  InnerAdamW* optimizer_;
  torch::Device device_;
  Body body_;
  int warmup_left_;
  bool failed_ = false;
  StepGraph graph_;
  torch::Tensor batch_;  // the device batch every step reads
  torch::Tensor loss_;   // the loss every step writes
};

}  // namespace aloe::worker
