#pragma once
// The bundled examples/tiny-vl conversations as a data file for tests that must also run where
// glmtune is built without FFmpeg (the GPU test package is): the file itself where this build
// decodes videos, else a copy in `dir` without the conversations that hold a video.

#include <filesystem>
#include <fstream>
#include <string>

#include "glmtune/data/media/video.h"

namespace glmtune::test {

inline std::filesystem::path tiny_vl_chat(const std::filesystem::path& source_dir,
                                          const std::filesystem::path& dir) {
  const std::filesystem::path all = source_dir / "examples/tiny-vl/chat.jsonl";
  if (data::media::video_decoding_available()) return all;
  const std::filesystem::path images = dir / "tiny-vl-images.jsonl";
  std::ifstream in(all);
  std::ofstream out(images);
  for (std::string line; std::getline(in, line);)
    if (line.find("\"video\"") == std::string::npos) out << line << '\n';
  return images;
}

}  // namespace glmtune::test
