#include "common/buffer_pool.h"

#include <utility>

namespace aloe {

std::shared_ptr<FloatBufferPool> FloatBufferPool::Create(size_t max_idle_bytes) {
  return std::shared_ptr<FloatBufferPool>(new FloatBufferPool(max_idle_bytes));
}

std::vector<float> FloatBufferPool::Take(size_t n) {
  {
    absl::MutexLock lock(&mu_);
    auto it = idle_.find(n);
    if (it != idle_.end() && !it->second.empty()) {
      std::vector<float> buffer = std::move(it->second.back());
      it->second.pop_back();
      idle_bytes_ -= n * sizeof(float);
      ++reused_;
      return buffer;
    }
  }
  return std::vector<float>(n);  // outside the lock: the zero-fill is the slow part
}

void FloatBufferPool::Give(std::vector<float> buffer) {
  if (buffer.empty()) return;
  {
    absl::MutexLock lock(&mu_);
    const size_t bytes = buffer.size() * sizeof(float);
    if (idle_bytes_ + bytes <= max_idle_bytes_) {
      idle_bytes_ += bytes;
      idle_[buffer.size()].push_back(std::move(buffer));
      return;
    }
  }
  // Freed here, outside the lock.
}

std::shared_ptr<std::vector<float>> FloatBufferPool::MakeShared(size_t n) {
  std::weak_ptr<FloatBufferPool> pool = weak_from_this();
  return std::shared_ptr<std::vector<float>>(
      new std::vector<float>(Take(n)), [pool](std::vector<float>* buffer) {
        if (std::shared_ptr<FloatBufferPool> alive = pool.lock()) alive->Give(std::move(*buffer));
        delete buffer;
      });
}

size_t FloatBufferPool::idle() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [size, buffers] : idle_) n += buffers.size();
  return n;
}

size_t FloatBufferPool::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  return idle_bytes_;
}

size_t FloatBufferPool::reused() const {
  absl::MutexLock lock(&mu_);
  return reused_;
}

}  // namespace aloe
