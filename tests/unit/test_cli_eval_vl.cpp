// `glmtune eval --media-root` on vision-language conversations, end to end through the binary: the
// bundled examples/tiny-vl data (real images and a short video) on a `glmtune init --preset tiny`
// checkpoint. The reported loss must equal the library's composed forward on the same packs (so
// the tower's features really reach the text model), the dumped logits and gradients must be the
// library's too (the vision tower's under its released names), text-only data must be unaffected
// by --media-root, and broken or missing media must be errors naming the file and the line.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "glmtune/data/media/vl_processor.h"
#include "glmtune/data/packing.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/compose.h"
#include "glmtune/model/config.h"
#include "glmtune/model/layout.h"
#include "glmtune/model/param_store.h"
#include "glmtune/train/vl_batch.h"
#include "support/temp_dir.h"

using namespace glmtune;
namespace fs = std::filesystem;
using glmtune::test::TempDir;

namespace {

const fs::path kExample = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny-vl";
const fs::path kProcessor = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny" / "tokenizer";
const std::string kChat = (kExample / "chat.jsonl").string();

struct Result {
  int code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
  nlohmann::json json() const { return nlohmann::json::parse(out); }
};

Result run(const std::string& args, const TempDir& dir) {
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd =
      std::string(GLMTUNE_BINARY) + " " + args + " > " + out.string() + " 2> " + err.string();
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, test::read_text(out), test::read_text(err)};
}

// One tiny checkpoint for every test, made by the CLI; processor_config.json is not part of what
// `init --tokenizer` copies, so the runs pass --tokenizer unless a test says otherwise.
struct Checkpoint {
  TempDir dir{"eval-vl"};
  fs::path model = dir / "model";
  Checkpoint() {
    const Result r = run("init --preset tiny --seed 11 --out " + model.string() + " --tokenizer " +
                             kProcessor.string(),
                         dir);
    if (r.code != 0) throw std::runtime_error("glmtune init failed: " + r.err);
  }
  std::string eval(const std::string& args) const {
    return "eval --model " + model.string() + " " + args;
  }
};

const Checkpoint& checkpoint() {
  static Checkpoint c;
  return c;
}

// The library side: the same data, model and packs as the command builds them.
struct Library {
  data::media::VlProcessor processor = data::media::VlProcessor::from_dir(kProcessor);
  std::unique_ptr<train::VlDataset> dataset;
  std::unique_ptr<model::ParamStore> store;
  std::unique_ptr<model::VisionLanguageModel> model;
  int32_t pad_id = 0;

  Library() {
    train::VlDataConfig dc;
    dc.files = {kChat};
    dc.media_root = kExample;
    dc.max_length = std::numeric_limits<int64_t>::max();
    dataset = std::make_unique<train::VlDataset>(train::VlDataset::scan(dc, processor));
    const fs::path dir = checkpoint().model;
    const model::ModelConfig config = model::ModelConfig::from_file((dir / "config.json").string());
    store = std::make_unique<model::ParamStore>(
        model::ParamStore::load(io::CheckpointReader::open(dir), config));
    model = std::make_unique<model::VisionLanguageModel>(*store);
    pad_id = processor.tokenizer().require_id("<|endoftext|>");
  }

  // eval's packing: samples in file order through plan_packs (lookahead 100), padded to the pack
  // length; a sample longer than that alone in an unpadded pack.
  std::vector<data::Pack> packs(int64_t length) const {
    std::vector<int64_t> order, alone;
    for (int64_t i = 0; i < dataset->size(); ++i)
      (dataset->length(i) <= length ? order : alone).push_back(i);
    std::vector<data::Pack> out;
    for (const auto& idx : data::plan_packs(
             order, [&](int64_t i) { return dataset->length(i); }, length, 100))
      out.push_back(data::build_pack(dataset->load(idx), idx, length, pad_id));
    for (int64_t i : alone) out.push_back(single(i));
    return out;
  }
  data::Pack single(int64_t i) const {
    return data::build_pack(dataset->load({i}), {i}, dataset->length(i), pad_id);
  }

  static model::text::PackInput input(const data::Pack& pack) {
    model::text::PackInput in;
    in.input_ids = Tensor::from_vector(pack.input_ids, {int64_t(pack.input_ids.size())});
    in.cu_seqlens = Tensor::from_vector(pack.cu_seqlens, {int64_t(pack.cu_seqlens.size())});
    in.labels = Tensor::from_vector(pack.labels, {int64_t(pack.labels.size())});
    in.padding_tokens = pack.num_padding;
    return in;
  }

  // The LM cross-entropy of `pack` (sum, count) through compose_forward, with its media or, with
  // `text_only`, with the <|image|> tokens' own embeddings.
  model::text::LossStats loss(const data::Pack& pack, bool text_only = false) const {
    model::text::ForwardOptions o;
    o.logits = false;
    o.mtp = false;
    const model::PackMedia media =
        text_only ? model::PackMedia{} : train::pack_media(*dataset, pack);
    return *model::compose_forward(*model, input(pack), media, o).lm;
  }
};

const Library& library() {
  static Library l;
  return l;
}

// max |a − ref| / max |ref|.
double rel_err(const Tensor& a, const Tensor& ref) {
  const std::vector<double> x = a.to_doubles(), y = ref.to_doubles();
  EXPECT_EQ(x.size(), y.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

}  // namespace

TEST(CliEvalVl, LossEqualsComposedForwardOnTheSamePacks) {
  const Checkpoint& c = checkpoint();
  const Library& lib = library();
  // 160 tokens: several packs, and the 197-token conversation (two media) in a pack of its own.
  const int64_t length = 160;
  const Result r = run(c.eval("--tokenizer " + kProcessor.string() + " --data " + kChat +
                              " --media-root " + kExample.string() + " --pack-length 160 --json"),
                       c.dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = r.json();

  const std::vector<data::Pack> packs = lib.packs(length);
  bool alone = false;
  for (const data::Pack& p : packs) alone |= int64_t(p.input_ids.size()) > length;
  ASSERT_TRUE(alone) << "the data should have a conversation longer than the pack";
  double sum = 0;
  int64_t count = 0;
  for (const data::Pack& p : packs) {
    const auto s = lib.loss(p);
    sum += s.sum;
    count += s.count;
  }
  EXPECT_EQ(j.at("tokens").get<int64_t>(), count);
  EXPECT_NEAR(j.at("loss").get<double>(), sum / double(count), 1e-6 * sum / double(count));
  EXPECT_NEAR(j.at("perplexity").get<double>(), std::exp(sum / double(count)),
              1e-5 * std::exp(sum / double(count)));
  EXPECT_EQ(j.at("packs").get<int64_t>(), int64_t(packs.size()));
  EXPECT_EQ(j.at("samples").get<int64_t>(), 6);
  EXPECT_EQ(j.at("images").get<int64_t>(), 6);
  EXPECT_EQ(j.at("videos").get<int64_t>(), 2);
  EXPECT_FALSE(j.at("mtp_loss").is_null());

  // The media matter: without the tower's features the first pack's loss is another number.
  const auto text_only = lib.loss(packs[0], /*text_only=*/true);
  const auto with_media = lib.loss(packs[0]);
  EXPECT_GT(std::abs(text_only.mean() - with_media.mean()), 1e-4);

  // Per sample: the loss of the conversation evaluated alone, and its line.
  const auto& per = j.at("per_sample");
  ASSERT_EQ(per.size(), 6u);
  for (int64_t i = 0; i < 6; ++i) {
    const auto s = lib.loss(lib.single(i));
    EXPECT_EQ(per[size_t(i)].at("tokens").get<int64_t>(), s.count) << i;
    EXPECT_NEAR(per[size_t(i)].at("loss").get<double>(), s.mean(), 1e-5) << i;
    EXPECT_EQ(per[size_t(i)].at("source").get<std::string>(), kChat + ":" + std::to_string(i + 1));
    EXPECT_EQ(per[size_t(i)].at("length").get<int64_t>(), lib.dataset->length(i));
  }

  // The text summary names the media too.
  const Result text = run(c.eval("--tokenizer " + kProcessor.string() + " --data " + kChat +
                                 " --media-root " + kExample.string()),
                          c.dir);
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_CONTAINS(text.out, "6 images, 2 videos");
}

TEST(CliEvalVl, ProcessorConfigComesFromTheModelFolderByDefault) {
  TempDir dir("eval-vl-proc");
  const fs::path model = dir / "model";
  ASSERT_EQ(run("init --preset tiny --seed 11 --out " + model.string() + " --tokenizer " +
                    kProcessor.string(),
                dir)
                .code,
            0);
  // init --tokenizer copies the processor settings along with the tokenizer files.
  ASSERT_TRUE(fs::exists(model / "processor_config.json"));
  fs::remove(model / "processor_config.json");
  const std::string args = "eval --model " + model.string() + " --data " + kChat +
                           " --media-root " + kExample.string() + " --json";
  const Result missing = run(args, dir);
  EXPECT_NE(missing.code, 0);
  EXPECT_CONTAINS(missing.err, "processor_config.json");
  EXPECT_CONTAINS(missing.err, "--tokenizer");
  fs::copy_file(kProcessor / "processor_config.json", model / "processor_config.json");
  const Result ok = run(args, dir);
  ASSERT_EQ(ok.code, 0) << ok.err;
  // Same seed, same data: the loss of the checkpoint with --tokenizer.
  const Result with_flag =
      run(checkpoint().eval("--tokenizer " + kProcessor.string() + " --data " + kChat +
                            " --media-root " + kExample.string() + " --json"),
          dir);
  ASSERT_EQ(with_flag.code, 0) << with_flag.err;
  EXPECT_EQ(ok.json().at("loss").get<double>(), with_flag.json().at("loss").get<double>());
}

TEST(CliEvalVl, DumpLogitsAndGradsIncludeTheVisionTower) {
  const Checkpoint& c = checkpoint();
  const Library& lib = library();
  TempDir dir("eval-vl-dump");
  const fs::path logits_file = dir / "logits.safetensors", grads_file = dir / "grads.safetensors";
  const Result r =
      run(c.eval("--tokenizer " + kProcessor.string() + " --data " + kChat + " --media-root " +
                 kExample.string() + " --pack-length 160 --json --dump-logits " +
                 logits_file.string() + " --dump-grads " + grads_file.string()),
          dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = r.json();
  const int64_t tokens = j.at("tokens").get<int64_t>();

  // Logits: one [len, vocab] tensor per conversation whose cross-entropy is the reported loss.
  const io::SafetensorsFile logits = io::SafetensorsFile::open(logits_file);
  const int64_t vocab = lib.model->text().text().vocab_size;
  for (int64_t i = 0; i < lib.dataset->size(); ++i) {
    const Tensor l = logits.tensor("logits." + std::to_string(i));
    ASSERT_EQ(l.shape(), (Shape{lib.dataset->length(i), vocab})) << i;
    const std::vector<double> v = l.to_doubles();
    const std::vector<int32_t> labels = lib.dataset->load({i})[0].labels;
    double sum = 0;
    int64_t n = 0;
    for (int64_t row = 0; row + 1 < int64_t(labels.size()); ++row) {
      const int32_t target = labels[size_t(row + 1)];
      if (target == data::kIgnoreIndex) continue;
      const double* x = v.data() + row * vocab;
      double mx = x[0];
      for (int64_t k = 1; k < vocab; ++k) mx = std::max(mx, x[k]);
      double z = 0;
      for (int64_t k = 0; k < vocab; ++k) z += std::exp(x[k] - mx);
      sum += std::log(z) + mx - x[target];
      ++n;
    }
    EXPECT_NEAR(sum / double(n), j.at("per_sample")[size_t(i)].at("loss").get<double>(), 1e-5) << i;
  }

  // Gradients: the library's composed forward and backward of the same packs, summed, divided by
  // the label tokens.
  model::text::TextGrads text_grads =
      model::text::TextGrads::zeros_like(lib.model->text().weights());
  model::vision::VisionGrads vision_grads =
      model::vision::VisionGrads::zeros_like(lib.model->vision());
  model::text::TrainOptions t;
  t.mtp = false;
  t.balancing_alpha = 0;
  t.lm_denominator = 1;
  int64_t count = 0;
  for (const data::Pack& p : lib.packs(160)) {
    const auto s = model::compose_forward_backward(*lib.model, Library::input(p),
                                                   train::pack_media(*lib.dataset, p), t, {},
                                                   text_grads, vision_grads);
    count += s.backward.lm_tokens;
  }
  ASSERT_EQ(count, tokens);
  const io::SafetensorsFile grads = io::SafetensorsFile::open(grads_file);
  int64_t visual = 0;
  for (const model::ParamSpec& spec : model::released_layout(lib.store->config()))
    if (spec.name.starts_with("model.visual.")) {
      ++visual;
      ASSERT_TRUE(grads.contains(spec.name)) << spec.name;
      EXPECT_EQ(grads.tensor(spec.name).shape(), spec.shape) << spec.name;
    }
  EXPECT_GT(visual, 10);
  int64_t compared = 0;
  for (const auto& [name, g] : vision_grads.released(lib.model->vision_config())) {
    ASSERT_TRUE(grads.contains(name)) << name;
    const Tensor dumped = grads.tensor(name);
    EXPECT_EQ(dumped.dtype(), DType::f32) << name;
    Tensor mean = g.to(DType::f64).contiguous();
    for (double& x : std::span(mean.data<double>(), size_t(mean.numel()))) x /= double(count);
    EXPECT_LE(rel_err(dumped, mean), 1e-5) << name;
    EXPECT_GT(rel_err(dumped, Tensor::zeros(dumped.shape(), DType::f32)), 0) << name << " is zero";
    ++compared;
  }
  EXPECT_EQ(compared, visual);
  // The token embeddings: the text rows only (the media rows' lookups were replaced).
  const std::string embed = "model.language_model.embed_tokens.weight";
  const Tensor* g = text_grads.find(embed);
  ASSERT_NE(g, nullptr);
  Tensor mean = g->to(DType::f64).contiguous();
  for (double& x : std::span(mean.data<double>(), size_t(mean.numel()))) x /= double(count);
  EXPECT_LE(rel_err(grads.tensor(embed), mean), 1e-5);
}

TEST(CliEvalVl, TextOnlyDataIsUnchangedByMediaRoot) {
  const Checkpoint& c = checkpoint();
  TempDir dir("eval-vl-text");
  test::write_text(dir / "chat.jsonl",
                   R"({"messages": [{"role": "user", "content": "Name a colour."}, )"
                   R"({"role": "assistant", "content": "Blue, like the sky."}]})"
                   "\n"
                   R"({"messages": [{"role": "user", "content": [{"type": "text", "text": )"
                   R"("Count to three."}]}, {"role": "assistant", "content": "One, two, three."}]})"
                   "\n");
  test::write_text(dir / "text.jsonl", R"({"text": "A short line of plain text to score."})"
                                       "\n");
  const std::string chat = (dir / "chat.jsonl").string(), text = (dir / "text.jsonl").string();
  const std::string tok = " --tokenizer " + kProcessor.string();
  const Result plain = run(c.eval("--data " + chat + " --json"), dir);
  ASSERT_EQ(plain.code, 0) << plain.err;
  const Result vl =
      run(c.eval(tok + " --data " + chat + " --media-root " + kExample.string() + " --json"), dir);
  ASSERT_EQ(vl.code, 0) << vl.err;
  EXPECT_EQ(vl.json().at("tokens"), plain.json().at("tokens"));
  EXPECT_NEAR(vl.json().at("loss").get<double>(), plain.json().at("loss").get<double>(), 1e-9);
  EXPECT_EQ(vl.json().at("images").get<int64_t>(), 0);

  // Plain-text lines stay with the text reader, next to a VL file in the same run.
  const Result text_only = run(c.eval("--data " + text + " --json"), dir);
  ASSERT_EQ(text_only.code, 0) << text_only.err;
  const Result mixed = run(c.eval(tok + " --data " + text + " " + kChat + " --media-root " +
                                  kExample.string() + " --json"),
                           dir);
  ASSERT_EQ(mixed.code, 0) << mixed.err;
  const nlohmann::json m = mixed.json();
  EXPECT_EQ(m.at("samples").get<int64_t>(), 7);
  EXPECT_EQ(m.at("images").get<int64_t>(), 6);
  EXPECT_NEAR(m.at("per_sample")[0].at("loss").get<double>(),
              text_only.json().at("loss").get<double>(), 1e-9);
}

TEST(CliEvalVl, BadMediaAreErrorsNamingFileAndLine) {
  const Checkpoint& c = checkpoint();
  TempDir dir("eval-vl-bad");
  const std::string tok = " --tokenizer " + kProcessor.string();
  auto line = [](const std::string& image) {
    return R"({"messages": [{"role": "user", "content": [{"type": "image", "image": ")" + image +
           R"("}, {"type": "text", "text": "What is it?"}]}, {"role": "assistant", "content": )"
           R"("A cat."}]})"
           "\n";
  };
  // A missing image: found when the data is read.
  test::write_text(dir / "missing.jsonl", line("media/chelsea.jpg") + line("media/no_such.jpg"));
  const std::string missing_file = (dir / "missing.jsonl").string();
  const Result missing =
      run(c.eval(tok + " --data " + missing_file + " --media-root " + kExample.string()), dir);
  EXPECT_NE(missing.code, 0);
  EXPECT_CONTAINS(missing.err, "no_such.jpg");
  EXPECT_CONTAINS(missing.err, missing_file + ":2");

  // A truncated JPEG whose header reads fine: found when its pack is decoded; the logits file
  // being written is removed.
  fs::create_directories(dir / "media");
  fs::copy_file(kExample / "media" / "chelsea.jpg", dir / "media" / "chelsea.jpg");
  {
    const std::string bytes = test::read_text(kExample / "media" / "chelsea.jpg");
    test::write_text(dir / "media" / "cut.jpg", bytes.substr(0, bytes.size() / 2));
  }
  test::write_text(dir / "cut.jsonl", line("media/chelsea.jpg") + line("media/cut.jpg"));
  const std::string cut_file = (dir / "cut.jsonl").string();
  const fs::path logits = dir / "logits.safetensors";
  const Result cut = run(c.eval(tok + " --data " + cut_file + " --media-root " +
                                dir.path().string() + " --dump-logits " + logits.string()),
                         dir);
  EXPECT_NE(cut.code, 0);
  EXPECT_CONTAINS(cut.err, "cut.jpg");
  EXPECT_CONTAINS(cut.err, cut_file + ":2");
  EXPECT_FALSE(fs::exists(logits));
  for (const auto& entry : fs::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos)
        << "left behind: " << entry.path();

  // Media without --media-root: the text reader is not asked to guess.
  const Result no_root = run(c.eval(tok + " --data " + kChat), dir);
  EXPECT_NE(no_root.code, 0);
  EXPECT_CONTAINS(no_root.err, kChat + ":1");
  EXPECT_CONTAINS(no_root.err, "--media-root");

  // A media root that is not a folder.
  const Result not_dir =
      run(c.eval(tok + " --data " + kChat + " --media-root " + (dir / "nowhere").string()), dir);
  EXPECT_NE(not_dir.code, 0);
  EXPECT_CONTAINS(not_dir.err, "--media-root");
}

TEST(CliEvalVl, ReleasedMediaIdsInASmallVocabularyEvaluateTextAndNameTheKeyForMedia) {
  // The checkpoint with the media ids that transformers writes by default whatever the vocabulary:
  // inspect and text evaluation work as with the tiny preset's ids, and media data is refused
  // before the checkpoint is read, naming the key, its value and the vocabulary.
  const Checkpoint& c = checkpoint();
  TempDir dir("eval-vl-released-ids");
  const fs::path model = dir / "model";
  fs::copy(c.model, model, fs::copy_options::recursive);
  nlohmann::json config = nlohmann::json::parse(test::read_text(model / "config.json"));
  config["image_token_id"] = 154854;
  config["video_token_id"] = 154855;
  config["image_start_token_id"] = 154830;
  config["image_end_token_id"] = 154831;
  config["video_start_token_id"] = 154832;
  config["video_end_token_id"] = 154833;
  test::write_text(model / "config.json", config.dump(2));

  const Result inspect = run("inspect " + model.string(), dir);
  EXPECT_EQ(inspect.code, 0) << inspect.err;
  const std::string text = " --text \"A short line of plain text to score.\" --json";
  const Result ours = run("eval --model " + model.string() + text, dir);
  ASSERT_EQ(ours.code, 0) << ours.err;
  const Result preset = run(c.eval(text), dir);
  ASSERT_EQ(preset.code, 0) << preset.err;
  EXPECT_EQ(ours.json().at("loss"), preset.json().at("loss"));

  const Result media =
      run("eval --model " + model.string() + " --tokenizer " + kProcessor.string() + " --data " +
              kChat + " --media-root " + kExample.string(),
          dir);
  EXPECT_EQ(media.code, 2) << media.err;
  EXPECT_CONTAINS(media.err, "image_token_id");
  EXPECT_CONTAINS(media.err, "154854");
  EXPECT_CONTAINS(media.err, "2048");
}
