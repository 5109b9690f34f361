#include "common/corpus_inputs.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/durable_file.h"
#include "common/json_reader.h"
#include "common/status_macros.h"

namespace aloe {
namespace {

namespace fs = std::filesystem;

struct FormatName {
  InputFormat format;
  const char* name;
};
constexpr FormatName kFormatNames[] = {{InputFormat::kAuto, "auto"},
                                       {InputFormat::kText, "txt"},
                                       {InputFormat::kJsonl, "jsonl"},
                                       {InputFormat::kLlmc, "llmc"},
                                       {InputFormat::kUint16, "uint16"}};

// The format of a file named `name` under `wanted`, or kAuto when `wanted` does not read it.
InputFormat FormatOf(absl::string_view name, InputFormat wanted) {
  const bool txt = absl::EndsWith(name, ".txt") && name.size() > 4;
  const bool jsonl = absl::EndsWith(name, ".jsonl") && name.size() > 6;
  const bool bin = absl::EndsWith(name, ".bin") && name.size() > 4;
  switch (wanted) {
    case InputFormat::kAuto:
      return txt ? InputFormat::kText : jsonl ? InputFormat::kJsonl : InputFormat::kAuto;
    case InputFormat::kText:
      return txt ? wanted : InputFormat::kAuto;
    case InputFormat::kJsonl:
      return jsonl ? wanted : InputFormat::kAuto;
    case InputFormat::kLlmc:
    case InputFormat::kUint16:
      return bin ? wanted : InputFormat::kAuto;
  }
  return InputFormat::kAuto;
}

}  // namespace

absl::StatusOr<InputFormat> ParseInputFormat(std::string_view name) {
  for (const FormatName& f : kFormatNames) {
    if (name == f.name) return f.format;
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("--input_format %s: expected auto, txt, jsonl, llmc or uint16", name));
}

bool IsTokenFileFormat(InputFormat format) {
  return format == InputFormat::kLlmc || format == InputFormat::kUint16;
}

absl::StatusOr<std::vector<InputFile>> ListInputFiles(const std::string& dir, InputFormat format) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrFormat("--input_dir %s: no such directory", dir));
  }
  std::vector<InputFile> files;
  bool any_bin = false;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code type_ec;
    if (!it->is_regular_file(type_ec)) continue;
    any_bin |= absl::EndsWith(name, ".bin");
    const InputFormat f = FormatOf(name, format);
    if (f == InputFormat::kAuto) continue;
    files.push_back({name, it->path().stem().string(), it->path().string(), f});
  }
  if (ec) {
    return absl::InternalError(
        absl::StrFormat("--input_dir %s: cannot list: %s", dir, ec.message()));
  }
  if (format == InputFormat::kAuto && any_bin) {
    if (!files.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--input_dir %s holds both text (.txt, .jsonl) and token (.bin) files; pass "
          "--input_format to pick one kind",
          dir));
    }
    return ListInputFiles(dir, InputFormat::kLlmc);
  }
  if (files.empty()) {
    return absl::NotFoundError(absl::StrFormat("--input_dir %s: no %s files", dir,
                                               format == InputFormat::kAuto ? ".txt, .jsonl or .bin"
                                               : format == InputFormat::kText  ? ".txt"
                                               : format == InputFormat::kJsonl ? ".jsonl"
                                                                               : ".bin"));
  }
  std::sort(files.begin(), files.end(),
            [](const InputFile& a, const InputFile& b) { return a.file_name < b.file_name; });
  return files;
}

absl::StatusOr<std::vector<std::string>> ReadJsonlDocuments(const std::string& path,
                                                            std::string_view field) {
  ALOE_ASSIGN_OR_RETURN(const std::string contents, ReadWholeFile(path));
  return ParseJsonlDocuments(contents, path, field);
}

absl::StatusOr<std::vector<std::string>> ParseJsonlDocuments(std::string_view contents,
                                                             const std::string& path,
                                                             std::string_view field) {
  std::vector<std::string> documents;
  size_t start = 0;
  while (start < contents.size()) {
    size_t end = contents.find('\n', start);
    if (end == std::string::npos) end = contents.size();
    const std::string_view line(contents.data() + start, end - start);
    JsonReader reader(path, line, start);
    reader.SkipSpace();
    if (!reader.AtEnd()) {
      bool found = false;
      std::string text;
      ALOE_RETURN_IF_ERROR(reader.ReadObject([&](const std::string& key) {
        if (key != field) return reader.SkipValue();
        if (reader.Peek() != '"') {
          return reader.Error(absl::StrFormat("field \"%s\" is not a string", field));
        }
        found = true;
        text.clear();
        return reader.ReadString(&text);
      }));
      reader.SkipSpace();
      if (!reader.AtEnd()) return reader.Error("trailing data after the record");
      if (!found) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: byte offset %d: the record has no \"%s\" field (--jsonl_field)",
                            path, start, field));
      }
      documents.push_back(std::move(text));
    }
    start = end + 1;
  }
  return documents;
}

absl::StatusOr<std::string> ReadInputText(const InputFile& file, std::string_view jsonl_field,
                                          std::string_view separator) {
  if (file.format != InputFormat::kJsonl) return ReadWholeFile(file.path);
  ALOE_ASSIGN_OR_RETURN(const std::vector<std::string> documents,
                        ReadJsonlDocuments(file.path, jsonl_field));
  return absl::StrJoin(documents, absl::string_view(separator.data(), separator.size()));
}

bool IsHeldoutTokenFile(std::string_view stem) {
  for (absl::string_view part :
       absl::StrSplit(absl::string_view(stem.data(), stem.size()), absl::ByAnyChar("_-."))) {
    if (part == "val" || part == "valid" || part == "validation") return true;
  }
  return false;
}

}  // namespace aloe
