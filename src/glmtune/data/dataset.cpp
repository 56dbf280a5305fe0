#include "glmtune/data/dataset.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <new>
#include <stdexcept>
#include <utility>

#include "glmtune/base/error.h"
#include "glmtune/data/tokenizer.h"

namespace glmtune::data {
namespace {

// Bad-line messages kept in DatasetStats::first_errors and logged as warnings; later ones are
// only counted, so a file full of broken lines does not flood the log.
constexpr size_t kMaxReportedErrors = 10;

struct LineInput {
  int32_t file;
  int64_t line;
  uint64_t offset;
  int64_t sample_index;
  std::string text;
};

struct LineOutcome {
  enum class Kind { kSample, kBad, kOverlong, kUntrained };
  Kind kind = Kind::kSample;
  BadLineReason reason = BadLineReason::kNotJson;
  std::string message;  // kBad: the problem, without the file:line prefix
  std::string fix;      // kBad: how to repair the line, when there is something specific to say
  Sample sample;        // kSample
};

bool is_blank(std::string_view s) {
  return s.find_first_not_of(" \t\r\n") == std::string_view::npos;
}

int64_t count_targets(const std::vector<int32_t>& labels) {
  int64_t n = 0;
  // Position 0 is never a target: nothing before it in the sample predicts it.
  for (size_t i = 1; i < labels.size(); ++i) n += labels[i] != kIgnoreIndex;
  return n;
}

// A line turned into what must be encoded: template segments, or plain text plus an eos.
struct Prepared {
  bool is_text = false;
  std::vector<ChatSegment> segments;  // chat
  std::string text;                   // plain text
};

// Parses and renders one line; returns false and fills `bad` for a line that cannot be used.
bool prepare_line(const DatasetConfig& cfg, const LineInput& in, Prepared& out, LineOutcome& bad) {
  auto reject = [&](BadLineReason reason, std::string message) {
    bad.kind = LineOutcome::Kind::kBad;
    bad.reason = reason;
    bad.message = std::move(message);
    return false;
  };
  OrderedJson doc;
  try {
    doc = OrderedJson::parse(in.text);
  } catch (const nlohmann::json::exception& e) {
    // Not only parse errors: a number beyond a double's range is out_of_range.406.
    if (e.id == 406)
      bad.fix = "write the number within a double's range (about ±1.8e308), or as a string";
    return reject(BadLineReason::kNotJson, "not valid JSON: " + json_error_text(e));
  }
  if (!doc.is_object())
    return reject(BadLineReason::kNotObject,
                  fmt::format("expected a JSON object, got {}", doc.type_name()));

  const bool has_messages = doc.contains("messages");
  const bool has_text = doc.contains("text");
  bool chat;
  switch (cfg.format) {
    case SampleFormat::kChat:
      if (!has_messages)
        return reject(BadLineReason::kMissingField, "no \"messages\" (format is chat)");
      chat = true;
      break;
    case SampleFormat::kText:
      if (!has_text) return reject(BadLineReason::kMissingField, "no \"text\" (format is text)");
      chat = false;
      break;
    default:
      if (has_messages && has_text)
        return reject(BadLineReason::kWrongType,
                      "has both \"messages\" and \"text\"; a line is one conversation or one text");
      if (!has_messages && !has_text)
        return reject(BadLineReason::kMissingField, "has neither \"messages\" nor \"text\"");
      chat = has_messages;
  }

  auto literal_media = [&](const char* key) {
    if (!doc.contains(key)) return false;
    const auto found = find_literal_media_token(doc[key], key);
    if (!found) return false;
    bad.fix = kLiteralMediaTokenFix;
    reject(BadLineReason::kMedia, literal_media_token_problem(*found));
    return true;
  };
  if (!chat) {
    const OrderedJson& text = doc["text"];
    if (!text.is_string())
      return reject(BadLineReason::kWrongType,
                    fmt::format("\"text\" must be a string, got {}", text.type_name()));
    if (literal_media("text")) return false;
    out.is_text = true;
    out.text = text.get<std::string>();
    return true;
  }

  const OrderedJson& messages = doc["messages"];
  if (!messages.is_array())
    return reject(BadLineReason::kWrongType,
                  fmt::format("\"messages\" must be a list, got {}", messages.type_name()));
  static const OrderedJson kNoTools;
  const OrderedJson& tools = doc.contains("tools") ? doc["tools"] : kNoTools;
  if (!tools.is_null() && !tools.is_array())
    return reject(BadLineReason::kWrongType,
                  fmt::format("\"tools\" must be a list, got {}", tools.type_name()));

  ChatTemplateOptions opts;
  opts.reasoning_effort = cfg.reasoning_effort;
  opts.clear_thinking = cfg.clear_thinking;
  if (doc.contains("reasoning_effort")) {
    const OrderedJson& v = doc["reasoning_effort"];
    if (!v.is_string() && !v.is_null())
      return reject(BadLineReason::kWrongType, "\"reasoning_effort\" must be a string");
    if (v.is_string()) opts.reasoning_effort = v.get<std::string>();
  }
  if (doc.contains("clear_thinking")) {
    const OrderedJson& v = doc["clear_thinking"];
    if (!v.is_boolean())
      return reject(BadLineReason::kWrongType, "\"clear_thinking\" must be true or false");
    opts.clear_thinking = v.get<bool>();
  }
  RenderedChat rendered;
  try {
    rendered = render_chat(cfg.chat_template, messages, tools, opts, in.sample_index);
  } catch (const Error& e) {
    bad.fix = e.fix();
    return reject(BadLineReason::kTemplate, e.where() + ": " + e.problem());
  } catch (const nlohmann::json::exception& e) {
    return reject(BadLineReason::kTemplate,
                  fmt::format("sample {}: the conversation cannot be rendered: {}", in.sample_index,
                              json_error_text(e)));
  }
  if (rendered.num_images + rendered.num_videos > 0)
    return reject(
        BadLineReason::kMedia,
        fmt::format("{} image(s) and {} video(s): the text data pipeline has no pixels to "
                    "attach to their placeholders",
                    rendered.num_images, rendered.num_videos));
  // Written in the text, a media token would be trained as a placeholder with no features behind
  // it; the vision pipeline refuses the same lines.
  if (literal_media("messages") || literal_media("tools")) return false;
  out.segments = std::move(rendered.segments);
  return true;
}

// Parses, renders and encodes a batch of lines (one parallel encode for all of them) and applies
// the length rules. Never throws for a bad line: the caller applies the policy in line order.
std::vector<LineOutcome> process_lines(const DatasetConfig& cfg, const Tokenizer& tokenizer,
                                       int32_t eos_id, std::vector<LineInput>& lines) {
  std::vector<LineOutcome> outcomes(lines.size());
  std::vector<Prepared> prepared(lines.size());
  std::vector<std::string> texts;
  std::vector<size_t> first_text(lines.size(), 0);
  for (size_t i = 0; i < lines.size(); ++i) {
    first_text[i] = texts.size();
    if (!prepare_line(cfg, lines[i], prepared[i], outcomes[i])) continue;
    if (prepared[i].is_text) {
      texts.push_back(std::move(prepared[i].text));
    } else {
      for (const auto& s : prepared[i].segments) texts.push_back(s.text);
    }
  }
  std::vector<std::vector<int32_t>> encoded = tokenizer.encode_batch(texts);
  std::vector<std::pair<int32_t, std::string_view>> media_ids;
  for (std::string_view name : kMediaTokens)
    if (auto id = tokenizer.token_to_id(name)) media_ids.emplace_back(*id, name);

  for (size_t i = 0; i < lines.size(); ++i) {
    LineOutcome& o = outcomes[i];
    if (o.kind == LineOutcome::Kind::kBad) continue;
    // The text was searched before rendering; this catches a token that only rendering spells
    // out (tool-call arguments given as a JSON string with escapes, say).
    const size_t n_texts = prepared[i].is_text ? 1 : prepared[i].segments.size();
    std::string_view media_token;
    for (size_t t = first_text[i]; t < first_text[i] + n_texts && media_token.empty(); ++t)
      for (const auto& [id, name] : media_ids)
        if (std::find(encoded[t].begin(), encoded[t].end(), id) != encoded[t].end()) {
          media_token = name;
          break;
        }
    if (!media_token.empty()) {
      o.kind = LineOutcome::Kind::kBad;
      o.reason = BadLineReason::kMedia;
      o.message =
          literal_media_token_problem(fmt::format("`{}` in the rendered text", media_token));
      o.fix = kLiteralMediaTokenFix;
      continue;
    }
    TokenizedSample ts;
    if (prepared[i].is_text) {
      ts.input_ids = std::move(encoded[first_text[i]]);
      ts.input_ids.push_back(eos_id);
      ts.labels = ts.input_ids;  // continued pretraining: every token is trained
    } else {
      const auto& segs = prepared[i].segments;
      std::vector<std::vector<int32_t>> mine(
          std::make_move_iterator(encoded.begin() + first_text[i]),
          std::make_move_iterator(encoded.begin() + first_text[i] + segs.size()));
      ts = assemble_segments(segs, mine);
    }
    bool truncated = false;
    if (static_cast<int64_t>(ts.input_ids.size()) > cfg.max_length) {
      if (cfg.on_overlong == OverlongPolicy::kDrop) {
        o.kind = LineOutcome::Kind::kOverlong;
        continue;
      }
      ts.input_ids.resize(static_cast<size_t>(cfg.max_length));
      ts.labels.resize(static_cast<size_t>(cfg.max_length));
      truncated = true;
    }
    if (count_targets(ts.labels) == 0) {
      o.kind = LineOutcome::Kind::kUntrained;
      continue;
    }
    o.kind = LineOutcome::Kind::kSample;
    o.sample.tokens = std::move(ts);
    o.sample.file = lines[i].file;
    o.sample.line = lines[i].line;
    o.sample.offset = lines[i].offset;
    o.sample.truncated = truncated;
  }
  return outcomes;
}

void validate_config(const DatasetConfig& cfg) {
  if (cfg.files.empty())
    throw Error("no data files given", "data.files", "list at least one JSONL file");
  if (cfg.max_length < 2 || cfg.max_length > INT32_MAX)
    throw Error(fmt::format("max_length {} is out of range", cfg.max_length), "data.max_length",
                "use a length between 2 and 2^31-1 tokens");
  if (cfg.batch_lines < 1)
    throw Error(fmt::format("batch_lines {} must be at least 1", cfg.batch_lines),
                "data.batch_lines");
}

std::string where_of(const LineInput& in, const DatasetConfig& cfg) {
  return fmt::format("{}:{}", cfg.files[static_cast<size_t>(in.file)], in.line);
}

std::string too_long_problem(uint64_t max_bytes) {
  return fmt::format(
      "the line has more than {} bytes: the file probably lacks newlines between its samples, or "
      "the sample is far longer than any context",
      max_bytes);
}
constexpr std::string_view kTooLongFix =
    "write one JSON object per line, each under the limit (docs/data.md, \"Bad lines\")";

void find_media(const OrderedJson& v, const std::string& path, std::optional<std::string>& found) {
  auto check = [&](const std::string& s, const std::string& at) {
    for (std::string_view t : kMediaTokens)
      if (s.find(t) != std::string::npos) {
        found = fmt::format("`{}` in {}", t, at);
        return;
      }
  };
  if (v.is_string()) {
    check(v.get_ref<const std::string&>(), path);
  } else if (v.is_array()) {
    for (size_t i = 0; i < v.size() && !found; ++i)
      find_media(v[i], fmt::format("{}[{}]", path, i), found);
  } else if (v.is_object()) {
    for (auto it = v.begin(); it != v.end() && !found; ++it) {
      const std::string at = path + "." + it.key();
      check(it.key(), at + " (a key)");
      if (!found) find_media(it.value(), at, found);
    }
  }
}

template <typename Enum, size_t N>
Enum enum_from_name(std::string_view name, std::string_view key,
                    const std::array<std::pair<std::string_view, Enum>, N>& table) {
  std::string accepted;
  for (const auto& [n, v] : table) {
    if (n == name) return v;
    accepted += (accepted.empty() ? "" : ", ") + std::string(n);
  }
  throw Error(fmt::format("unknown value \"{}\"", name), std::string(key),
              "use one of " + accepted);
}

}  // namespace

SampleFormat sample_format_from_name(std::string_view name, std::string_view key) {
  static constexpr std::array<std::pair<std::string_view, SampleFormat>, 3> kTable{
      {{"auto", SampleFormat::kAuto},
       {"chat", SampleFormat::kChat},
       {"text", SampleFormat::kText}}};
  return enum_from_name(name, key, kTable);
}

BadLinePolicy bad_line_policy_from_name(std::string_view name, std::string_view key) {
  static constexpr std::array<std::pair<std::string_view, BadLinePolicy>, 2> kTable{
      {{"fail", BadLinePolicy::kFail}, {"skip", BadLinePolicy::kSkip}}};
  return enum_from_name(name, key, kTable);
}

OverlongPolicy overlong_policy_from_name(std::string_view name, std::string_view key) {
  static constexpr std::array<std::pair<std::string_view, OverlongPolicy>, 2> kTable{
      {{"truncate", OverlongPolicy::kTruncate}, {"drop", OverlongPolicy::kDrop}}};
  return enum_from_name(name, key, kTable);
}

std::string_view bad_line_reason_name(BadLineReason reason) {
  switch (reason) {
    case BadLineReason::kNotJson:
      return "not_json";
    case BadLineReason::kNotObject:
      return "not_object";
    case BadLineReason::kMissingField:
      return "missing_field";
    case BadLineReason::kWrongType:
      return "wrong_type";
    case BadLineReason::kTemplate:
      return "template";
    case BadLineReason::kMedia:
      return "media";
    case BadLineReason::kTooLong:
      return "too_long";
  }
  return "unknown";
}

std::optional<std::string> find_literal_media_token(const OrderedJson& value,
                                                    const std::string& path) {
  std::optional<std::string> found;
  find_media(value, path, found);
  return found;
}

std::string literal_media_token_problem(const std::string& found) {
  return found +
         ": a media token written in the text would be trained with no image or video behind "
         "it; only image and video content items may produce these tokens";
}

std::string json_error_text(const std::exception& e) {
  // nlohmann prefixes "[json.exception.KIND.N] "; the rest says where and why.
  std::string what = e.what();
  if (what.starts_with("[json.exception.")) {
    const size_t p = what.find("] ");
    if (p != std::string::npos) what.erase(0, p + 2);
  }
  return what;
}

// ---------------------------------------------------------------------------------------------

namespace {
// Bytes read per call: long lines are assembled from such pieces, and a line over the limit is
// read past without being held.
constexpr std::streamsize kReadChunk = 64 << 10;
}  // namespace

LineReader::LineReader(const std::string& path, uint64_t max_line_bytes)
    : name_(path), max_line_bytes_(max_line_bytes) {
  std::error_code ec;
  // An ifstream opens a directory without complaint and then reads nothing: it would pass for an
  // empty file.
  if (std::filesystem::is_directory(path, ec))
    throw Error("is a directory, not a JSONL file", path,
                "list the JSONL files inside it one by one (a folder is not expanded)");
  auto in = std::make_unique<std::ifstream>(path, std::ios::binary);
  if (!*in)
    throw Error("cannot open data file", path,
                "check the path (data.files in a recipe, --input or --data on the command line) "
                "and that the file is readable");
  in_ = std::move(in);
}

LineReader::LineReader(std::unique_ptr<std::istream> in, std::string name, uint64_t max_line_bytes)
    : in_(std::move(in)), name_(std::move(name)), max_line_bytes_(max_line_bytes) {}

LineReader::~LineReader() = default;
LineReader::LineReader(LineReader&&) noexcept = default;
LineReader& LineReader::operator=(LineReader&&) noexcept = default;

LineReader::Status LineReader::next(std::string& line) {
  line.clear();
  if (chunk_.empty()) chunk_.resize(static_cast<size_t>(kReadChunk));
  const int64_t number = line_ + 1;
  uint64_t bytes = 0;  // consumed, the newline included
  bool too_long = false;
  auto read_error = [&](const std::string& why) {
    return Error(fmt::format("reading the file failed in line {} ({}); the lines after it were "
                             "not read",
                             number, why),
                 fmt::format("{}:{}", name_, number),
                 "check that the file is complete and readable (not a folder, disk or network "
                 "errors), then run again");
  };
  try {
    for (;;) {
      errno = 0;
      // std::getline into a string would grow it without bound, and its failure looks like the
      // end of the file; the chunked form lets bad() and eof() tell them apart.
      in_->getline(chunk_.data(), kReadChunk);
      const auto got = static_cast<uint64_t>(in_->gcount());
      if (in_->bad())
        throw read_error(errno != 0 ? std::strerror(errno) : "the stream reported an error");
      uint64_t stored = got;
      bool more = false;
      if (in_->eof()) {
        // The last line, without a newline (or nothing at all).
      } else if (in_->fail()) {
        more = true;  // the chunk filled up: the line goes on
        in_->clear();
      } else {
        stored = got - 1;  // gcount counts the newline it extracted
      }
      bytes += got;
      if (!too_long && line.size() + stored > max_line_bytes_) {
        too_long = true;
        std::string().swap(line);
      }
      if (!too_long) line.append(chunk_.data(), static_cast<size_t>(stored));
      if (!more) break;
    }
  } catch (const std::bad_alloc&) {
    throw read_error(fmt::format("out of memory after {} bytes of the line", bytes));
  } catch (const std::length_error&) {
    throw read_error(fmt::format("out of memory after {} bytes of the line", bytes));
  }
  if (bytes == 0) return Status::kEnd;
  line_ = number;
  offset_ = next_offset_;
  next_offset_ += bytes;
  if (too_long) return Status::kTooLong;
  // A UTF-8 byte-order mark, which some editors write at the start of a file.
  if (offset_ == 0 && line.starts_with("\xEF\xBB\xBF")) {
    line.erase(0, 3);
    offset_ = 3;
  }
  return Status::kLine;
}

void LineReader::seek(uint64_t offset, int64_t line_number) {
  in_->clear();
  in_->seekg(static_cast<std::streamoff>(offset));
  if (in_->fail())
    throw Error(fmt::format("cannot seek to byte {} (line {})", offset, line_number), name_,
                "the file changed since it was scanned; restart to rescan it");
  line_ = line_number - 1;
  offset_ = next_offset_ = offset;
}

int64_t DatasetStats::skipped_total() const {
  int64_t n = 0;
  for (int64_t s : skipped) n += s;
  return n;
}

void DatasetStats::add_skipped(BadLineReason reason, const std::string& file, std::string message) {
  ++skipped[static_cast<size_t>(reason)];
  auto it = std::find_if(skipped_by_file.begin(), skipped_by_file.end(),
                         [&](const auto& f) { return f.first == file; });
  if (it == skipped_by_file.end())
    skipped_by_file.emplace_back(file, 1);
  else
    ++it->second;
  if (first_errors.size() >= kMaxReportedErrors) return;
  spdlog::warn("skipping {}", message);
  first_errors.push_back(std::move(message));
  if (first_errors.size() == kMaxReportedErrors)
    spdlog::warn(
        "further bad lines are skipped without a message; their count follows once "
        "the data is read");
}

std::string DatasetStats::skipped_report() const {
  const int64_t total = skipped_total();
  if (total == 0) return {};
  std::string by_reason, by_file;
  for (size_t i = 0; i < skipped.size(); ++i)
    if (skipped[i] > 0)
      by_reason += fmt::format("{}{} {}", by_reason.empty() ? "" : ", ",
                               bad_line_reason_name(static_cast<BadLineReason>(i)), skipped[i]);
  for (const auto& [file, n] : skipped_by_file)
    by_file += fmt::format("{}{} {}", by_file.empty() ? "" : ", ", file, n);
  return fmt::format("{} bad line{} of {} skipped ({}): {}", total, total == 1 ? "" : "s", lines,
                     by_reason, by_file);
}

void DatasetStats::merge(const DatasetStats& o) {
  lines += o.lines;
  samples += o.samples;
  for (size_t i = 0; i < skipped.size(); ++i) skipped[i] += o.skipped[i];
  for (const auto& entry : o.skipped_by_file) {
    auto it = std::find_if(skipped_by_file.begin(), skipped_by_file.end(),
                           [&](const auto& f) { return f.first == entry.first; });
    if (it == skipped_by_file.end())
      skipped_by_file.push_back(entry);
    else
      it->second += entry.second;
  }
  truncated += o.truncated;
  dropped_overlong += o.dropped_overlong;
  dropped_untrained += o.dropped_untrained;
  tokens += o.tokens;
  trained_tokens += o.trained_tokens;
  for (const auto& e : o.first_errors)
    if (first_errors.size() < kMaxReportedErrors) first_errors.push_back(e);
}

nlohmann::json DatasetStats::to_json() const {
  nlohmann::json skipped_by_reason = nlohmann::json::object();
  for (size_t i = 0; i < skipped.size(); ++i)
    skipped_by_reason[std::string(bad_line_reason_name(static_cast<BadLineReason>(i)))] =
        skipped[i];
  nlohmann::json skipped_files = nlohmann::json::object();
  for (const auto& [file, n] : skipped_by_file) skipped_files[file] = n;
  return {{"lines", lines},
          {"samples", samples},
          {"skipped", skipped_total()},
          {"skipped_by_reason", skipped_by_reason},
          {"skipped_by_file", skipped_files},
          {"truncated", truncated},
          {"dropped_overlong", dropped_overlong},
          {"dropped_untrained", dropped_untrained},
          {"tokens", tokens},
          {"trained_tokens", trained_tokens},
          {"first_errors", first_errors}};
}

// ---------------------------------------------------------------------------------------------

JsonlSampleReader::JsonlSampleReader(DatasetConfig config, const Tokenizer& tokenizer)
    : config_(std::move(config)), tokenizer_(tokenizer) {
  validate_config(config_);
  // Open every file up front so that a wrong path fails before any work is done.
  for (const auto& f : config_.files) LineReader check(f, config_.max_line_bytes);
}

JsonlSampleReader::~JsonlSampleReader() = default;

std::optional<Sample> JsonlSampleReader::next() {
  while (ready_.empty()) {
    if (!fill()) return std::nullopt;
  }
  Sample s = std::move(ready_.front());
  ready_.pop_front();
  return s;
}

bool JsonlSampleReader::fill() {
  std::vector<LineInput> batch;
  // A line over the byte limit has no text to process, so it is a bad line found while reading;
  // it stays in the batch (with its outcome set) so that bad lines are still reported in order.
  std::vector<size_t> too_long;
  std::string text;
  while (static_cast<int64_t>(batch.size()) < config_.batch_lines) {
    if (!in_) {
      if (file_ + 1 >= static_cast<int32_t>(config_.files.size())) break;
      ++file_;
      in_ = std::make_unique<LineReader>(config_.files[static_cast<size_t>(file_)],
                                         config_.max_line_bytes);
    }
    const LineReader::Status status = in_->next(text);
    if (status == LineReader::Status::kEnd) {
      in_.reset();
      continue;
    }
    ++stats_.lines;
    if (status == LineReader::Status::kTooLong) {
      too_long.push_back(batch.size());
      batch.push_back({file_, in_->line_number(), in_->line_offset(), sample_counter_++, {}});
      continue;
    }
    if (is_blank(text)) continue;
    batch.push_back(
        {file_, in_->line_number(), in_->line_offset(), sample_counter_++, std::move(text)});
    text.clear();
  }
  if (batch.empty()) return false;

  const int32_t eos = tokenizer_.require_id("<|endoftext|>");
  std::vector<LineOutcome> outcomes = process_lines(config_, tokenizer_, eos, batch);
  for (size_t i : too_long) {
    outcomes[i] = {};
    outcomes[i].kind = LineOutcome::Kind::kBad;
    outcomes[i].reason = BadLineReason::kTooLong;
    outcomes[i].message = too_long_problem(config_.max_line_bytes);
    outcomes[i].fix = kTooLongFix;
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    LineOutcome& o = outcomes[i];
    switch (o.kind) {
      case LineOutcome::Kind::kBad: {
        const std::string where = where_of(batch[i], config_);
        if (config_.on_bad_line == BadLinePolicy::kFail)
          throw Error(o.message, where,
                      (o.fix.empty() ? std::string("fix or remove the line") : o.fix) +
                          "; or set on_bad_line = \"skip\" to skip and count such lines");
        stats_.add_skipped(o.reason, config_.files[static_cast<size_t>(batch[i].file)],
                           where + ": " + o.message);
        break;
      }
      case LineOutcome::Kind::kOverlong:
        ++stats_.dropped_overlong;
        break;
      case LineOutcome::Kind::kUntrained:
        ++stats_.dropped_untrained;
        break;
      case LineOutcome::Kind::kSample:
        ++stats_.samples;
        stats_.truncated += o.sample.truncated;
        stats_.tokens += static_cast<int64_t>(o.sample.tokens.input_ids.size());
        stats_.trained_tokens += count_targets(o.sample.tokens.labels);
        ready_.push_back(std::move(o.sample));
        break;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------

uint64_t SampleSource::fingerprint() const {
  // FNV-1a over the count and every length: cheap, and any added, removed or re-tokenized sample
  // changes it.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xFF;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(size()));
  for (int64_t i = 0; i < size(); ++i) mix(static_cast<uint64_t>(length(i)));
  return h;
}

InMemorySamples::InMemorySamples(std::vector<TokenizedSample> samples)
    : samples_(std::move(samples)) {
  for (size_t i = 0; i < samples_.size(); ++i) {
    const auto& s = samples_[i];
    if (s.input_ids.size() != s.labels.size() || s.input_ids.empty())
      throw Error(
          fmt::format("sample {} has {} ids and {} labels", i, s.input_ids.size(), s.labels.size()),
          "samples", "give every sample at least one token and one label per token");
  }
}

int64_t InMemorySamples::length(int64_t i) const {
  return static_cast<int64_t>(at(i).input_ids.size());
}

const TokenizedSample& InMemorySamples::at(int64_t i) const {
  GLMTUNE_ASSERT(i >= 0 && i < size(), "sample index {} out of range [0, {})", i, size());
  return samples_[static_cast<size_t>(i)];
}

std::vector<TokenizedSample> InMemorySamples::load(const std::vector<int64_t>& indices) const {
  std::vector<TokenizedSample> out;
  out.reserve(indices.size());
  for (int64_t i : indices) out.push_back(at(i));
  return out;
}

JsonlDataset::JsonlDataset(DatasetConfig config, const Tokenizer& tokenizer)
    : config_(std::move(config)), tokenizer_(&tokenizer) {}

JsonlDataset JsonlDataset::scan(const DatasetConfig& config, const Tokenizer& tokenizer) {
  JsonlDataset ds(config, tokenizer);
  JsonlSampleReader reader(config, tokenizer);
  while (auto s = reader.next()) {
    ds.entries_.push_back(
        {s->offset, s->line, s->file, static_cast<int32_t>(s->tokens.input_ids.size())});
  }
  ds.stats_ = reader.stats();
  return ds;
}

int64_t JsonlDataset::length(int64_t i) const {
  GLMTUNE_ASSERT(i >= 0 && i < size(), "sample index {} out of range [0, {})", i, size());
  return entries_[static_cast<size_t>(i)].length;
}

std::vector<TokenizedSample> JsonlDataset::load(const std::vector<int64_t>& indices) const {
  // Read the requested lines, one open stream per file, then process them as one batch.
  std::map<int32_t, std::unique_ptr<LineReader>> streams;
  std::vector<LineInput> lines;
  lines.reserve(indices.size());
  for (int64_t idx : indices) {
    GLMTUNE_ASSERT(idx >= 0 && idx < size(), "sample index {} out of range [0, {})", idx, size());
    const Entry& e = entries_[static_cast<size_t>(idx)];
    auto& in = streams[e.file];
    if (!in)
      in = std::make_unique<LineReader>(config_.files[static_cast<size_t>(e.file)],
                                        config_.max_line_bytes);
    in->seek(e.offset, e.line);
    std::string text;
    if (in->next(text) != LineReader::Status::kLine)
      throw Error(fmt::format("cannot read line {} any more", e.line),
                  config_.files[static_cast<size_t>(e.file)],
                  "the file changed since the dataset was scanned; restart to rescan it");
    lines.push_back({e.file, e.line, e.offset, idx, std::move(text)});
  }
  const int32_t eos = tokenizer_->require_id("<|endoftext|>");
  std::vector<LineOutcome> outcomes = process_lines(config_, *tokenizer_, eos, lines);
  std::vector<TokenizedSample> out;
  out.reserve(indices.size());
  for (size_t i = 0; i < indices.size(); ++i) {
    const Entry& e = entries_[static_cast<size_t>(indices[i])];
    LineOutcome& o = outcomes[i];
    if (o.kind != LineOutcome::Kind::kSample ||
        static_cast<int64_t>(o.sample.tokens.input_ids.size()) != e.length)
      throw Error("the line no longer gives the sample it gave when the dataset was scanned",
                  fmt::format("{}:{}", config_.files[static_cast<size_t>(e.file)], e.line),
                  "data files must not change during training; restart to rescan them");
    out.push_back(std::move(o.sample.tokens));
  }
  return out;
}

}  // namespace glmtune::data
