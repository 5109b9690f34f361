// Recycles large float buffers whose contents are about to be overwritten in full.
//
// A server step writes whole layers into fresh buffers twice per update: the assembler decodes a
// push into a staging buffer, and the outer step writes new parameters into a fresh buffer while
// a pull or a retained version still reads the old one (copy on write). A std::vector<float> of
// n elements is zero-filled when it is created, a pass over memory that the writer then
// overwrites: at ingest rates that zero-fill costs as much as the decode itself. The pool hands
// back buffers freed earlier (contents unspecified) so only the writer touches the memory.
//
// Bounded: idle buffers hold at most `max_idle_bytes`; a buffer given back beyond that is freed.
// (The server's malloc keeps freed large buffers in its heap anyway, see KeepLargeBuffersInHeap,
// so a pool no larger than what it recycles adds no resident memory.)
//
// Thread-safe. Buffers from MakeShared may outlive the pool: their deleter then frees them.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace aloe {

class FloatBufferPool : public std::enable_shared_from_this<FloatBufferPool> {
 public:
  // Use Create: MakeShared's deleters hold a weak reference to the pool.
  static std::shared_ptr<FloatBufferPool> Create(size_t max_idle_bytes);

  // A buffer of exactly n elements: an idle one (contents unspecified) or a new zero-filled one.
  std::vector<float> Take(size_t n);
  // Returns a buffer for reuse (freed instead when it would take the idle bytes over the bound).
  // Empty buffers are ignored.
  void Give(std::vector<float> buffer);
  // Take(n) owned by a shared_ptr whose deleter gives the buffer back to this pool (or frees it
  // once the pool is gone).
  std::shared_ptr<std::vector<float>> MakeShared(size_t n);

  // Idle buffers held, over all sizes, and their bytes.
  size_t idle() const;
  size_t idle_bytes() const;
  // Buffers handed out by Take/MakeShared that were recycled rather than newly allocated.
  size_t reused() const;

 private:
  explicit FloatBufferPool(size_t max_idle_bytes) : max_idle_bytes_(max_idle_bytes) {}

  const size_t max_idle_bytes_;
  mutable absl::Mutex mu_;
  std::map<size_t, std::vector<std::vector<float>>> idle_ ABSL_GUARDED_BY(mu_);
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t reused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace aloe
