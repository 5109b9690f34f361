// Runs independent pieces of work, e.g. the outer step of one apply group each. Algorithm code
// receives an Executor instead of creating threads (docs/architecture.md, "Dependency rule").
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace aloe {

class Executor {
 public:
  virtual ~Executor() = default;
  // Calls fn(i) for every i in [0, n) and returns when all calls returned. fn must be safe to
  // call concurrently for different i. Calls to ParallelFor itself must not overlap.
  virtual void ParallelFor(int n, const std::function<void(int)>& fn) = 0;
};

// Runs everything on the calling thread, in index order. For tests and the simulator.
class InlineExecutor final : public Executor {
 public:
  void ParallelFor(int n, const std::function<void(int)>& fn) override {
    for (int i = 0; i < n; ++i) fn(i);
  }
};

// A fixed pool of threads. ParallelFor is not reentrant: callers serialise it. The destructor
// joins the threads.
class ThreadPoolExecutor final : public Executor {
 public:
  explicit ThreadPoolExecutor(int num_threads);
  ~ThreadPoolExecutor() override;
  ThreadPoolExecutor(const ThreadPoolExecutor&) = delete;
  ThreadPoolExecutor& operator=(const ThreadPoolExecutor&) = delete;

  void ParallelFor(int n, const std::function<void(int)>& fn) override;

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int)>* fn_ = nullptr;  // guarded by mu_
  int next_ = 0;                                  // guarded by mu_
  int end_ = 0;                                   // guarded by mu_
  int running_ = 0;                               // guarded by mu_
  bool shutdown_ = false;                         // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace aloe
