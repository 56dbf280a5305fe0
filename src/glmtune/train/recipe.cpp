#include "glmtune/train/recipe.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"

namespace glmtune::train {

struct Recipe::Doc {
  toml::table table;
  // "section.key" -> the override that set it, so errors point at the flag, not the file.
  std::map<std::string, std::string> overrides;
};

namespace {

struct KeySpec {
  const char* key;
  const char* example;    // a valid value, quoted in fix advice
  const char* note = "";  // what the accepted values are, when an example does not say
};
struct SectionSpec {
  const char* name;
  std::vector<KeySpec> keys;
};

const std::vector<SectionSpec>& schema() {
  static const std::vector<SectionSpec> s = {
      {"model",
       {{"path", "\"runs/tiny-model\""},
        {"tokenizer", "\"runs/tiny-model\""},
        {"freeze_vision", "false"},
        {"freeze_projector", "false"}}},
      {"data",
       {{"files", "[\"data/train.jsonl\"]"},
        {"cache", "\"runs/train.cache\""},
        {"format", "\"chat\"", "auto, chat or text"},
        {"on_bad_line", "\"skip\"", "fail or skip"},
        {"on_overlong", "\"truncate\"", "truncate or drop"},
        {"max_length", "4096"},
        {"pack_max_length", "16384"},
        {"pack_lookahead", "100"},
        {"shuffle", "true"},
        {"media_root", "\"data/media\""}}},
      {"train",
       {{"total_steps", "1000"},
        {"epochs", "2"},
        {"micro_packs", "1"},
        {"seed", "0"},
        {"device", "\"cuda:0\"", "cpu, cuda or cuda:N"},
        {"recompute", "\"all\"", "all, none, or the fraction of layers in [0, 1]"},
        {"offload", "\"none\"",
         "all, none, or the fraction of layers in [0, 1] after the recomputed ones"},
        {"recompute_vision", "true",
         "the vision tower's blocks keep their inputs only and rerun in the backward"},
        {"on_nonfinite", "\"skip\"", "skip or stop"},
        {"ep_size", "1", "ranks the routed experts are split over"},
        {"sp_size", "1", "ranks a sequence is split over"},
        {"fsdp", "false", "shard the decoder layers' parameters over the data-parallel ranks"},
        {"freeze", "[\"mlp\\\\.experts\\\\.\"]",
         "regular expressions searched in the released parameter names"},
        {"dist_timeout", "600", "seconds a collective may wait for the other ranks"},
        {"frozen_weights", "\"fp8\"",
         "\"fp8\": frozen tensors stored in FP8 stay in FP8 on the device (dequantised per layer "
         "around each use); \"bf16\": dequantised at load"},
        {"fp8", "\"tilewise\"",
         "\"tilewise\": the experts', MLPs' and attention projections' GEMMs in block-scaled FP8; "
         "\"none\": in the compute dtype"}}},
      {"optimizer",
       {{"lr", "1e-5"},
        {"lr_min", "1e-6"},
        {"warmup_steps", "100"},
        {"warmup_ratio", "0.03"},
        {"betas", "[0.9, 0.95]"},
        {"eps", "1e-8"},
        {"weight_decay", "0.01"},
        {"clip_grad_norm", "1.0"}}},
      {"loss",
       {{"mtp_scale", "0.1"}, {"balancing_alpha", "0.001"}, {"router_bias_update_rate", "0.001"}}},
      {"output",
       {{"dir", "\"runs/my-run\""}, {"save_every", "200"}, {"keep_last", "3"}, {"log_every", "1"}}},
      {"lora",
       {{"rank", "16"},
        {"alpha", "32"},
        {"dropout", "0.05", "PEFT's lora_dropout on each adapter's input while training"},
        {"use_rslora", "false"},
        {"target_modules", "[\"q_proj\", \"o_proj\"]",
         "PEFT's module suffixes, [\"all-linear\"], or one regular expression as a string"},
        {"target_parameters", "[\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]",
         "PEFT's parameter suffixes: the routed experts' fused parameters"},
        {"base", "\"fp8\"",
         "\"fp8\": the base's FP8 weights stay in FP8 (dequantised per layer around each use); "
         "\"bf16\": dequantised at load"}}},
  };
  return s;
}

const SectionSpec* find_section(std::string_view name) {
  for (const auto& s : schema())
    if (name == s.name) return &s;
  return nullptr;
}

const KeySpec* find_key(const SectionSpec& section, std::string_view key) {
  for (const auto& k : section.keys)
    if (key == k.key) return &k;
  return nullptr;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Names other trainers use for our keys, so that a recipe ported from them gets pointed at the
// right spelling.
const std::map<std::string, std::string, std::less<>>& key_aliases() {
  static const std::map<std::string, std::string, std::less<>> a = {
      {"learning_rate", "lr"},
      {"min_lr", "lr_min"},
      {"lr_end", "lr_min"},
      {"warmup", "warmup_steps"},
      {"warmup_iters", "warmup_steps"},
      {"max_grad_norm", "clip_grad_norm"},
      {"grad_clip", "clip_grad_norm"},
      {"adam_beta1", "betas"},
      {"adam_beta2", "betas"},
      {"adam_eps", "eps"},
      {"max_steps", "total_steps"},
      {"steps", "total_steps"},
      {"num_epochs", "epochs"},
      {"gradient_accumulation_steps", "micro_packs"},
      {"grad_accum", "micro_packs"},
      {"output_dir", "dir"},
      {"work_dir", "dir"},
      {"save_steps", "save_every"},
      {"logging_steps", "log_every"},
      {"max_keep", "keep_last"},
      {"sample_max_length", "max_length"},
      {"seq_len", "pack_max_length"},
      {"model_path", "path"},
      {"data_files", "files"},
  };
  return a;
}

// "did you mean ..." for a misspelt name among `candidates`; empty when nothing is close.
std::string closest(std::string_view name, const std::vector<std::string>& candidates) {
  std::string best;
  // A shortened or lengthened name ("keep" for "keep_last") is a likely slip too.
  if (name.size() >= 3) {
    size_t best_gap = SIZE_MAX;
    for (const auto& c : candidates) {
      if (!c.starts_with(name) && !name.starts_with(c)) continue;
      const size_t gap = c.size() > name.size() ? c.size() - name.size() : name.size() - c.size();
      if (gap < best_gap) best_gap = gap, best = c;
    }
    if (!best.empty()) return best;
  }
  size_t best_d = std::max<size_t>(2, name.size() / 3) + 1;
  for (const auto& c : candidates) {
    const size_t d = edit_distance(name, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

std::string type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    default:
      return "a date/time";
  }
}

std::string format_name(data::SampleFormat f) {
  return f == data::SampleFormat::kChat ? "chat" : f == data::SampleFormat::kText ? "text" : "auto";
}
std::string bad_line_name(data::BadLinePolicy p) {
  return p == data::BadLinePolicy::kSkip ? "skip" : "fail";
}
std::string overlong_name(data::OverlongPolicy p) {
  return p == data::OverlongPolicy::kDrop ? "drop" : "truncate";
}

// Typed, located access to the recipe document. Every failure names the file, line and key.
class Reader {
 public:
  Reader(const toml::table& table, const std::map<std::string, std::string>& overrides,
         const std::string& source)
      : table_(table), overrides_(overrides), source_(source) {}

  const toml::node* find(const std::string& section, const std::string& key) const {
    const toml::node* s = table_.get(section);
    if (!s || !s->is_table()) return nullptr;
    return s->as_table()->get(key);
  }

  // Where a whole section came from: the --set flag that created it, else its header's line.
  std::string section_where(const std::string& section, int64_t line) const {
    for (const auto& [dotted, flag] : overrides_)
      if (dotted.starts_with(section + ".") && !table_.get(section)->source().begin.line)
        return fmt::format("{} (recipe {})", flag, source_);
    return line > 0 ? fmt::format("{}:{}: {}", source_, line, section)
                    : fmt::format("{}: {}", source_, section);
  }

  std::string where(const std::string& section, const std::string& key) const {
    const std::string dotted = section + "." + key;
    auto it = overrides_.find(dotted);
    if (it != overrides_.end()) return fmt::format("{} (recipe {})", it->second, source_);
    const toml::node* n = find(section, key);
    if (n && n->source().begin.line > 0)
      return fmt::format("{}:{}: {}", source_, n->source().begin.line, dotted);
    return fmt::format("{}: {}", source_, dotted);
  }

  [[noreturn]] void fail(const std::string& section, const std::string& key,
                         const std::string& what, const std::string& fix) const {
    throw Error(what, where(section, key), fix);
  }

  std::string example_fix(const std::string& section, const std::string& key) const {
    const KeySpec* k = find_key(*find_section(section), key);
    std::string fix = fmt::format("write e.g. `{} = {}` in [{}]", key, k->example, section);
    if (*k->note) fix += fmt::format(" (accepted: {})", k->note);
    return fix;
  }

  [[noreturn]] void wrong_type(const std::string& section, const std::string& key,
                               const char* expected) const {
    fail(section, key, fmt::format("expected {}, got {}", expected, type_name(*find(section, key))),
         example_fix(section, key));
  }

  std::optional<std::string> string(const std::string& section, const std::string& key,
                                    bool allow_empty = false) const {
    const toml::node* n = find(section, key);
    if (!n) return std::nullopt;
    if (!n->is_string()) wrong_type(section, key, "a string");
    std::string v = n->as_string()->get();
    if (v.empty() && !allow_empty)
      fail(section, key, "must not be empty", example_fix(section, key));
    return v;
  }

  // The entries of the array at section.key (the caller checked it is one), each a non-empty
  // string.
  std::vector<std::string> strings(const std::string& section, const std::string& key) const {
    std::vector<std::string> out;
    for (const auto& e : *find(section, key)->as_array()) {
      if (!e.is_string() || e.as_string()->get().empty())
        fail(section, key,
             fmt::format("every entry must be a non-empty string, found {}", type_name(e)),
             example_fix(section, key));
      out.push_back(e.as_string()->get());
    }
    return out;
  }

  // Refuses `pattern`, given at section.key, unless it is an ECMAScript regular expression.
  void check_regex(const std::string& section, const std::string& key, const std::string& pattern,
                   const std::string& fix) const {
    try {
      (void)std::regex(pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& err) {
      fail(section, key, fmt::format("'{}' is not a regular expression ({})", pattern, err.what()),
           fix);
    }
  }

  std::optional<bool> boolean(const std::string& section, const std::string& key) const {
    const toml::node* n = find(section, key);
    if (!n) return std::nullopt;
    if (!n->is_boolean()) wrong_type(section, key, "true or false");
    return n->as_boolean()->get();
  }

  std::optional<int64_t> integer(const std::string& section, const std::string& key, int64_t min,
                                 int64_t max = std::numeric_limits<int64_t>::max()) const {
    const toml::node* n = find(section, key);
    if (!n) return std::nullopt;
    if (!n->is_integer()) wrong_type(section, key, "an integer");
    const int64_t v = n->as_integer()->get();
    if (v < min || v > max)
      fail(section, key,
           max == std::numeric_limits<int64_t>::max()
               ? fmt::format("must be >= {}, got {}", min, v)
               : fmt::format("must be in [{}, {}], got {}", min, max, v),
           example_fix(section, key));
    return v;
  }

  // A number (integer or float), finite, in [min, max] (or (min, max] when `min_exclusive`).
  std::optional<double> number(const std::string& section, const std::string& key, double min,
                               double max, bool min_exclusive = false,
                               bool max_exclusive = false) const {
    const toml::node* n = find(section, key);
    if (!n) return std::nullopt;
    double v;
    if (n->is_integer())
      v = double(n->as_integer()->get());
    else if (n->is_floating_point())
      v = n->as_floating_point()->get();
    else
      wrong_type(section, key, "a number");
    check_range(section, key, v, min, max, min_exclusive, max_exclusive);
    // -0.0 is the setting 0: without this it would print as -0 and hash unlike 0.
    return v == 0 ? 0.0 : v;
  }

  void check_range(const std::string& section, const std::string& key, double v, double min,
                   double max, bool min_exclusive, bool max_exclusive,
                   const std::string& what = "") const {
    const bool low = min_exclusive ? v <= min : v < min;
    const bool high = max_exclusive ? v >= max : v > max;
    if (!std::isfinite(v) || low || high) {
      const std::string range = std::isinf(max)
                                    ? fmt::format("{} {}", min_exclusive ? ">" : ">=", min)
                                    : fmt::format("in {}{}, {}{}", min_exclusive ? "(" : "[", min,
                                                  max, max_exclusive ? ")" : "]");
      fail(section, key,
           fmt::format("{}must be a finite number {}, got {}", what.empty() ? "" : what + " ",
                       range, v),
           example_fix(section, key));
    }
  }

  // One of `names`.
  std::optional<std::string> choice(const std::string& section, const std::string& key,
                                    const std::vector<std::string>& names) const {
    auto v = string(section, key, true);
    if (!v) return v;
    for (const auto& n : names)
      if (*v == n) return v;
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    fail(section, key, fmt::format("unknown value \"{}\" (accepted: {})", *v, list),
         example_fix(section, key));
  }

 private:
  const toml::table& table_;
  const std::map<std::string, std::string>& overrides_;
  const std::string& source_;
};

// Unknown sections and keys first, so that a misspelt key is reported as such rather than as a
// missing required one.
void check_known_keys(const toml::table& table, const Reader& reader) {
  std::vector<std::string> sections;
  for (const auto& s : schema()) sections.push_back(s.name);
  std::string section_list;
  for (const auto& s : sections) section_list += (section_list.empty() ? "" : ", ") + s;
  for (auto&& [k, node] : table) {
    const std::string name(k.str());
    const SectionSpec* spec = find_section(name);
    const std::string where = reader.section_where(name, k.source().begin.line);
    if (!spec) {
      // A known key written outside any section is a common slip: say where it belongs.
      for (const auto& s : schema())
        if (find_key(s, name))
          throw Error(fmt::format("'{}' must be inside a section", name), where,
                      fmt::format("move it under [{}]", s.name));
      const std::string guess = closest(name, sections);
      throw Error(fmt::format("unknown section [{}]", name), where,
                  guess.empty()
                      ? "the sections are " + section_list
                      : fmt::format("did you mean [{}]? The sections are {}", guess, section_list));
    }
    if (!node.is_table())
      throw Error(fmt::format("'{}' must be a section ([{}]), got {}", name, name, type_name(node)),
                  where, fmt::format("write [{}] on its own line, followed by its keys", name));
    std::vector<std::string> keys;
    for (const auto& key : spec->keys) keys.push_back(key.key);
    for (auto&& [key, value] : *node.as_table()) {
      const std::string kname(key.str());
      if (find_key(*spec, kname)) continue;
      std::string fix;
      for (const auto& other : schema())
        if (find_key(other, kname)) fix = fmt::format("'{}' belongs in [{}]", kname, other.name);
      if (auto alias = key_aliases().find(kname); fix.empty() && alias != key_aliases().end()) {
        for (const auto& other : schema())
          if (find_key(other, alias->second))
            fix = other.name == name
                      ? fmt::format("did you mean '{}'?", alias->second)
                      : fmt::format("did you mean '{}' in [{}]?", alias->second, other.name);
      }
      if (fix.empty()) {
        const std::string guess = closest(kname, keys);
        std::string list;
        for (const auto& k2 : keys) list += (list.empty() ? "" : ", ") + k2;
        fix = guess.empty()
                  ? fmt::format("the keys of [{}] are {}", name, list)
                  : fmt::format("did you mean '{}'? The keys of [{}] are {}", guess, name, list);
      }
      throw Error(fmt::format("unknown key '{}' in [{}]", kname, name), reader.where(name, kname),
                  fix);
    }
  }
}

uint64_t fnv1a64(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

Recipe Recipe::load(const std::string& path) { return parse(read_text_file(path, "recipe"), path); }

Recipe Recipe::parse(std::string_view text, const std::string& source) {
  auto doc = std::make_shared<Doc>();
  try {
    doc->table = toml::parse(text, std::string_view(source));
  } catch (const toml::parse_error& e) {
    throw Error(std::string(e.description()),
                fmt::format("{}:{}:{}", source, e.source().begin.line, e.source().begin.column),
                "fix the TOML syntax at that position (strings need double quotes, sections are "
                "written [name])");
  }
  Recipe r;
  r.doc_ = std::move(doc);
  r.source_ = source;
  r.parse_doc();
  return r;
}

namespace {

// Throws the error of a required key that is absent.
using MissingKey = std::function<void(const char* section, const char* key)>;

// [model] path and tokenizer.
void parse_model(const Reader& rd, Recipe& r, const MissingKey& missing) {
  if (auto v = rd.string("model", "path"))
    r.model_path = *v;
  else
    missing("model", "path");
  r.tokenizer_path = rd.string("model", "tokenizer").value_or(r.model_path);
}

// [data], and the model.freeze_* shorthands that come with vision data.
void parse_data(const Reader& rd, Recipe& r) {
  if (const toml::node* n = rd.find("data", "files")) {
    if (n->is_string()) {
      r.data_files = {*rd.string("data", "files")};
    } else if (n->is_array()) {
      if (n->as_array()->empty())
        rd.fail("data", "files", "lists no file", rd.example_fix("data", "files"));
      r.data_files = rd.strings("data", "files");
    } else {
      rd.wrong_type("data", "files", "an array of file paths");
    }
  }
  if (auto v = rd.string("data", "cache")) {
    if (!r.data_files.empty())
      rd.fail("data", "cache", "files and cache are both set",
              "keep data.cache (a prepared token cache) or data.files (JSONL), not both");
    r.data_cache = *v;
  }
  if (r.data_files.empty() && r.data_cache.empty())
    throw Error("missing required key data.files", r.source(),
                "add `files = [\"data/train.jsonl\"]` (JSONL) or `cache = \"runs/train.cache\"` "
                "(from glmtune data prepare) under [data]");
  if (auto v = rd.choice("data", "format", {"auto", "chat", "text"}))
    r.data_format = data::sample_format_from_name(*v);
  if (auto v = rd.choice("data", "on_bad_line", {"fail", "skip"}))
    r.on_bad_line = data::bad_line_policy_from_name(*v);
  if (auto v = rd.choice("data", "on_overlong", {"truncate", "drop"}))
    r.on_overlong = data::overlong_policy_from_name(*v);
  // cu_seqlens are int32, so a pack holds at most 2^31 − 1 tokens.
  r.pack_max_length =
      rd.integer("data", "pack_max_length", 2, std::numeric_limits<int32_t>::max()).value_or(16384);
  if (auto v = rd.integer("data", "max_length", 1)) {
    if (*v > r.pack_max_length)
      rd.fail("data", "max_length",
              fmt::format("a sample of up to {} tokens cannot fit a pack of {} tokens", *v,
                          r.pack_max_length),
              "lower data.max_length or raise data.pack_max_length");
    r.max_length = *v;
  } else {
    r.max_length = std::min<int64_t>(4096, r.pack_max_length);
  }
  r.pack_lookahead = rd.integer("data", "pack_lookahead", 0, 1'000'000).value_or(100);
  r.shuffle = rd.boolean("data", "shuffle").value_or(true);
  if (auto v = rd.string("data", "media_root")) r.media_root = *v;
  r.freeze_vision = rd.boolean("model", "freeze_vision").value_or(false);
  r.freeze_projector = rd.boolean("model", "freeze_projector").value_or(false);
}

// [train].
void parse_train(const Reader& rd, Recipe& r) {
  r.total_steps = rd.integer("train", "total_steps", 1);
  r.epochs = rd.number("train", "epochs", 0.0, std::numeric_limits<double>::infinity(), true);
  if (r.total_steps && r.epochs)
    rd.fail("train", "epochs", "total_steps and epochs are both set",
            "keep one of train.total_steps and train.epochs");
  if (!r.total_steps && !r.epochs)
    throw Error("the run length is not set", r.source(),
                "add `total_steps = 1000` (optimizer steps) or `epochs = 1` under [train]");
  r.micro_packs = rd.integer("train", "micro_packs", 1, 1'000'000).value_or(1);
  r.seed = uint64_t(rd.integer("train", "seed", 0).value_or(0));
  if (auto v = rd.string("train", "device")) {
    try {
      r.device = Device::parse(*v);
    } catch (const Error& e) {
      rd.fail("train", "device", e.problem(), rd.example_fix("train", "device"));
    }
  }
  // "all", "none" or a fraction of the decoder layers.
  const auto layer_fraction = [&](const char* key, double& value) {
    const toml::node* n = rd.find("train", key);
    if (!n) return;
    if (n->is_string())
      value = *rd.choice("train", key, {"all", "none"}) == "all" ? 1.0 : 0.0;
    else if (n->is_number())
      value = *rd.number("train", key, 0.0, 1.0);
    else
      rd.wrong_type("train", key, "\"all\", \"none\" or a number in [0, 1]");
  };
  layer_fraction("recompute", r.recompute);
  layer_fraction("offload", r.offload);
  r.recompute_vision = rd.boolean("train", "recompute_vision").value_or(false);
  if (r.recompute + r.offload > 1 + 1e-9)
    rd.fail("train", "offload",
            fmt::format("recompute = {} and offload = {} add up to more than every layer",
                        r.recompute, r.offload),
            fmt::format("the first layers are recomputed and the next offloaded: lower recompute "
                        "to {} or less (recompute = \"none\" with offload = \"all\" offloads "
                        "every layer)",
                        std::max(0.0, 1 - r.offload)));
  if (auto v = rd.choice("train", "on_nonfinite", {"skip", "stop"}))
    r.on_nonfinite = *v == "stop" ? NonFinitePolicy::kStop : NonFinitePolicy::kSkip;
  r.ep_size = rd.integer("train", "ep_size", 1, 1'000'000).value_or(1);
  r.sp_size = rd.integer("train", "sp_size", 1, 1'000'000).value_or(1);
  r.fsdp = rd.boolean("train", "fsdp").value_or(false);
  if (auto v = rd.choice("train", "fp8", {"none", "tilewise"})) r.fp8_tilewise = *v == "tilewise";
  if (auto v = rd.choice("train", "frozen_weights", {"bf16", "fp8"})) r.frozen_fp8 = *v == "fp8";
  if (const toml::node* n = rd.find("train", "freeze")) {
    if (!n->is_array()) rd.wrong_type("train", "freeze", "an array of regular expressions");
    r.freeze = rd.strings("train", "freeze");
    for (const std::string& pattern : r.freeze)
      rd.check_regex("train", "freeze", pattern,
                     "write an ECMAScript regular expression; in TOML a literal dot is \"\\\\.\" "
                     "(or '\\.' in a literal string)");
  }
  r.dist_timeout_s =
      rd.number("train", "dist_timeout", 0.0, std::numeric_limits<double>::infinity(), true)
          .value_or(600);
}

// [optimizer].
void parse_optimizer(const Reader& rd, Recipe& r) {
  const double inf = std::numeric_limits<double>::infinity();
  r.lr = rd.number("optimizer", "lr", 0.0, inf, true).value_or(1e-6);
  if (auto v = rd.number("optimizer", "lr_min", 0.0, inf)) {
    if (*v > r.lr)
      rd.fail("optimizer", "lr_min",
              fmt::format("lr_min = {} is above lr = {}: the cosine would rise", *v, r.lr),
              "set optimizer.lr_min to at most optimizer.lr");
    r.lr_min = *v;
  } else {
    // The reference trainer's default 1e-6, but never above the peak of a run with a smaller lr.
    r.lr_min = std::min(1e-6, r.lr);
  }
  r.warmup_steps = rd.integer("optimizer", "warmup_steps", 0);
  if (auto v = rd.number("optimizer", "warmup_ratio", 0.0, 1.0, false, true)) {
    if (r.warmup_steps)
      rd.fail("optimizer", "warmup_ratio", "warmup_steps and warmup_ratio are both set",
              "keep one of optimizer.warmup_steps and optimizer.warmup_ratio");
    r.warmup_ratio = *v;
  }
  if (r.warmup_steps && r.total_steps && *r.warmup_steps >= *r.total_steps)
    rd.fail("optimizer", "warmup_steps",
            fmt::format("a warmup of {} steps does not fit a run of {} steps", *r.warmup_steps,
                        *r.total_steps),
            "make optimizer.warmup_steps smaller than train.total_steps");
  if (const toml::node* n = rd.find("optimizer", "betas")) {
    const toml::array* a = n->as_array();
    if (!a || a->size() != 2 || !(*a)[0].is_number() || !(*a)[1].is_number())
      rd.fail("optimizer", "betas",
              fmt::format("expected an array of two numbers, got {}",
                          a ? fmt::format("an array of {} entries", a->size()) : type_name(*n)),
              rd.example_fix("optimizer", "betas"));
    auto as_double = [](const toml::node& e) {
      const double v =
          e.is_integer() ? double(e.as_integer()->get()) : e.as_floating_point()->get();
      return v == 0 ? 0.0 : v;  // -0.0 is 0, as in number()
    };
    const double b[2] = {as_double((*a)[0]), as_double((*a)[1])};
    for (int i = 0; i < 2; ++i)
      rd.check_range("optimizer", "betas", b[i], 0.0, 1.0, false, true,
                     fmt::format("beta{}", i + 1));
    r.beta1 = b[0];
    r.beta2 = b[1];
  }
  r.eps = rd.number("optimizer", "eps", 0.0, inf, true).value_or(1e-8);
  r.weight_decay = rd.number("optimizer", "weight_decay", 0.0, inf).value_or(0.01);
  if (r.lr * r.weight_decay >= 1.0)
    rd.fail("optimizer", "weight_decay",
            fmt::format("lr · weight_decay = {} would flip the sign of every weight",
                        r.lr * r.weight_decay),
            "lower optimizer.weight_decay (the default is 0.01)");
  r.clip_grad_norm = rd.number("optimizer", "clip_grad_norm", 0.0, inf).value_or(1.0);
}

// [loss] and [output].
void parse_loss_and_output(const Reader& rd, Recipe& r, const MissingKey& missing) {
  const double inf = std::numeric_limits<double>::infinity();
  // [loss]
  r.mtp_scale = rd.number("loss", "mtp_scale", 0.0, inf).value_or(0.1);
  r.balancing_alpha = rd.number("loss", "balancing_alpha", 0.0, inf).value_or(0.001);
  r.router_bias_update_rate =
      rd.number("loss", "router_bias_update_rate", 0.0, inf).value_or(0.001);

  // [output]
  if (auto v = rd.string("output", "dir"))
    r.output_dir = *v;
  else
    missing("output", "dir");
  r.save_every = rd.integer("output", "save_every", 0).value_or(200);
  r.keep_last = rd.integer("output", "keep_last", 0).value_or(3);
  r.log_every = rd.integer("output", "log_every", 1).value_or(1);
}

// [lora], when present.
void parse_lora(const Reader& rd, const toml::table& t, Recipe& r) {
  if (!t.get("lora")) return;
  model::LoraConfig c;
  c.rank = rd.integer("lora", "rank", 1, 65536).value_or(8);
  c.alpha = rd.number("lora", "alpha", 0.0, std::numeric_limits<double>::infinity())
                .value_or(double(c.rank));
  c.dropout = rd.number("lora", "dropout", 0.0, 1.0, false, true).value_or(0.0);
  c.use_rslora = rd.boolean("lora", "use_rslora").value_or(false);
  if (c.dropout != 0 && rd.find("lora", "target_parameters"))
    rd.fail("lora", "dropout",
            "adapters on the routed experts (target_parameters) take no dropout, as in PEFT",
            "write dropout = 0, or leave target_parameters out");
  if (const toml::node* p = rd.find("lora", "target_parameters")) {
    if (!p->is_array())
      rd.fail("lora", "target_parameters",
              fmt::format("expected an array of parameter names, got {}", type_name(*p)),
              rd.example_fix("lora", "target_parameters"));
    c.target_parameters = rd.strings("lora", "target_parameters");
  }
  const toml::node* n = rd.find("lora", "target_modules");
  // As in PEFT, target_parameters alone is enough (target_modules absent or []).
  const bool parameters_only =
      !c.target_parameters.empty() && (!n || (n->is_array() && n->as_array()->empty()));
  if (!n && !parameters_only)
    rd.fail("lora", "target_modules", "missing: an adapter needs the projections it goes on",
            rd.example_fix("lora", "target_modules"));
  if (parameters_only) {
  } else if (n->is_string()) {
    c.target_regex = n->as_string()->get();
    rd.check_regex("lora", "target_modules", c.target_regex,
                   "write an ECMAScript regular expression, or an array of module names");
  } else if (n->is_array() && !n->as_array()->empty()) {
    c.target_modules = rd.strings("lora", "target_modules");
  } else {
    rd.fail("lora", "target_modules",
            fmt::format("expected a non-empty array of module names or a regular expression, "
                        "got {}",
                        type_name(*n)),
            rd.example_fix("lora", "target_modules"));
  }
  if (auto base = rd.choice("lora", "base", {"bf16", "fp8"})) c.fp8_base = *base == "fp8";
  if (r.frozen_fp8)
    rd.fail("train", "frozen_weights",
            "frozen_weights = \"fp8\" with [lora]: under [lora] the whole base is frozen, and "
            "lora.base says how it is held",
            "write base = \"fp8\" under [lora] and drop train.frozen_weights");
  r.lora = c;
}

}  // namespace

void Recipe::parse_doc() {
  const toml::table& t = doc_->table;
  const Reader rd(t, doc_->overrides, source_);
  check_known_keys(t, rd);
  Recipe r;  // fresh defaults; copied over *this at the end so a failure changes nothing
  r.source_ = source_;
  const MissingKey missing = [&](const char* section, const char* key) {
    const KeySpec* k = find_key(*find_section(section), key);
    throw Error(fmt::format("missing required key {}.{}", section, key), source_,
                fmt::format("add `{} = {}` under [{}]", key, k->example, section));
  };
  parse_model(rd, r, missing);
  parse_data(rd, r);
  parse_train(rd, r);
  parse_optimizer(rd, r);
  parse_loss_and_output(rd, r, missing);
  parse_lora(rd, t, r);
  r.doc_ = doc_;
  *this = std::move(r);
}

void Recipe::set(const std::string& dotted_key, const std::string& value) {
  Recipe next = *this;
  next.insert_override(dotted_key, value);
  next.parse_doc();
  *this = std::move(next);
}

void Recipe::insert_override(const std::string& dotted_key, const std::string& value) {
  const std::string flag = "--set " + dotted_key;
  const auto dot = dotted_key.find('.');
  if (dot == std::string::npos || dot == 0 || dot + 1 == dotted_key.size() ||
      dotted_key.find('.', dot + 1) != std::string::npos)
    throw Error(fmt::format("'{}' is not a section.key name", dotted_key), flag,
                "write --set section.key=value, e.g. --set optimizer.lr=1e-5");
  const std::string section = dotted_key.substr(0, dot), key = dotted_key.substr(dot + 1);
  toml::table parsed;
  bool is_toml = true;
  try {
    const std::string text = "v = " + value;
    parsed = toml::parse(std::string_view(text), std::string_view("--set"));
  } catch (const toml::parse_error&) {
    is_toml = false;
  }
  // A default-constructed recipe has no document yet: --set then starts from an empty one.
  auto doc = doc_ ? std::make_shared<Doc>(*doc_) : std::make_shared<Doc>();
  toml::node* sec = doc->table.get(section);
  if (!sec) {
    doc->table.insert_or_assign(section, toml::table{});
    sec = doc->table.get(section);
  }
  if (!sec->is_table())
    throw Error(fmt::format("'{}' is not a section of the recipe", section), flag,
                "write --set section.key=value, e.g. --set optimizer.lr=1e-5");
  toml::table& target = *sec->as_table();
  if (is_toml && parsed.size() == 1 && parsed.get("v")) {
    parsed.get("v")->visit([&](auto& node) { target.insert_or_assign(key, node); });
  } else {
    target.insert_or_assign(key, value);
  }
  doc->overrides[dotted_key] = flag;
  doc_ = std::move(doc);
}

void Recipe::apply_sets(const std::vector<std::string>& key_values) {
  // Every override first, then one validation: keys that constrain each other (a pack length and
  // the sample length it must hold, a warmup and the run length) may come in any order.
  Recipe next = *this;
  for (const auto& kv : key_values) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error(fmt::format("expected section.key=value, got '{}'", kv), "--set",
                  "write e.g. --set optimizer.lr=1e-5");
    next.insert_override(kv.substr(0, eq), kv.substr(eq + 1));
  }
  if (key_values.empty()) return;
  next.parse_doc();
  *this = std::move(next);
}

data::DatasetConfig Recipe::dataset_config() const {
  data::DatasetConfig c;
  c.files = data_files;
  c.format = data_format;
  c.max_length = max_length;
  c.on_bad_line = on_bad_line;
  c.on_overlong = on_overlong;
  return c;
}

data::PackingConfig Recipe::packing_config(int32_t pad_id) const {
  return {.pack_max_length = pack_max_length,
          .lookahead = pack_lookahead,
          .shuffle = shuffle,
          .seed = seed,
          .pad_id = pad_id};
}

AdamWConfig Recipe::adamw_config() const {
  return {.beta1 = beta1,
          .beta2 = beta2,
          .eps = eps,
          .weight_decay = weight_decay,
          .max_grad_norm = clip_grad_norm};
}

int64_t Recipe::resolve_total_steps(int64_t packs_per_epoch, int64_t data_parallel_ranks) const {
  if (total_steps) return *total_steps;
  GLMTUNE_ASSERT(packs_per_epoch >= 1 && data_parallel_ranks >= 1,
                 "packs_per_epoch {} / data_parallel_ranks {}", packs_per_epoch,
                 data_parallel_ranks);
  const double packs_per_step = double(micro_packs) * double(data_parallel_ranks);
  const double steps = std::ceil(*epochs * double(packs_per_epoch) / packs_per_step - 1e-9);
  // From 2^63 on the conversion to int64 is undefined (on x86 it gives a run of one step).
  if (!(steps < 9223372036854775808.0))
    throw Error(fmt::format("train.epochs = {} over {} packs per epoch is {} optimizer steps, more "
                            "than a run can count",
                            *epochs, packs_per_epoch, steps),
                source_ + ": train.epochs", "lower train.epochs, or set train.total_steps");
  return std::max<int64_t>(1, int64_t(steps));
}

int64_t Recipe::resolve_warmup_steps(int64_t total) const {
  if (warmup_steps) return *warmup_steps;
  return warmup_steps_from_ratio(warmup_ratio, total);
}

Schedule Recipe::schedule(int64_t total) const {
  return Schedule(lr, lr_min, resolve_warmup_steps(total), total);
}

std::string Recipe::to_toml() const {
  // Written by hand rather than with toml++'s formatter: keys in the documented order, and
  // numbers in their shortest exact form (1e-05, not 1.0000000000000001e-05).
  auto str = [](const std::string& v) { return nlohmann::json(v).dump(); };  // valid TOML too
  auto num = [](double v) { return fmt::format("{}", v); };
  std::string files;
  for (const auto& f : data_files) files += (files.empty() ? "" : ", ") + str(f);
  std::string out;
  out += "[model]\n";
  out += "path = " + str(model_path) + "\n";
  out += "tokenizer = " + str(tokenizer_path) + "\n";
  out +=
      fmt::format("freeze_vision = {}\nfreeze_projector = {}\n", freeze_vision, freeze_projector);
  out += "\n[data]\n";
  if (data_cache.empty())
    out += "files = [" + files + "]\n";
  else
    out += "cache = " + str(data_cache) + "\n";
  out += "format = " + str(format_name(data_format)) + "\n";
  out += "on_bad_line = " + str(bad_line_name(on_bad_line)) + "\n";
  out += "on_overlong = " + str(overlong_name(on_overlong)) + "\n";
  out += fmt::format("max_length = {}\n", max_length);
  out += fmt::format("pack_max_length = {}\n", pack_max_length);
  out += fmt::format("pack_lookahead = {}\n", pack_lookahead);
  out += fmt::format("shuffle = {}\n", shuffle);
  if (!media_root.empty()) out += "media_root = " + str(media_root) + "\n";
  out += "\n[train]\n";
  if (total_steps) out += fmt::format("total_steps = {}\n", *total_steps);
  if (epochs) out += "epochs = " + num(*epochs) + "\n";
  out += fmt::format("micro_packs = {}\n", micro_packs);
  out += fmt::format("seed = {}\n", seed);
  out += "device = " + str(device.str()) + "\n";
  out += "recompute = " +
         (recompute == 1.0   ? str("all")
          : recompute == 0.0 ? str("none")
                             : num(recompute)) +
         "\n";
  out += "offload = " +
         (offload == 1.0   ? str("all")
          : offload == 0.0 ? str("none")
                           : num(offload)) +
         "\n";
  out += fmt::format("recompute_vision = {}\n", recompute_vision);
  out += "on_nonfinite = " + str(on_nonfinite == NonFinitePolicy::kStop ? "stop" : "skip") + "\n";
  out += fmt::format("ep_size = {}\n", ep_size);
  out += fmt::format("sp_size = {}\n", sp_size);
  out += fmt::format("fsdp = {}\n", fsdp);
  if (!freeze.empty()) {
    std::string patterns;
    for (const auto& f : freeze) patterns += (patterns.empty() ? "" : ", ") + str(f);
    out += "freeze = [" + patterns + "]\n";
  }
  out += "dist_timeout = " + num(dist_timeout_s) + "\n";
  if (fp8_tilewise) out += "fp8 = \"tilewise\"\n";
  if (frozen_fp8) out += "frozen_weights = \"fp8\"\n";
  out += "\n[optimizer]\n";
  out += "lr = " + num(lr) + "\n";
  out += "lr_min = " + num(lr_min) + "\n";
  if (warmup_steps)
    out += fmt::format("warmup_steps = {}\n", *warmup_steps);
  else
    out += "warmup_ratio = " + num(warmup_ratio) + "\n";
  out += "betas = [" + num(beta1) + ", " + num(beta2) + "]\n";
  out += "eps = " + num(eps) + "\n";
  out += "weight_decay = " + num(weight_decay) + "\n";
  out += "clip_grad_norm = " + num(clip_grad_norm) + "\n";
  out += "\n[loss]\n";
  out += "mtp_scale = " + num(mtp_scale) + "\n";
  out += "balancing_alpha = " + num(balancing_alpha) + "\n";
  out += "router_bias_update_rate = " + num(router_bias_update_rate) + "\n";
  out += "\n[output]\n";
  out += "dir = " + str(output_dir) + "\n";
  out += fmt::format("save_every = {}\n", save_every);
  out += fmt::format("keep_last = {}\n", keep_last);
  out += fmt::format("log_every = {}\n", log_every);
  if (lora) {
    out += "\n[lora]\n";
    out += fmt::format("rank = {}\n", lora->rank);
    out += "alpha = " + num(lora->alpha) + "\n";
    out += "dropout = " + num(lora->dropout) + "\n";
    out += fmt::format("use_rslora = {}\n", lora->use_rslora);
    if (!lora->target_regex.empty()) {
      out += "target_modules = " + str(lora->target_regex) + "\n";
    } else {
      std::string targets;
      for (const auto& m : lora->target_modules) targets += (targets.empty() ? "" : ", ") + str(m);
      out += "target_modules = [" + targets + "]\n";
    }
    if (!lora->target_parameters.empty()) {
      std::string params;
      for (const auto& p : lora->target_parameters) params += (params.empty() ? "" : ", ") + str(p);
      out += "target_parameters = [" + params + "]\n";
    }
    out += fmt::format("base = \"{}\"\n", lora->fp8_base ? "fp8" : "bf16");
  }
  return out;
}

std::string Recipe::fingerprint(int64_t data_parallel_ranks) const {
  // Doubles go through nlohmann's shortest round-trip printing, so equal values hash equally.
  nlohmann::json j = {
      {"data",
       {{"format", format_name(data_format)},
        {"on_bad_line", bad_line_name(on_bad_line)},
        {"on_overlong", overlong_name(on_overlong)},
        {"max_length", max_length},
        {"pack_max_length", pack_max_length},
        {"pack_lookahead", pack_lookahead},
        {"shuffle", shuffle}}},
      {"train",
       {{"total_steps", total_steps ? nlohmann::json(*total_steps) : nlohmann::json()},
        {"epochs", epochs ? nlohmann::json(*epochs) : nlohmann::json()},
        // Packs per step over every data-parallel rank, under the key single-process runs have
        // always hashed (their fingerprints stay as they were).
        {"micro_packs", micro_packs * std::max<int64_t>(data_parallel_ranks, 1)},
        {"seed", seed}}},
      {"optimizer",
       {{"lr", lr},
        {"lr_min", lr_min},
        {"warmup_steps", warmup_steps ? nlohmann::json(*warmup_steps) : nlohmann::json()},
        {"warmup_ratio", warmup_ratio},
        {"betas", {beta1, beta2}},
        {"eps", eps},
        {"weight_decay", weight_decay},
        {"clip_grad_norm", clip_grad_norm}}},
      {"loss",
       {{"mtp_scale", mtp_scale},
        {"balancing_alpha", balancing_alpha},
        {"router_bias_update_rate", router_bias_update_rate}}},
  };
  // What is trained changes the run; recipes without freezing keep the fingerprints they had.
  if (!freeze.empty()) j["train"]["freeze"] = freeze;
  // So is the GEMMs' precision; bf16 recipes keep the fingerprints they had.
  if (fp8_tilewise) j["train"]["fp8"] = "tilewise";
  if (lora)
    j["lora"] = {{"rank", lora->rank},
                 {"alpha", lora->alpha},
                 {"use_rslora", lora->use_rslora},
                 {"dropout", lora->dropout},
                 {"target_modules", lora->target_modules},
                 {"target_regex", lora->target_regex}};
  // Recipes without expert adapters keep the fingerprints they had.
  if (lora && !lora->target_parameters.empty())
    j["lora"]["target_parameters"] = lora->target_parameters;
  return fmt::format("{:016x}", fnv1a64(j.dump()));
}

}  // namespace glmtune::train
