#pragma once
// Checkpoints compared byte for byte: every file under a directory, and the check that two
// directories hold the same files with the same bytes.

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "temp_dir.h"

namespace glmtune::test {

// Every regular file under `root`: relative name (with '/') -> bytes.
inline std::map<std::string, std::string> files_under(const std::filesystem::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root))
    if (entry.is_regular_file())
      out[std::filesystem::relative(entry.path(), root).generic_string()] = read_text(entry.path());
  return out;
}

// `got` holds exactly the files of `want` (which must not be empty), each with the same bytes.
inline void expect_same_files(const std::filesystem::path& got, const std::filesystem::path& want) {
  const auto a = files_under(got), b = files_under(want);
  ASSERT_FALSE(b.empty()) << want;
  ASSERT_EQ(a.size(), b.size()) << got << " against " << want;
  for (const auto& [name, bytes] : b) {
    ASSERT_TRUE(a.count(name)) << name << " missing from " << got;
    EXPECT_TRUE(a.at(name) == bytes) << name << " differs in " << got;
  }
}

}  // namespace glmtune::test
