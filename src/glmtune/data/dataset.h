#pragma once
// Text datasets: JSONL files of conversations or plain text, turned into tokenized samples.
//
// One line is one sample:
//   {"messages": [...], "tools": [...]?, "reasoning_effort": "low"|"high"|...?, "clear_thinking":
//   bool?}
//     rendered with the chat template (chat_template.h) and trained per its loss mask;
//   {"text": "..."}
//     continued pretraining: the text plus a final `<|endoftext|>`, every token trained.
// Files are streamed line by line; memory stays bounded by one batch of lines, never the file.
// Lines the pipeline cannot use are reported with file and line number and either skipped and
// counted or fatal (`BadLinePolicy`); samples longer than `max_length` are truncated or dropped
// (`OverlongPolicy`) and counted. A file that cannot be read to its end is always an error: what
// was read is never passed off as the whole file.

#include <array>
#include <cstdint>
#include <deque>
#include <fstream>
#include <istream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "glmtune/data/chat_template.h"

namespace glmtune::data {

class Tokenizer;

enum class SampleFormat {
  kAuto,  // per line: "messages" -> chat, "text" -> plain text
  kChat,  // every line must have "messages"
  kText,  // every line must have "text"
};
enum class BadLinePolicy { kFail, kSkip };
enum class OverlongPolicy { kTruncate, kDrop };

// Config spellings: "auto" / "chat" / "text", "fail" / "skip", "truncate" / "drop". Unknown names
// throw glmtune::Error naming `key` and the accepted values.
SampleFormat sample_format_from_name(std::string_view name, std::string_view key = "format");
BadLinePolicy bad_line_policy_from_name(std::string_view name,
                                        std::string_view key = "on_bad_line");
OverlongPolicy overlong_policy_from_name(std::string_view name,
                                         std::string_view key = "on_overlong");

// The most bytes one JSONL line may hold: 64 MiB. A conversation of a million tokens takes a few
// MB; a longer line is almost always a file without newlines between its samples, and reading it
// whole could exhaust memory before any error named it.
inline constexpr uint64_t kMaxLineBytes = uint64_t{64} << 20;

// Reads a JSONL file line by line and tells its end from a failure to read it.
class LineReader {
 public:
  // Opens `path`. Throws glmtune::Error naming it when it cannot be opened or is a directory.
  explicit LineReader(const std::string& path, uint64_t max_line_bytes = kMaxLineBytes);
  // Reads `in`, called `name` in errors.
  LineReader(std::unique_ptr<std::istream> in, std::string name,
             uint64_t max_line_bytes = kMaxLineBytes);
  ~LineReader();
  LineReader(LineReader&&) noexcept;
  LineReader& operator=(LineReader&&) noexcept;

  enum class Status {
    kLine,     // `line` holds the next line
    kTooLong,  // the next line has more than max_line_bytes bytes; they were read past, unkept
    kEnd,      // the file ended
  };
  // The next line, without its '\n' (a '\r' before it stays) and, on the first line, without a
  // UTF-8 byte-order mark. A failed read (an I/O error, memory exhausted) throws glmtune::Error at
  // "file:line" instead of ending the file early.
  Status next(std::string& line);
  // 1-based number and byte offset of the line `next` returned last (after a byte-order mark).
  int64_t line_number() const { return line_; }
  uint64_t line_offset() const { return offset_; }
  // Continues at byte `offset`, the start of line `line_number` (as an earlier pass recorded).
  void seek(uint64_t offset, int64_t line_number);
  const std::string& name() const { return name_; }
  uint64_t max_line_bytes() const { return max_line_bytes_; }

 private:
  std::unique_ptr<std::istream> in_;
  std::string name_;
  uint64_t max_line_bytes_;
  int64_t line_ = 0;
  uint64_t offset_ = 0, next_offset_ = 0;
  std::vector<char> chunk_;
};

// The image and video special tokens: placeholders and markers that only image and video content
// items may produce (the template writes them; the vision processor expands them).
inline constexpr std::array<std::string_view, 6> kMediaTokens = {
    "<|begin_of_image|>", "<|image|>", "<|end_of_image|>",
    "<|begin_of_video|>", "<|video|>", "<|end_of_video|>"};
// Where `value` (strings and object keys, searched recursively) writes one of kMediaTokens
// literally, as "`<|image|>` in PATH[1].content", with `path` naming `value`; nullopt if nowhere.
std::optional<std::string> find_literal_media_token(const OrderedJson& value,
                                                    const std::string& path);
// The problem and the fix of a line that writes a media token in its text (both pipelines).
std::string literal_media_token_problem(const std::string& found);
inline constexpr std::string_view kLiteralMediaTokenFix =
    "remove the token from the text or break it up (e.g. `<| image|>`); images and videos go in "
    "as content items, read with data.media_root (or --media-root) set (docs/vision.md)";
// A nlohmann exception's message without its "[json.exception.KIND.N] " prefix.
std::string json_error_text(const std::exception& e);

struct DatasetConfig {
  std::vector<std::string> files;
  SampleFormat format = SampleFormat::kAuto;
  // Longest sample in tokens; must not exceed the pack length when packing.
  int64_t max_length = 4096;
  BadLinePolicy on_bad_line = BadLinePolicy::kFail;
  OverlongPolicy on_overlong = OverlongPolicy::kTruncate;
  ChatTemplateKind chat_template = ChatTemplateKind::kGlm53;
  // Template options for every conversation; a line's own "reasoning_effort" / "clear_thinking"
  // take precedence.
  std::optional<std::string> reasoning_effort;
  bool clear_thinking = false;
  // Lines parsed, rendered and encoded together (the encoder runs a batch on all cores).
  int64_t batch_lines = 256;
  // Longer lines are bad lines (BadLineReason::kTooLong).
  uint64_t max_line_bytes = kMaxLineBytes;
};

// Why a line was rejected.
enum class BadLineReason {
  kNotJson,       // not valid JSON (or not UTF-8)
  kNotObject,     // valid JSON but not an object
  kMissingField,  // neither "messages" nor "text" (or not the one the format requires)
  kWrongType,     // a top-level field of the wrong type
  kTemplate,      // the conversation is malformed (the chat template's error)
  kMedia,         // images or videos the text pipeline cannot attach pixels to, or a media token
                  // written in the text
  kTooLong,       // more bytes than the line limit (kMaxLineBytes)
};
inline constexpr size_t kNumBadLineReasons = 7;
std::string_view bad_line_reason_name(BadLineReason reason);

struct DatasetStats {
  int64_t lines = 0;                                  // lines read, blank lines included
  int64_t samples = 0;                                // samples kept
  std::array<int64_t, kNumBadLineReasons> skipped{};  // bad lines skipped, by BadLineReason
  int64_t truncated = 0;                              // kept samples cut to max_length
  int64_t dropped_overlong = 0;   // samples over max_length dropped (OverlongPolicy::kDrop)
  int64_t dropped_untrained = 0;  // samples with no loss target (e.g. no assistant turn)
  int64_t tokens = 0;             // tokens of kept samples, after truncation
  // Loss targets of kept samples: trained tokens that some earlier token of the same sample
  // predicts, i.e. exactly what the per-document shifted labels contain.
  int64_t trained_tokens = 0;
  // Bad lines skipped per file, in the order the files first had one.
  std::vector<std::pair<std::string, int64_t>> skipped_by_file;
  // The first few bad-line messages ("file:line: problem"), for reports.
  std::vector<std::string> first_errors;

  int64_t skipped_total() const;
  // Counts a skipped line of `file`; `message` is "file:line: problem". The first ten are logged
  // as warnings and kept in first_errors, later ones only counted.
  void add_skipped(BadLineReason reason, const std::string& file, std::string message);
  // One line for logs: "N bad lines of LINES skipped (REASON n, ...): FILE n, ...", or "" when
  // none were skipped.
  std::string skipped_report() const;
  void merge(const DatasetStats& other);
  nlohmann::json to_json() const;
};

struct Sample {
  TokenizedSample tokens;
  int32_t file = 0;     // index into DatasetConfig::files
  int64_t line = 0;     // 1-based line number
  uint64_t offset = 0;  // byte offset of the line in its file
  bool truncated = false;
};

// Streams the samples of all files in order, reading line by line.
class JsonlSampleReader {
 public:
  // `tokenizer` must outlive the reader. Throws glmtune::Error for a file it cannot open.
  JsonlSampleReader(DatasetConfig config, const Tokenizer& tokenizer);
  ~JsonlSampleReader();

  // The next kept sample, or nullopt after the last line of the last file. Under
  // BadLinePolicy::kFail a bad line throws glmtune::Error with where() = "file:line"; a file that
  // cannot be read to its end throws under either policy.
  std::optional<Sample> next();
  const DatasetStats& stats() const { return stats_; }

 private:
  bool fill();  // reads and processes the next batch of lines; false at the end of all files

  DatasetConfig config_;
  const Tokenizer& tokenizer_;
  std::unique_ptr<LineReader> in_;
  int32_t file_ = -1;
  int64_t sample_counter_ = 0;
  std::deque<Sample> ready_;
  DatasetStats stats_;
};

// Random access to tokenized samples by index: what packing consumes.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t size() const = 0;
  // Token count of sample i.
  virtual int64_t length(int64_t i) const = 0;
  // The samples at `indices`, in that order. Must be safe to call from several threads.
  virtual std::vector<TokenizedSample> load(const std::vector<int64_t>& indices) const = 0;
  // Changes whenever the samples' lengths change; a saved sampler position checks it on resume.
  uint64_t fingerprint() const;
};

// Samples held in memory (small datasets, tests).
class InMemorySamples : public SampleSource {
 public:
  explicit InMemorySamples(std::vector<TokenizedSample> samples);
  int64_t size() const override { return static_cast<int64_t>(samples_.size()); }
  int64_t length(int64_t i) const override;
  std::vector<TokenizedSample> load(const std::vector<int64_t>& indices) const override;
  const TokenizedSample& at(int64_t i) const;

 private:
  std::vector<TokenizedSample> samples_;
};

// JSONL files indexed by one streaming pass: per kept sample its file, byte offset and length
// (24 bytes a sample). `load` seeks to the lines and tokenizes them again, so memory does not
// grow with the data.
class JsonlDataset : public SampleSource {
 public:
  // Reads every file once. `tokenizer` must outlive the dataset.
  static JsonlDataset scan(const DatasetConfig& config, const Tokenizer& tokenizer);

  int64_t size() const override { return static_cast<int64_t>(entries_.size()); }
  int64_t length(int64_t i) const override;
  // Throws glmtune::Error if a file changed since the scan (a line no longer gives its sample).
  std::vector<TokenizedSample> load(const std::vector<int64_t>& indices) const override;
  const DatasetStats& stats() const { return stats_; }
  const DatasetConfig& config() const { return config_; }

 private:
  struct Entry {
    uint64_t offset;
    int64_t line;
    int32_t file;
    int32_t length;
  };
  JsonlDataset(DatasetConfig config, const Tokenizer& tokenizer);

  DatasetConfig config_;
  const Tokenizer* tokenizer_;
  std::vector<Entry> entries_;
  DatasetStats stats_;
};

}  // namespace glmtune::data
