// Server/job configuration: an aloe.v1.ServerConfig read from a text-format protobuf file
// (.textproto, .pbtxt, .txtpb, .conf) or JSON (.json), completed with documented defaults and
// validated. Errors name the field ("outer_optimizer.lr must be > 0, got -1").
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "proto/aloe.pb.h"

namespace aloe {

// Parses text (format chosen by the file extension of `path_for_format`) without validating.
// kInvalidArgument with line/column for syntax errors and unknown fields.
absl::StatusOr<v1::ServerConfig> ParseServerConfig(const std::string& text,
                                                   const std::string& path_for_format);

// Reads, parses, fills defaults, validates. kNotFound when the file is missing.
absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path);

// Fills every zero/empty field that has a documented default (see proto/aloe.proto).
void FillServerDefaults(v1::ServerConfig* config);

// Checks every field after defaults were filled. kInvalidArgument naming the first bad field.
absl::Status ValidateServerConfig(const v1::ServerConfig& config);

}  // namespace aloe
