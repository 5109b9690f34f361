// docs/configuration.md documents the whole config schema: every message reachable from
// ServerConfig has a section whose heading names it, with a table row for each of its fields,
// and every value of the enums those fields use has a row. A field added to proto/config.proto
// without its row fails here.
#include <gmock/gmock.h>
#include <google/protobuf/descriptor.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "proto/aloe.pb.h"

#ifndef ALOE_SOURCE_DIR
#error "ALOE_SOURCE_DIR must name the source tree (tests/CMakeLists.txt)"
#endif

namespace aloe {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::EnumDescriptor;
using google::protobuf::FieldDescriptor;
using ::testing::HasSubstr;
using ::testing::IsSupersetOf;

std::string ReadDoc() {
  std::ifstream in(std::string(ALOE_SOURCE_DIR) + "/docs/configuration.md");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Each heading's first `name` -> the text from that heading to the next one.
std::map<std::string, std::string> SectionsByName(const std::string& doc) {
  std::map<std::string, std::string> sections;
  std::istringstream lines(doc);
  std::string line;
  std::string* current = nullptr;
  while (std::getline(lines, line)) {
    if (line.rfind("#", 0) == 0) {
      current = nullptr;
      const size_t open = line.find('`');
      const size_t close = open == std::string::npos ? open : line.find('`', open + 1);
      if (close != std::string::npos) current = &sections[line.substr(open + 1, close - open - 1)];
      continue;
    }
    if (current != nullptr) current->append(line).append("\n");
  }
  return sections;
}

// The messages reachable from `root` through its fields (root included) and the enums they use.
void Walk(const Descriptor* message, std::vector<const Descriptor*>* messages,
          std::set<const EnumDescriptor*>* enums) {
  for (const Descriptor* seen : *messages) {
    if (seen == message) return;
  }
  messages->push_back(message);
  for (int i = 0; i < message->field_count(); ++i) {
    const FieldDescriptor* field = message->field(i);
    if (field->message_type() != nullptr) Walk(field->message_type(), messages, enums);
    if (field->enum_type() != nullptr) enums->insert(field->enum_type());
  }
}

TEST(ConfigurationDocTest, EveryFieldOfTheSchemaHasARowInItsMessagesSection) {
  const std::string doc = ReadDoc();
  ASSERT_FALSE(doc.empty()) << "cannot read " << ALOE_SOURCE_DIR << "/docs/configuration.md";
  const std::map<std::string, std::string> sections = SectionsByName(doc);
  std::vector<const Descriptor*> messages;
  std::set<const EnumDescriptor*> enums;
  Walk(v1::ServerConfig::descriptor(), &messages, &enums);
  for (const Descriptor* message : messages) {
    const auto section = sections.find(message->name());
    if (section == sections.end()) {
      ADD_FAILURE() << "docs/configuration.md has no section headed `" << message->name() << "`";
      continue;
    }
    for (int i = 0; i < message->field_count(); ++i) {
      const std::string& field = message->field(i)->name();
      EXPECT_THAT(section->second, HasSubstr("| `" + field + "` |"))
          << "docs/configuration.md: section `" << message->name() << "` has no row for "
          << message->full_name() << "." << field;
    }
  }
  for (const EnumDescriptor* e : enums) {
    for (int i = 0; i < e->value_count(); ++i) {
      EXPECT_THAT(doc, HasSubstr("| `" + e->value(i)->name() + "` |"))
          << "docs/configuration.md has no row for " << e->full_name() << " value "
          << e->value(i)->name();
    }
  }
}

// The walk itself reaches the nested messages and enums (a walk that stopped at ServerConfig
// would pass the test above without checking them).
TEST(ConfigurationDocTest, WalkReachesNestedMessagesAndEnums) {
  std::vector<const Descriptor*> messages;
  std::set<const EnumDescriptor*> enums;
  Walk(v1::ServerConfig::descriptor(), &messages, &enums);
  std::set<std::string> names;
  for (const Descriptor* m : messages) names.insert(m->name());
  EXPECT_THAT(names, IsSupersetOf({"ServerConfig", "TransformerConfig", "OuterOptimizerConfig",
                                   "TransportConfig", "LayerCodec", "SecurityConfig"}));
  std::set<std::string> enum_names;
  for (const EnumDescriptor* e : enums) enum_names.insert(e->name());
  EXPECT_THAT(enum_names, IsSupersetOf({"OuterOptimizerType", "ShardSampling", "Codec"}));
}

}  // namespace
}  // namespace aloe
