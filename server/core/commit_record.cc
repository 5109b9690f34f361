#include "server/core/commit_record.h"

#include <cstring>
#include <iterator>

#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace aloe::server {
namespace {

constexpr uint32_t kMagic = 0x52434C41;  // "ALCR" read as little-endian

template <typename T>
void Put(std::ofstream& out, T value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof(value));
}

// Reads a T at *pos of `data`; false when the data ends first.
template <typename T>
bool Get(const std::string& data, size_t* pos, T* value) {
  if (data.size() - *pos < sizeof(T)) return false;
  std::memcpy(value, data.data() + *pos, sizeof(T));
  *pos += sizeof(T);
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CommitRecorder>> CommitRecorder::Open(const std::string& path) {
  std::unique_ptr<CommitRecorder> recorder(new CommitRecorder(path));
  absl::MutexLock lock(&recorder->mu_);
  recorder->out_.open(path, std::ios::binary | std::ios::app);
  if (!recorder->out_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cannot open the commit record %s for appending", path));
  }
  return recorder;
}

void CommitRecorder::Record(const std::vector<uint32_t>& owned,
                            const std::vector<const PendingUpdate*>& updates) {
  absl::MutexLock lock(&mu_);
  if (!status_.ok()) return;
  for (const PendingUpdate* u : updates) {
    Put(out_, kMagic);
    Put(out_, u->worker_id);
    Put(out_, u->update_id);
    Put(out_, static_cast<uint32_t>(owned.size()));
    for (size_t j = 0; j < owned.size(); ++j) {
      const std::vector<float>& layer = u->layers[j];
      Put(out_, owned[j]);
      Put(out_, static_cast<uint64_t>(layer.size()));
      out_.write(reinterpret_cast<const char*>(layer.data()),
                 static_cast<std::streamsize>(layer.size() * sizeof(float)));
    }
  }
  if (!out_.flush()) {
    status_ = absl::DataLossError(absl::StrFormat("writing the commit record %s failed", path_));
    ALOE_LOG_ERROR("shard", "%s", status_.message());
  }
}

absl::Status CommitRecorder::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

absl::StatusOr<std::vector<RecordedUpdate>> ReadCommitRecords(const std::string& path, bool* cut) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrFormat("no commit record at %s", path));
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<RecordedUpdate> records;
  size_t pos = 0;
  if (cut != nullptr) *cut = false;
  while (pos < data.size()) {
    const size_t start = pos;
    uint32_t magic = 0, layers = 0;
    RecordedUpdate r;
    bool whole = Get(data, &pos, &magic);
    if (whole && magic != kMagic) {
      return absl::DataLossError(
          absl::StrFormat("commit record %s: no record starts at byte %d", path, start));
    }
    whole = whole && Get(data, &pos, &r.worker_id) && Get(data, &pos, &r.update_id) &&
            Get(data, &pos, &layers);
    for (uint32_t j = 0; whole && j < layers; ++j) {
      uint32_t id = 0;
      uint64_t count = 0;
      whole = Get(data, &pos, &id) && Get(data, &pos, &count) &&
              count <= (data.size() - pos) / sizeof(float);
      if (!whole) break;
      std::vector<float>& values = r.layers[id];
      values.resize(count);
      std::memcpy(values.data(), data.data() + pos, count * sizeof(float));
      pos += count * sizeof(float);
    }
    if (!whole) {
      if (cut != nullptr) *cut = true;
      break;
    }
    records.push_back(std::move(r));
  }
  return records;
}

}  // namespace aloe::server
