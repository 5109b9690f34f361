// The inputs aloe-corpus reads: folders of text (.txt), of JSON lines (.jsonl, one record per
// line with the text in a named string field), or of token files that other tools wrote and
// that become data shards as they are (llm.c and nanoGPT .bin, common/token_shard.h).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace aloe {

enum class InputFormat { kAuto, kText, kJsonl, kLlmc, kUint16 };

// "auto", "txt", "jsonl", "llmc", "uint16" and back; kInvalidArgument naming the choices.
absl::StatusOr<InputFormat> ParseInputFormat(std::string_view name);
// Whether files of `format` are token files (kLlmc, kUint16) rather than text.
bool IsTokenFileFormat(InputFormat format);

struct InputFile {
  std::string file_name;  // e.g. "1861_abraham_lincoln_r.txt"
  std::string stem;       // the name without its extension: "1861_abraham_lincoln_r"
  std::string path;
  InputFormat format;  // never kAuto
};

// The regular files directly inside `dir` that `format` reads, sorted by name: .txt for kText,
// .jsonl for kJsonl, .bin for kLlmc and kUint16. kAuto takes .txt and .jsonl files, or, in a
// folder without either, .bin files as llm.c files. kNotFound when `dir` is missing or holds no
// such file; kInvalidArgument when kAuto finds text and .bin files side by side.
absl::StatusOr<std::vector<InputFile>> ListInputFiles(const std::string& dir, InputFormat format);

// The documents of the .jsonl file at `path`: the string `field` of each record, in order.
// Blank lines are skipped. kInvalidArgument naming the path and the byte offset when a line is
// not one JSON object, is truncated, or lacks `field` as a string.
absl::StatusOr<std::vector<std::string>> ReadJsonlDocuments(const std::string& path,
                                                            std::string_view field);
// ReadJsonlDocuments over a file's `contents` in memory; `path` only names the file in
// messages.
absl::StatusOr<std::vector<std::string>> ParseJsonlDocuments(std::string_view contents,
                                                             const std::string& path,
                                                             std::string_view field);

// The text of a .txt or .jsonl input: the file itself, or its documents joined by
// `separator`.
absl::StatusOr<std::string> ReadInputText(const InputFile& file, std::string_view jsonl_field,
                                          std::string_view separator);

// Whether a token file of stem `stem` holds held-out data: one of its '_', '-' or '.'
// separated parts is "val", "valid" or "validation" (llm.c's fineweb_val_000000, nanoGPT's
// val).
bool IsHeldoutTokenFile(std::string_view stem);

}  // namespace aloe
