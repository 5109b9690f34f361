#include "server/core/checkpoint_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/byte_io.h"
#include "common/durable_file.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace aloe::server {
namespace {

constexpr char kMagic[8] = {'A', 'L', 'O', 'E', 'C', 'K', 'P', 'T'};
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8 + 4;
constexpr char kPrefix[] = "checkpoint-";
constexpr char kSuffix[] = ".aloeckpt";

// Version encoded in a checkpoint file name, or -1.
int64_t VersionOf(const std::string& name) {
  if (!absl::StartsWith(name, kPrefix) || !absl::EndsWith(name, kSuffix)) return -1;
  const std::string digits =
      name.substr(sizeof(kPrefix) - 1, name.size() - (sizeof(kPrefix) - 1) - (sizeof(kSuffix) - 1));
  int64_t v = -1;
  return absl::SimpleAtoi(digits, &v) ? v : -1;
}

}  // namespace

std::vector<std::string> CheckpointStore::List() const {
  std::vector<std::pair<int64_t, std::string>> found;
  if (DIR* d = ::opendir(dir_.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      const int64_t v = VersionOf(name);
      if (v >= 0) found.emplace_back(v, dir_ + "/" + name);
    }
    ::closedir(d);
  }
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> paths;
  for (auto& [v, path] : found) paths.push_back(std::move(path));
  return paths;
}

absl::StatusOr<std::string> CheckpointStore::Write(const v1::ServerCheckpoint& checkpoint) {
  return WriteMessage(checkpoint.version(), checkpoint);
}

absl::StatusOr<std::string> CheckpointStore::Write(const v1::ShardCheckpoint& checkpoint) {
  return WriteMessage(checkpoint.version(), checkpoint);
}

absl::StatusOr<std::string> CheckpointStore::WriteMessage(
    uint64_t version, const google::protobuf::MessageLite& checkpoint) {
  // Every missing parent too: a shard process writes into <checkpoint.dir>/shard-<i>.
  if (absl::Status made = MakeDirectories(dir_); !made.ok()) {
    return absl::UnavailableError(absl::StrCat("checkpoint dir ", made.message()));
  }
  std::string payload;
  if (!checkpoint.SerializeToString(&payload)) {
    return absl::InternalError("checkpoint does not serialise");
  }
  std::string file(kMagic, sizeof(kMagic));
  AppendPod<uint32_t>(1, &file);
  AppendPod<uint32_t>(0, &file);
  AppendPod<uint64_t>(payload.size(), &file);
  AppendPod<uint32_t>(Crc32c(payload), &file);
  file += payload;

  const std::string path = absl::StrFormat("%s/%s%012d%s", dir_, kPrefix, version, kSuffix);
  ALOE_RETURN_IF_ERROR(WriteFileAtomically(path, file));
  const std::vector<std::string> all = List();
  for (size_t i = std::max<uint32_t>(1, keep_); i < all.size(); ++i) ::unlink(all[i].c_str());
  return path;
}

absl::Status CheckpointStore::ReadMessage(const std::string& path,
                                          google::protobuf::MessageLite* checkpoint) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string file = buffer.str();
  if (file.size() < kHeaderBytes) {
    return absl::DataLossError(
        absl::StrFormat("%s: truncated header (%d bytes)", path, file.size()));
  }
  if (std::memcmp(file.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": bad magic"));
  }
  std::string_view header(file.data() + sizeof(kMagic), kHeaderBytes - sizeof(kMagic));
  uint32_t format = 0, reserved = 0, crc = 0;
  uint64_t length = 0;
  ReadPod(&header, &format);
  ReadPod(&header, &reserved);
  ReadPod(&header, &length);
  ReadPod(&header, &crc);
  if (format != 1) return absl::DataLossError(absl::StrFormat("%s: format %d", path, format));
  if (file.size() - kHeaderBytes != length) {
    return absl::DataLossError(
        absl::StrFormat("%s: truncated: header says %d payload bytes, file has %d", path, length,
                        file.size() - kHeaderBytes));
  }
  const std::string_view payload(file.data() + kHeaderBytes, length);
  if (Crc32c(payload) != crc) return absl::DataLossError(absl::StrCat(path, ": checksum mismatch"));
  if (!checkpoint->ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::DataLossError(absl::StrCat(path, ": payload does not parse"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CheckpointStore::LoadLatestMessage(
    google::protobuf::MessageLite* checkpoint, std::vector<std::string>* skipped) const {
  const std::vector<std::string> paths = List();
  if (paths.empty()) return absl::NotFoundError(absl::StrCat("no checkpoints in ", dir_));
  for (const std::string& path : paths) {
    absl::Status s = ReadMessage(path, checkpoint);
    if (s.ok()) return path;
    ALOE_LOG_WARNING("checkpoint", "%s; trying the previous checkpoint", s.message());
    skipped->push_back(std::string(s.message()));
  }
  return absl::DataLossError(
      absl::StrFormat("all %d checkpoints in %s are corrupt", paths.size(), dir_));
}

std::vector<uint64_t> CheckpointStore::Versions() const {
  std::vector<uint64_t> versions;
  for (const std::string& path : List()) {
    versions.push_back(static_cast<uint64_t>(VersionOf(path.substr(path.rfind('/') + 1))));
  }
  return versions;
}

std::string CheckpointStore::PathOf(uint64_t version) const {
  return absl::StrFormat("%s/%s%012d%s", dir_, kPrefix, version, kSuffix);
}

}  // namespace aloe::server
