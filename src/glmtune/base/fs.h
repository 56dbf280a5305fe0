#pragma once
// Small file-system helpers with errors that name the file.

#include <string>

namespace glmtune {

// Reads a whole (small) file; `what` names it in errors ("config", "recipe", ...).
std::string read_text_file(const std::string& path, const std::string& what);
// Writes `content` to `path` atomically: a temporary file in the same directory, fsync, rename,
// fsync of the directory. A crash leaves either the old file or the new one, never a torn file.
void write_file_atomic(const std::string& path, const std::string& content);
// fsync of a directory, so that renames inside it are durable.
void fsync_directory(const std::string& dir);

}  // namespace glmtune
