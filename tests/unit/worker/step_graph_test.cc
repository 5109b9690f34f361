#include "worker/step_graph.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "worker/trainer.h"

namespace aloe::worker {
namespace {

TEST(StepGraphTest, RefusesTheCpuAndBuildsWithoutCudaGraphs) {
  EXPECT_THROW({ StepGraph cpu{torch::Device(torch::kCPU)}; }, std::invalid_argument);
  if (!CudaGraphsAvailable()) {
    EXPECT_THROW({ StepGraph gpu{torch::Device(torch::kCUDA, 0)}; }, std::invalid_argument);
  }
}

// On a GPU (skipped without one): a warm-up runs its step at once; a capture runs nothing; each
// replay runs the captured kernels again on what the input tensor holds by then, after the work
// queued before it, and what the step allocated during the capture stays in place.
TEST(StepGraphTest, ReplaysTheCapturedKernelsOnTheGpu) {
  if (VisibleGpus() == 0) GTEST_SKIP() << "no GPU visible to LibTorch";
  ASSERT_TRUE(CudaGraphsAvailable()) << "a CUDA LibTorch without CUDA graphs";
  const torch::Device gpu(torch::kCUDA, 0);
  torch::NoGradGuard no_grad;
  torch::Tensor x = torch::arange(1000, torch::TensorOptions().dtype(torch::kFloat32).device(gpu));
  torch::Tensor y = torch::zeros_like(x);
  torch::Tensor made;  // allocated inside the step
  StepGraph graph(gpu);
  auto step = [&] {
    made = x * 2;
    y.add_(made).add_(1);
  };
  graph.Warmup(step);
  EXPECT_FALSE(graph.captured());
  EXPECT_TRUE(torch::equal(y.cpu(), (x * 2 + 1).cpu()));
  y.zero_();
  graph.Capture(step);
  EXPECT_TRUE(graph.captured());
  EXPECT_EQ(y.abs().sum().item<double>(), 0.0) << "the capture ran its kernels";
  x.fill_(3);  // queued on the current stream before the replay: the replay reads it
  graph.Replay();
  graph.Replay();
  EXPECT_TRUE(torch::equal(y.cpu(), torch::full({1000}, 14.0f)));
  EXPECT_TRUE(torch::equal(made.cpu(), torch::full({1000}, 6.0f)));
  EXPECT_THROW(graph.Capture(step), std::logic_error) << "one capture per graph";
}

}  // namespace
}  // namespace aloe::worker
