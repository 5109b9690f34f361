#include "common/executor.h"

namespace aloe {

ThreadPoolExecutor::ThreadPoolExecutor(int num_threads) {
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { Loop(); });
}

ThreadPoolExecutor::~ThreadPoolExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPoolExecutor::ParallelFor(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  if (threads_.empty() || n == 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  fn_ = &fn;
  next_ = 0;
  end_ = n;
  work_cv_.notify_all();
  // The caller works too, so a pool of k threads gives k + 1 lanes.
  while (next_ < end_) {
    int i = next_++;
    ++running_;
    lock.unlock();
    fn(i);
    lock.lock();
    --running_;
  }
  done_cv_.wait(lock, [this] { return next_ >= end_ && running_ == 0; });
  fn_ = nullptr;
}

void ThreadPoolExecutor::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return shutdown_ || (fn_ != nullptr && next_ < end_); });
    if (shutdown_) return;
    int i = next_++;
    ++running_;
    const std::function<void(int)>* fn = fn_;
    lock.unlock();
    (*fn)(i);
    lock.lock();
    --running_;
    if (next_ >= end_ && running_ == 0) done_cv_.notify_all();
  }
}

}  // namespace aloe
