#include "glmtune/io/checkpoint.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>
// Header-only: no run-time dependency on libxxhash.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>  // renameat2
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"

namespace glmtune::io {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kIndexFix =
    "the index does not match the shards; re-download the checkpoint or regenerate its index";

std::string quote(std::string_view s) { return "\"" + std::string(s) + "\""; }

// A shard path from an index must stay inside the checkpoint directory.
bool is_safe_relative(const std::string& name) {
  if (name.empty()) return false;
  fs::path p(name);
  if (p.is_absolute()) return false;
  for (const auto& part : p)
    if (part == "..") return false;
  return true;
}

}  // namespace

uint64_t content_hash(std::span<const uint8_t> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string hash_hex(uint64_t hash) { return fmt::format("{:016x}", hash); }

std::string VerifyProblem::str() const {
  std::string s = file;
  if (!tensor.empty()) s += (s.empty() ? "" : ": ") + std::string("tensor ") + quote(tensor);
  return s + (s.empty() ? "" : ": ") + problem;
}

std::string VerifyReport::describe(size_t max, const std::string& indent) const {
  std::string out;
  for (size_t i = 0; i < problems.size() && i < max; ++i) out += indent + problems[i].str() + "\n";
  if (problems.size() > max)
    out += indent + fmt::format("... and {} more problems\n", problems.size() - max);
  return out;
}

void VerifyReport::merge(const VerifyReport& other, const std::string& prefix) {
  for (VerifyProblem p : other.problems) {
    p.file = prefix + p.file;
    problems.push_back(std::move(p));
  }
  tensors_verified += other.tensors_verified;
  bytes_verified += other.bytes_verified;
}

namespace {

constexpr const char* kChecksumsFormat = "glmtune-checksums";
constexpr int kChecksumsVersion = 1;

// The hash of every tensor of a finished shard, read back from the file.
std::map<std::string, uint64_t> hash_shard(const fs::path& file) {
  const SafetensorsFile sf = SafetensorsFile::open(file);
  std::map<std::string, uint64_t> out;
  for (const TensorInfo& t : sf.tensors()) {
    out.emplace(t.name, content_hash(sf.bytes(t.name)));
    sf.release(t.name);
  }
  return out;
}

// The checked part of verify_checkpoint: `dir` has a checksums file.
// Returns the names the checksums file lists.
std::set<std::string> verify_against_checksums(const fs::path& dir, VerifyReport& r) {
  std::set<std::string> listed;
  const std::string sums_name(kChecksumsFileName);
  nlohmann::json sums;
  try {
    sums = parse_json_strict(read_text_file(dir / kChecksumsFileName), sums_name, "");
  } catch (const Error& e) {
    r.problems.push_back({sums_name, "", "unreadable checksums file: " + e.problem()});
    return listed;
  }
  if (!sums.is_object() || sums.value("format", "") != kChecksumsFormat ||
      !sums.contains("files") || !sums["files"].is_object()) {
    r.problems.push_back({sums_name, "", "malformed checksums file"});
    return listed;
  }
  if (sums.value("format_version", 0) != kChecksumsVersion) {
    r.problems.push_back({sums_name, "",
                          fmt::format("checksums format {} is not the supported {}",
                                      sums.value("format_version", 0), kChecksumsVersion)});
    return listed;
  }
  for (const auto& [file, entry] : sums["files"].items()) {
    if (!is_safe_relative(file) || !entry.is_object() || !entry.contains("tensors") ||
        !entry["tensors"].is_object()) {
      r.problems.push_back({sums_name, "", "malformed entry for " + quote(file)});
      continue;
    }
    const nlohmann::json& tensors = entry["tensors"];
    for (const auto& [name, hash] : tensors.items()) listed.insert(name);
    const fs::path path = dir / file;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      r.problems.push_back(
          {file, "",
           fmt::format("missing: the shard is gone, with its {} tensors{}", tensors.size(),
                       tensors.empty() ? "" : " (" + quote(tensors.begin().key()) + ", ...)")});
      continue;
    }
    const uint64_t size = fs::file_size(path, ec);
    if (entry.contains("bytes") && entry["bytes"].is_number_unsigned() &&
        entry["bytes"].get<uint64_t>() != size) {
      r.problems.push_back(
          {file, "",
           fmt::format("{} bytes, but {} were written: {} (its {} tensors are not checked)", size,
                       entry["bytes"].get<uint64_t>(),
                       size < entry["bytes"].get<uint64_t>() ? "truncated" : "grown",
                       tensors.size())});
      continue;
    }
    std::optional<SafetensorsFile> sf;
    try {
      sf.emplace(SafetensorsFile::open(path));
    } catch (const Error& e) {
      r.problems.push_back({file, "", "unreadable shard: " + e.problem()});
      continue;
    }
    sf->mapping()->advise_sequential();
    for (const auto& [name, want] : tensors.items()) {
      const TensorInfo* t = sf->find(name);
      if (!t) {
        r.problems.push_back({file, name, "missing from the shard"});
        continue;
      }
      const uint64_t got = content_hash(sf->bytes(name));
      sf->release(name);
      if (!want.is_string() || want.get<std::string>() != hash_hex(got)) {
        r.problems.push_back(
            {file, name,
             fmt::format("checksum mismatch: the bytes changed since they were written (xxh3 {}, "
                         "recorded {})",
                         hash_hex(got), want.is_string() ? want.get<std::string>() : "?")});
        continue;
      }
      ++r.tensors_verified;
      r.bytes_verified += t->nbytes();
    }
    for (const TensorInfo& t : sf->tensors())
      if (!tensors.contains(t.name))
        r.problems.push_back({file, t.name, "not in the checksums file"});
  }
  return listed;
}

}  // namespace

VerifyReport verify_checkpoint(const fs::path& path) {
  VerifyReport r;
  std::error_code ec;
  const bool dir = fs::is_directory(path, ec);
  r.has_checksums = dir && fs::exists(path / kChecksumsFileName, ec);
  std::set<std::string> listed;
  if (r.has_checksums) listed = verify_against_checksums(path, r);
  // The structure: what the index says against what the shards hold (also for a checksummed
  // directory, whose index could have been damaged on its own).
  std::optional<CheckpointReader> reader;
  const std::string index_name =
      dir ? (fs::exists(path / kIndexFileName, ec) ? std::string(kIndexFileName)
                                                   : std::string(kSingleFileName))
          : path.filename().string();
  try {
    reader.emplace(CheckpointReader::open(path));
  } catch (const Error& e) {
    // A missing shard is already named by the checksums check.
    if (!r.has_checksums || r.problems.empty()) r.problems.push_back({index_name, "", e.problem()});
    return r;
  }
  if (!r.has_checksums || r.problems.empty()) {
    for (const std::string& file : reader->shard_files()) {
      try {
        reader->shard(file);
      } catch (const Error& e) {
        r.problems.push_back({file, "", "unreadable shard: " + e.problem()});
      }
    }
    if (r.problems.empty()) {
      try {
        reader->validate();
      } catch (const Error& e) {
        r.problems.push_back({index_name, "", e.problem()});
      }
    }
  }
  if (r.has_checksums)
    for (const std::string& name : reader->names())
      if (!listed.count(name))
        r.problems.push_back({reader->shard_of(name), name, "not in the checksums file"});
  return r;
}

std::string shard_file_name(size_t index, size_t count) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", index, count);
}

struct CheckpointReader::Impl {
  fs::path dir;
  bool sharded = false;
  std::string index_source;  // the index path, or the single file, for messages
  std::vector<std::string> names;
  std::map<std::string, std::string, std::less<>> weight_map;
  std::vector<std::string> shard_files;
  std::optional<uint64_t> total_size;
  mutable std::mutex mu;
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>, std::less<>> open;
};

CheckpointReader::CheckpointReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;
CheckpointReader::~CheckpointReader() = default;

CheckpointReader CheckpointReader::open(const fs::path& path) {
  auto impl = std::make_unique<Impl>();
  std::error_code ec;
  auto status = fs::status(path, ec);
  if (!fs::exists(status)) throw Error("checkpoint not found", path.string(), "check the path");

  if (fs::is_regular_file(status)) {
    // A lone .safetensors file is a one-shard checkpoint.
    impl->dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
    std::string file = path.filename().string();
    auto sf = std::make_unique<SafetensorsFile>(SafetensorsFile::open(path));
    for (const auto& t : sf->tensors()) impl->weight_map.emplace(t.name, file);
    impl->open.emplace(file, std::move(sf));
    impl->shard_files = {file};
    impl->index_source = path.string();
  } else if (!fs::is_directory(status)) {
    throw Error("is neither a checkpoint directory nor a .safetensors file", path.string());
  } else {
    impl->dir = path;
    const fs::path index_path = path / kIndexFileName;
    const fs::path single_path = path / kSingleFileName;
    if (fs::exists(index_path)) {
      impl->sharded = true;
      impl->index_source = index_path.string();
      const std::string& where = impl->index_source;
      const std::string fix(kIndexFix);
      nlohmann::json index;
      try {
        index = parse_json_strict(read_text_file(index_path), where, fix);
      } catch (const Error& e) {
        throw Error("malformed index: " + e.problem(), where, fix);
      }
      if (!index.is_object()) throw Error("malformed index: not a JSON object", where, fix);
      auto wm = index.find("weight_map");
      if (wm == index.end()) throw Error("malformed index: no \"weight_map\"", where, fix);
      if (!wm->is_object())
        throw Error("malformed index: \"weight_map\" is not an object", where, fix);
      if (wm->empty()) throw Error("malformed index: \"weight_map\" lists no tensors", where, fix);
      std::set<std::string> files;
      for (auto it = wm->begin(); it != wm->end(); ++it) {
        if (!it->is_string())
          throw Error(
              "malformed index: the entry for " + quote(it.key()) + " is not a shard file name",
              where, fix);
        std::string file = it->get<std::string>();
        if (!is_safe_relative(file))
          throw Error("malformed index: shard " + quote(file) + " of " + quote(it.key()) +
                          " is not a file inside the checkpoint directory",
                      where, fix);
        impl->weight_map.emplace(it.key(), file);
        files.insert(file);
      }
      if (auto meta = index.find("metadata"); meta != index.end()) {
        if (!meta->is_object() && !meta->is_null())
          throw Error("malformed index: \"metadata\" is not an object", where, fix);
        if (meta->is_object()) {
          auto ts = meta->find("total_size");
          if (ts != meta->end()) {
            if (!ts->is_number_unsigned() && !(ts->is_number_integer() && ts->get<int64_t>() >= 0))
              throw Error("malformed index: \"metadata.total_size\" is not a non-negative integer",
                          where, fix);
            impl->total_size = ts->get<uint64_t>();
          }
        }
      }
      for (const auto& file : files) {
        fs::path shard_path = path / file;
        std::error_code sec;
        auto st = fs::status(shard_path, sec);
        if (!fs::exists(st))
          throw Error(
              "the index names shard " + quote(file) + ", which does not exist", where,
              "download the missing shard, or regenerate the index for the shards you have");
        if (!fs::is_regular_file(st))
          throw Error("the index names shard " + quote(file) + ", which is not a regular file",
                      where, fix);
      }
      impl->shard_files.assign(files.begin(), files.end());
    } else if (fs::exists(single_path)) {
      std::string file(kSingleFileName);
      auto sf = std::make_unique<SafetensorsFile>(SafetensorsFile::open(single_path));
      for (const auto& t : sf->tensors()) impl->weight_map.emplace(t.name, file);
      impl->open.emplace(file, std::move(sf));
      impl->shard_files = {file};
      impl->index_source = single_path.string();
    } else {
      throw Error("no " + std::string(kIndexFileName) + " or " + std::string(kSingleFileName) +
                      " in this directory",
                  path.string(), "point at a Hugging Face checkpoint directory");
    }
  }
  impl->names.reserve(impl->weight_map.size());
  for (const auto& [name, file] : impl->weight_map) impl->names.push_back(name);
  return CheckpointReader(std::move(impl));
}

const fs::path& CheckpointReader::dir() const { return impl_->dir; }
bool CheckpointReader::sharded() const { return impl_->sharded; }
const std::vector<std::string>& CheckpointReader::names() const { return impl_->names; }
bool CheckpointReader::contains(std::string_view name) const {
  return impl_->weight_map.find(name) != impl_->weight_map.end();
}
const std::vector<std::string>& CheckpointReader::shard_files() const { return impl_->shard_files; }
std::optional<uint64_t> CheckpointReader::index_total_size() const { return impl_->total_size; }

const std::string& CheckpointReader::shard_of(std::string_view name) const {
  auto it = impl_->weight_map.find(name);
  if (it == impl_->weight_map.end())
    throw Error("no tensor named " + quote(name) + " in this checkpoint (it has " +
                    std::to_string(impl_->names.size()) + " tensors)",
                impl_->index_source, "check the tensor name (names are case-sensitive)");
  return it->second;
}

std::vector<std::string> CheckpointReader::names_in_shard(std::string_view file) const {
  std::vector<std::string> out;
  for (const auto& [name, f] : impl_->weight_map)
    if (f == file) out.push_back(name);
  return out;
}

const SafetensorsFile& CheckpointReader::shard(std::string_view file) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->open.find(file);
  if (it == impl_->open.end()) {
    if (!std::binary_search(impl_->shard_files.begin(), impl_->shard_files.end(), file))
      throw Error("no shard " + quote(file) + " in this checkpoint", impl_->index_source);
    auto sf = std::make_unique<SafetensorsFile>(SafetensorsFile::open(impl_->dir / file));
    it = impl_->open.emplace(std::string(file), std::move(sf)).first;
  }
  return *it->second;
}

void CheckpointReader::close_shard(std::string_view file) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->open.find(file);
  if (it != impl_->open.end()) impl_->open.erase(it);
}

const TensorInfo& CheckpointReader::info(std::string_view name) const {
  const std::string& file = shard_of(name);
  const TensorInfo* t = shard(file).find(name);
  if (!t)
    throw Error("the index maps " + quote(name) + " to " + quote(file) + ", but " + quote(file) +
                    " has no such tensor",
                impl_->index_source, std::string(kIndexFix));
  return *t;
}

std::span<const uint8_t> CheckpointReader::bytes(std::string_view name) const {
  info(name);
  return shard(shard_of(name)).bytes(name);
}

Tensor CheckpointReader::tensor(std::string_view name) const {
  info(name);
  return shard(shard_of(name)).tensor(name);
}

void CheckpointReader::release(std::string_view name, uint64_t offset, uint64_t length) const {
  info(name);
  shard(shard_of(name)).release(name, offset, length);
}

void CheckpointReader::validate() const {
  const std::string& where = impl_->index_source;
  const std::string fix(kIndexFix);
  std::map<std::string_view, std::string_view> found;  // tensor -> first shard holding it
  uint64_t total = 0;
  for (const auto& file : impl_->shard_files) {
    const SafetensorsFile& sf = shard(file);
    for (const auto& t : sf.tensors()) {
      auto [it, inserted] = found.emplace(t.name, file);
      if (!inserted)
        throw Error("tensor " + quote(t.name) + " is present in two shards: " + quote(it->second) +
                        " and " + quote(file),
                    where, fix);
      total += t.nbytes();
    }
  }
  for (const auto& [name, file] : found) {
    auto it = impl_->weight_map.find(name);
    if (it == impl_->weight_map.end())
      throw Error(
          "shard " + quote(file) + " holds tensor " + quote(name) + " that the index does not list",
          where, fix);
    if (it->second != file)
      throw Error("the index maps " + quote(name) + " to " + quote(it->second) + ", but it is in " +
                      quote(file),
                  where, fix);
  }
  for (const auto& [name, file] : impl_->weight_map)
    if (found.find(name) == found.end())
      throw Error("the index maps " + quote(name) + " to " + quote(file) + ", but " + quote(file) +
                      " has no such tensor",
                  where, fix);
  if (impl_->total_size && *impl_->total_size != total)
    spdlog::warn("{}: metadata.total_size is {} but the shards hold {} bytes of tensors", where,
                 *impl_->total_size, total);
}

CheckpointWriter::CheckpointWriter(fs::path dir, CheckpointWriterOptions options)
    : options_(std::move(options)) {
  dir = dir.lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();
  if (dir.empty()) throw Error("empty output directory name", "checkpoint writer");
  dir_ = dir;
  if (options_.max_shard_bytes == 0) throw Error("max shard size must be positive", dir_.string());
  std::error_code ec;
  if (fs::exists(dir_, ec) && !fs::is_directory(dir_, ec))
    throw Error("exists and is not a directory", dir_.string(),
                "choose another output path or remove the file");
  fs::path parent = dir_.parent_path().empty() ? fs::path(".") : dir_.parent_path();
  create_output_directory(parent, "the parent of the checkpoint directory " + dir_.string());
  // A sibling of the final directory, so that the final rename stays on one filesystem; hidden and
  // tagged with the pid so that it is never mistaken for a checkpoint.
  tmp_ = temporary_path(parent / ("." + dir_.filename().string()));
  // What a killed writer of the same directory left (a whole model's worth, possibly).
  remove_stale_temporary_files(parent, {"." + dir_.filename().string()});
  fs::remove_all(tmp_, ec);
  fs::create_directory(tmp_, ec);
  if (ec)
    throw Error("cannot create temporary directory (" + ec.message() + ")", tmp_.string(),
                "check that the output location is writable");
}

CheckpointWriter::~CheckpointWriter() {
  if (finished_) return;
  planned_.reset();
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

void CheckpointWriter::check_new_name(const std::string& name) {
  if (finished_) throw Error("checkpoint already finished", dir_.string());
  if (name_to_shard_.count(name))
    throw Error("tensor " + quote(name) + " is written twice", dir_.string(),
                "every tensor of a checkpoint needs a distinct name");
}

fs::path CheckpointWriter::next_shard_path() {
  return tmp_ / fmt::format("shard-{:05d}.safetensors.partial", shards_.size() + 1);
}

void CheckpointWriter::add(std::string name, Tensor tensor) {
  if (planned_)
    throw Error("add() while a planned shard is open; call end_shard() first", dir_.string());
  check_new_name(name);
  GLMTUNE_ASSERT(tensor.defined(), "tensor {} is undefined", name);
  const uint64_t size = tensor.nbytes();
  if (!pending_.empty() && pending_bytes_ + size > options_.max_shard_bytes) flush_pending();
  name_to_shard_.emplace(name, shards_.size());
  pending_.emplace_back(std::move(name), std::move(tensor));
  pending_bytes_ += size;
}

void CheckpointWriter::flush_pending() {
  if (pending_.empty()) return;
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : pending_) specs.push_back({name, t.dtype(), t.shape()});
  Shard shard{next_shard_path(), {}, {}};
  SafetensorsWriter writer(shard.temp_name, std::move(specs), options_.shard_metadata);
  for (auto& [name, t] : pending_) {
    writer.write(name, t);
    total_bytes_ += t.nbytes();
    total_parameters_ += uint64_t(t.numel());
    shard.names.push_back(name);
    t = Tensor();  // let go of the memory as soon as it is on disk
  }
  writer.finish();
  close_shard(std::move(shard));
  pending_.clear();
  pending_bytes_ = 0;
}

void CheckpointWriter::begin_shard(std::vector<TensorSpec> specs) {
  if (planned_) throw Error("begin_shard() while another shard is open", dir_.string());
  flush_pending();
  for (const auto& s : specs) check_new_name(s.name);
  planned_ = std::make_unique<SafetensorsWriter>(next_shard_path(), specs, options_.shard_metadata);
  for (const auto& s : specs) name_to_shard_.emplace(s.name, shards_.size());
}

void CheckpointWriter::write(std::string_view name, const Tensor& tensor) {
  if (!planned_) throw Error("write() without begin_shard()", dir_.string());
  planned_->write(name, tensor);
}

void CheckpointWriter::write_bytes(std::string_view name, std::span<const uint8_t> bytes) {
  if (!planned_) throw Error("write_bytes() without begin_shard()", dir_.string());
  planned_->write_bytes(name, bytes);
}

void CheckpointWriter::write_part(std::string_view name, uint64_t offset,
                                  std::span<const uint8_t> bytes) {
  if (!planned_) throw Error("write_part() without begin_shard()", dir_.string());
  planned_->write_part(name, offset, bytes);
}

void CheckpointWriter::end_shard() {
  if (!planned_) throw Error("end_shard() without begin_shard()", dir_.string());
  planned_->finish();
  Shard shard{planned_->path(), {}, {}};
  for (const auto& t : planned_->layout().tensors) {
    shard.names.push_back(t.name);
    total_bytes_ += t.nbytes();
    total_parameters_ += uint64_t(t.numel());
  }
  planned_.reset();
  close_shard(std::move(shard));
}

void CheckpointWriter::close_shard(Shard shard) {
  // Hashed from the file as written, so that the checksum vouches for the bytes a reader gets.
  shard.hashes = hash_shard(shard.temp_name);
  shards_.push_back(std::move(shard));
}

void CheckpointWriter::plan_in_order(std::vector<TensorSpec> specs) {
  if (planned_ || !pending_.empty() || !streamed_shards_.empty())
    throw Error("plan_in_order() after other tensors were added", dir_.string(),
                "declare the whole sequence before writing any tensor");
  // The grouping of add(): a shard is closed when the next tensor would take it past the limit.
  uint64_t bytes = 0;
  for (TensorSpec& spec : specs) {
    check_new_name(spec.name);
    if (streamed_shard_of_.count(spec.name))
      throw Error("tensor " + quote(spec.name) + " is planned twice", dir_.string(),
                  "every tensor of a checkpoint needs a distinct name");
    const uint64_t size = spec.nbytes();
    if (streamed_shards_.empty() ||
        (!streamed_shards_.back().empty() && bytes + size > options_.max_shard_bytes)) {
      streamed_shards_.emplace_back();
      bytes = 0;
    }
    streamed_shard_of_.emplace(spec.name, streamed_shards_.size() - 1);
    bytes += size;
    streamed_shards_.back().push_back(std::move(spec));
  }
}

void CheckpointWriter::put(std::string_view name, const Tensor& tensor) {
  const auto it = streamed_shard_of_.find(name);
  if (it == streamed_shard_of_.end())
    throw Error("tensor " + quote(name) + " was not declared by plan_in_order()", dir_.string());
  // Shards open in order; a tensor of an earlier shard after a later one opened is out of order.
  if (planned_ && it->second + 1 != streamed_next_) {
    if (it->second + 1 < streamed_next_)
      throw Error("tensor " + quote(name) + " arrives after its shard was closed", dir_.string(),
                  "give put() the tensors in the order plan_in_order() declared them");
    end_shard();
  }
  while (!planned_) {
    begin_shard(streamed_shards_[streamed_next_++]);
    // A shard none of whose tensors came: closing it names them.
    if (streamed_next_ - 1 != it->second) end_shard();
  }
  write(name, tensor);
}

void CheckpointWriter::check_file_name(const std::string& relative_name) const {
  if (finished_) throw Error("checkpoint already finished", dir_.string());
  if (!is_safe_relative(relative_name) || relative_name.find('/') != std::string::npos)
    throw Error("extra file name " + quote(relative_name) + " must be a plain file name",
                dir_.string());
  if (relative_name == kIndexFileName || relative_name == kChecksumsFileName ||
      relative_name.ends_with(".safetensors") || relative_name.ends_with(".partial"))
    throw Error("extra file " + quote(relative_name) + " would clash with the weights",
                dir_.string());
  if (std::find(extra_files_.begin(), extra_files_.end(), relative_name) != extra_files_.end())
    throw Error("extra file " + quote(relative_name) + " is added twice", dir_.string());
}

void CheckpointWriter::add_file(const std::string& relative_name, std::string_view content) {
  check_file_name(relative_name);
  OutputFile out(tmp_ / relative_name);
  out.write(content);
  out.sync();
  out.close();
  extra_files_.push_back(relative_name);
}

void CheckpointWriter::copy_file(const fs::path& source, const std::string& relative_name) {
  check_file_name(relative_name);
  auto in = MappedFile::open(source);
  OutputFile out(tmp_ / relative_name);
  if (in->size()) out.write(in->data(), in->size());
  out.sync();
  out.close();
  extra_files_.push_back(relative_name);
}

void CheckpointWriter::finish() {
  if (finished_) return;
  if (!streamed_shards_.empty()) {
    if (planned_) end_shard();
    if (streamed_next_ != streamed_shards_.size()) {
      std::string names;
      for (size_t i = streamed_next_; i < streamed_shards_.size(); ++i)
        for (const TensorSpec& spec : streamed_shards_[i])
          names += (names.empty() ? "" : ", ") + quote(spec.name);
      throw Error("planned tensors were never written: " + names, dir_.string(),
                  "put() every tensor declared by plan_in_order()");
    }
  }
  if (planned_)
    throw Error("finish() while a planned shard is open; call end_shard()", dir_.string());
  flush_pending();
  if (shards_.empty()) throw Error("no tensors were written", dir_.string());

  const size_t count = shards_.size();
  nlohmann::json weight_map = nlohmann::json::object();
  nlohmann::json sums = nlohmann::json::object();
  for (size_t i = 0; i < count; ++i) {
    const std::string final_name = shard_file_name(i + 1, count);
    std::error_code ec;
    const uint64_t bytes = fs::file_size(shards_[i].temp_name, ec);
    if (ec) throw Error("cannot stat shard (" + ec.message() + ")", shards_[i].temp_name.string());
    fs::rename(shards_[i].temp_name, tmp_ / final_name, ec);
    if (ec)
      throw Error("cannot rename shard (" + ec.message() + ")", shards_[i].temp_name.string());
    for (const auto& name : shards_[i].names) weight_map[name] = final_name;
    nlohmann::json tensors = nlohmann::json::object();
    for (const auto& [name, hash] : shards_[i].hashes) tensors[name] = hash_hex(hash);
    sums[final_name] = {{"bytes", bytes}, {"tensors", std::move(tensors)}};
  }
  {
    const nlohmann::json checksums = {{"format", kChecksumsFormat},
                                      {"format_version", kChecksumsVersion},
                                      {"algorithm", "xxh3-64"},
                                      {"files", std::move(sums)}};
    OutputFile out(tmp_ / kChecksumsFileName);
    out.write(checksums.dump(1) + "\n");
    out.sync();
    out.close();
  }
  // As transformers writes it: json.dumps(index, indent=2, sort_keys=True) + "\n".
  nlohmann::json index = {
      {"metadata", {{"total_parameters", total_parameters_}, {"total_size", total_bytes_}}},
      {"weight_map", std::move(weight_map)}};
  {
    OutputFile out(tmp_ / kIndexFileName);
    out.write(index.dump(2, ' ', true) + "\n");
    out.sync();
    out.close();
  }
  sync_directory(tmp_);

  // Swap the finished directory into place. Where the filesystem supports it, RENAME_EXCHANGE
  // swaps old and new in one step, so that `dir` always holds a complete checkpoint; otherwise
  // the old directory is moved aside first (a crash in between leaves it, complete, beside `dir`).
  std::error_code ec;
  const fs::path parent = dir_.parent_path().empty() ? fs::path(".") : dir_.parent_path();
  if (!fs::exists(dir_, ec)) {
    fs::rename(tmp_, dir_, ec);
    if (ec)
      throw Error("cannot move the finished checkpoint into place (" + ec.message() + ")",
                  dir_.string());
  } else if (::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dir_.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp_, ec);  // now the previous content
  } else {
    int err = errno;
    if (err != EINVAL && err != ENOSYS && err != EOPNOTSUPP)
      throw Error("cannot swap the finished checkpoint into place (" +
                      std::system_category().message(err) + ")",
                  dir_.string());
    const fs::path old =
        parent / ("." + dir_.filename().string() + ".old." + std::to_string(::getpid()));
    fs::remove_all(old, ec);
    fs::rename(dir_, old, ec);
    if (ec)
      throw Error("cannot move the previous checkpoint aside (" + ec.message() + ")",
                  dir_.string());
    fs::rename(tmp_, dir_, ec);
    if (ec)
      throw Error("cannot move the finished checkpoint into place (" + ec.message() +
                      "); the previous content is in " + old.string(),
                  dir_.string());
    fs::remove_all(old, ec);
  }
  sync_directory(parent);
  finished_ = true;
}

void copy_tokenizer_files(const std::filesystem::path& from, const std::filesystem::path& to) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                           "processor_config.json"}) {
    const std::filesystem::path src = from / name;
    if (std::filesystem::exists(src))
      std::filesystem::copy_file(src, to / name, std::filesystem::copy_options::overwrite_existing);
  }
}

}  // namespace glmtune::io
