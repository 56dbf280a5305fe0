// Packing: pack layout and label alignment, the planner (no sample split, lookahead fill,
// determinism), the portable shuffle, and the epoch-aware sampler's save / restore.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/data/packing.h"

namespace {

using glmtune::data::build_pack;
using glmtune::data::InMemorySamples;
using glmtune::data::kIgnoreIndex;
using glmtune::data::Pack;
using glmtune::data::PackingConfig;
using glmtune::data::PackSampler;
using glmtune::data::plan_packs;
using glmtune::data::shuffled_order;
using glmtune::data::TokenizedSample;

constexpr int32_t kPad = 3;

// Random chat-like documents: the first token never trained (like [gMASK]), later tokens
// trained with probability 1/2, ids never equal to the pad id so padding is recognisable.
std::vector<TokenizedSample> random_docs(uint64_t seed, int n, int min_len, int max_len) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<TokenizedSample> docs;
  for (int d = 0; d < n; ++d) {
    const int len =
        min_len + static_cast<int>(rng() % static_cast<uint64_t>(max_len - min_len + 1));
    TokenizedSample s;
    for (int i = 0; i < len; ++i) {
      const auto id = static_cast<int32_t>(10 + rng() % 1000);
      s.input_ids.push_back(id);
      s.labels.push_back(i > 0 && rng() % 2 ? id : kIgnoreIndex);
    }
    docs.push_back(std::move(s));
  }
  return docs;
}

// Checks every invariant of a pack against the documents it claims to hold.
void check_pack(const Pack& p, const InMemorySamples& src, int64_t L) {
  ASSERT_EQ(static_cast<int64_t>(p.input_ids.size()), L);
  ASSERT_EQ(static_cast<int64_t>(p.labels.size()), L);
  ASSERT_GE(p.cu_seqlens.size(), 2u);
  EXPECT_EQ(p.cu_seqlens.front(), 0);
  EXPECT_EQ(p.cu_seqlens.back(), L);
  for (size_t i = 1; i < p.cu_seqlens.size(); ++i) EXPECT_LT(p.cu_seqlens[i - 1], p.cu_seqlens[i]);
  const size_t ndocs = p.sample_indices.size();
  const bool padded = p.num_padding > 0;
  ASSERT_EQ(p.cu_seqlens.size(), ndocs + 1 + (padded ? 1 : 0));
  int32_t max_len = 0;
  int64_t targets = 0;
  for (size_t d = 0; d < ndocs; ++d) {
    const TokenizedSample& doc = src.at(p.sample_indices[d]);
    const int32_t b = p.cu_seqlens[d], e = p.cu_seqlens[d + 1];
    ASSERT_EQ(static_cast<size_t>(e - b), doc.input_ids.size()) << "document split or resized";
    max_len = std::max(max_len, e - b);
    for (int32_t i = b; i < e; ++i) {
      EXPECT_EQ(p.input_ids[static_cast<size_t>(i)], doc.input_ids[static_cast<size_t>(i - b)]);
      // Target of position i: the next token of the same document if it is trained.
      const int32_t want = i + 1 < e ? doc.labels[static_cast<size_t>(i - b + 1)] : kIgnoreIndex;
      EXPECT_EQ(p.labels[static_cast<size_t>(i)], want) << "position " << i;
      targets += want != kIgnoreIndex;
    }
  }
  if (padded) {
    EXPECT_EQ(p.cu_seqlens[ndocs], L - p.num_padding);
    for (int64_t i = L - p.num_padding; i < L; ++i) {
      EXPECT_EQ(p.input_ids[static_cast<size_t>(i)], kPad);
      EXPECT_EQ(p.labels[static_cast<size_t>(i)], kIgnoreIndex);
    }
    max_len = std::max(max_len, p.num_padding);
  }
  EXPECT_EQ(p.max_seqlen, max_len);
  EXPECT_EQ(p.num_targets, targets);
}

TEST(BuildPack, LayoutLabelsAndPadding) {
  TokenizedSample a{{100, 101, 102, 103}, {kIgnoreIndex, 101, kIgnoreIndex, 103}};
  TokenizedSample b{{200, 201}, {200, 201}};
  Pack p = build_pack({a, b}, {5, 9}, 10, kPad);
  EXPECT_EQ(p.input_ids,
            (std::vector<int32_t>{100, 101, 102, 103, 200, 201, kPad, kPad, kPad, kPad}));
  EXPECT_EQ(p.labels,
            (std::vector<int32_t>{101, kIgnoreIndex, 103, kIgnoreIndex, 201, kIgnoreIndex,
                                  kIgnoreIndex, kIgnoreIndex, kIgnoreIndex, kIgnoreIndex}));
  EXPECT_EQ(p.cu_seqlens, (std::vector<int32_t>{0, 4, 6, 10}));
  EXPECT_EQ(p.num_padding, 4);
  EXPECT_EQ(p.max_seqlen, 4);
  EXPECT_EQ(p.num_targets, 3);
  EXPECT_EQ(p.num_documents(), 3);
  EXPECT_EQ(p.sample_indices, (std::vector<int64_t>{5, 9}));
}

TEST(BuildPack, ExactlyFullHasNoPaddingDocument) {
  TokenizedSample a{{1, 2, 3}, {kIgnoreIndex, 2, 3}};
  Pack p = build_pack({a, a}, {0, 1}, 6, kPad);
  EXPECT_EQ(p.cu_seqlens, (std::vector<int32_t>{0, 3, 6}));
  EXPECT_EQ(p.num_padding, 0);
  EXPECT_EQ(p.labels, (std::vector<int32_t>{2, 3, kIgnoreIndex, 2, 3, kIgnoreIndex}));
}

TEST(BuildPack, PerDocumentShiftEqualsWholePackShiftWhenDocumentsStartIgnored) {
  // Labels are shifted per document; with every document starting with an ignored label (chat
  // samples start with [gMASK]), the reference trainer's whole-pack shift gives the same targets.
  auto docs = random_docs(11, 6, 2, 9);
  std::vector<int64_t> idx(docs.size());
  int64_t total = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    idx[i] = static_cast<int64_t>(i);
    total += static_cast<int64_t>(docs[i].input_ids.size());
  }
  Pack p = build_pack(docs, idx, total + 5, kPad);
  std::vector<int32_t> concat_labels;
  for (const auto& d : docs)
    concat_labels.insert(concat_labels.end(), d.labels.begin(), d.labels.end());
  concat_labels.resize(static_cast<size_t>(total + 5), kIgnoreIndex);
  for (size_t i = 0; i + 1 < concat_labels.size(); ++i)
    EXPECT_EQ(p.labels[i], concat_labels[i + 1]) << i;
}

TEST(BuildPack, RejectsOverfullAndBadPadId) {
  TokenizedSample a{{1, 2, 3}, {1, 2, 3}};
  EXPECT_THROW(build_pack({a, a}, {0, 1}, 5, kPad), glmtune::Error);
  EXPECT_THROW(build_pack({a}, {0}, 5, -1), glmtune::Error);
}

TEST(PlanPacks, LookaheadFillsTheTail) {
  const std::vector<int64_t> len = {6, 6, 4, 3};
  auto length = [&](int64_t i) { return len[static_cast<size_t>(i)]; };
  const std::vector<int64_t> order = {0, 1, 2, 3};
  EXPECT_EQ(plan_packs(order, length, 10, 100),
            (std::vector<std::vector<int64_t>>{{0, 2}, {1, 3}}));
  EXPECT_EQ(plan_packs(order, length, 10, 0),
            (std::vector<std::vector<int64_t>>{{0}, {1, 2}, {3}}));
  // The window is limited to `lookahead` samples after the one that did not fit.
  const std::vector<int64_t> len2 = {6, 6, 5, 4};
  auto length2 = [&](int64_t i) { return len2[static_cast<size_t>(i)]; };
  EXPECT_EQ(plan_packs(order, length2, 10, 1),
            (std::vector<std::vector<int64_t>>{{0}, {1, 3}, {2}}));
  EXPECT_EQ(plan_packs(order, length2, 10, 2),
            (std::vector<std::vector<int64_t>>{{0, 3}, {1}, {2}}));
}

TEST(PlanPacks, EverySampleOnceNeverOverfullDeterministic) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937_64 rng(seed);
    std::vector<int64_t> len(500);
    for (auto& l : len) l = 1 + static_cast<int64_t>(rng() % 256);
    auto length = [&](int64_t i) { return len[static_cast<size_t>(i)]; };
    std::vector<int64_t> order = shuffled_order(500, seed, 0);
    const int64_t L = 256;
    auto packs = plan_packs(order, length, L, 16);
    std::vector<int> seen(500, 0);
    int64_t used = 0;
    for (const auto& pk : packs) {
      ASSERT_FALSE(pk.empty());
      int64_t sum = 0;
      for (int64_t s : pk) {
        ++seen[static_cast<size_t>(s)];
        sum += len[static_cast<size_t>(s)];
      }
      EXPECT_LE(sum, L);
      used += sum;
    }
    for (int c : seen) EXPECT_EQ(c, 1);
    EXPECT_EQ(packs, plan_packs(order, length, L, 16));
    // Soft packing wastes less than greedy packing in order.
    EXPECT_LE(packs.size(), plan_packs(order, length, L, 0).size());
    EXPECT_GT(static_cast<double>(used) / static_cast<double>(packs.size() * L), 0.9);
  }
}

TEST(PlanPacks, SampleLongerThanPackIsAnError) {
  auto length = [](int64_t i) { return i == 2 ? int64_t{11} : int64_t{3}; };
  try {
    plan_packs({0, 1, 2}, length, 10, 4);
    ADD_FAILURE() << "no error";
  } catch (const glmtune::Error& e) {
    EXPECT_EQ(e.problem(), "sample 2 has 11 tokens; a pack holds 10");
    EXPECT_EQ(e.where(), "pack_max_length");
  }
}

TEST(Shuffle, MatchesTheSpecifiedGenerator) {
  // Expected orders from an independent Python implementation of SplitMix64 + Lemire's bounded
  // draw + Fisher-Yates (the algorithm packing.cpp documents), so resumes stay exact across
  // platforms and versions.
  EXPECT_EQ(shuffled_order(10, 0, 0), (std::vector<int64_t>{7, 8, 4, 9, 5, 1, 3, 2, 0, 6}));
  EXPECT_EQ(shuffled_order(10, 0, 1), (std::vector<int64_t>{0, 6, 9, 2, 7, 4, 3, 1, 8, 5}));
  EXPECT_EQ(shuffled_order(12, 1234567890123ull, 3),
            (std::vector<int64_t>{4, 8, 0, 7, 3, 2, 10, 11, 6, 5, 9, 1}));
}

TEST(Shuffle, PermutationAndSeedEpochSensitivity) {
  auto a = shuffled_order(1000, 42, 0);
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) EXPECT_EQ(sorted[static_cast<size_t>(i)], i);
  EXPECT_EQ(a, shuffled_order(1000, 42, 0));
  EXPECT_NE(a, shuffled_order(1000, 42, 1));
  EXPECT_NE(a, shuffled_order(1000, 43, 0));
  EXPECT_TRUE(shuffled_order(0, 1, 0).empty());
  EXPECT_EQ(shuffled_order(1, 1, 0), (std::vector<int64_t>{0}));
}

PackingConfig small_config(uint64_t seed) {
  PackingConfig c;
  c.pack_max_length = 64;
  c.lookahead = 8;
  c.seed = seed;
  c.pad_id = kPad;
  return c;
}

TEST(PackSampler, EpochsCoverEverySampleAndPacksAreValid) {
  InMemorySamples src(random_docs(5, 120, 2, 40));
  PackSampler sampler(src, small_config(9));
  std::vector<std::vector<int64_t>> plans;
  for (int epoch = 0; epoch < 3; ++epoch) {
    ASSERT_EQ(sampler.epoch(), epoch);
    std::multiset<int64_t> seen;
    const int64_t n = sampler.packs_in_epoch();
    ASSERT_GT(n, 0);
    std::vector<int64_t> first_samples;
    for (int64_t k = 0; k < n; ++k) {
      EXPECT_EQ(sampler.epoch(), epoch);
      Pack p = sampler.next();
      check_pack(p, src, 64);
      seen.insert(p.sample_indices.begin(), p.sample_indices.end());
      first_samples.push_back(p.sample_indices.front());
    }
    EXPECT_EQ(seen.size(), 120u);
    EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), 120u);
    plans.push_back(first_samples);
  }
  // After the last pack of epoch 2 the position is already the first pack of epoch 3.
  EXPECT_EQ(sampler.epoch(), 3);
  EXPECT_EQ(sampler.index_in_epoch(), 0);
  sampler.next();
  EXPECT_EQ(sampler.index_in_epoch(), 1);
  EXPECT_NE(plans[0], plans[1]);  // a fresh shuffle each epoch
}

TEST(PackSampler, PeekNamesTheNextPacksWithoutMoving) {
  InMemorySamples src(random_docs(5, 60, 2, 40));
  PackSampler sampler(src, small_config(4));
  const int64_t n = sampler.packs_in_epoch();
  ASSERT_GT(n, 3);
  for (int64_t taken = 0; taken < n + 2; ++taken) {
    const auto ahead = sampler.peek(3);
    // As far as the epoch goes: at its last pack, one; the next epoch is not planned yet.
    const int64_t left = sampler.packs_in_epoch() - sampler.index_in_epoch();
    EXPECT_EQ(int64_t(ahead.size()), std::min<int64_t>(3, left)) << taken;
    const int64_t epoch = sampler.epoch(), index = sampler.index_in_epoch();
    EXPECT_EQ(sampler.peek(3), ahead);  // peeking does not move
    EXPECT_EQ(sampler.epoch(), epoch);
    EXPECT_EQ(sampler.index_in_epoch(), index);
    EXPECT_EQ(sampler.next().sample_indices, ahead.front()) << taken;
  }
  EXPECT_TRUE(sampler.peek(0).empty());
}

TEST(PackSampler, NoShuffleKeepsFileOrder) {
  InMemorySamples src(random_docs(6, 30, 1, 20));
  PackingConfig c = small_config(1);
  c.shuffle = false;
  PackSampler sampler(src, c);
  std::vector<int64_t> identity;
  for (int64_t i = 0; i < 30; ++i) identity.push_back(i);
  auto plan = plan_packs(
      identity, [&](int64_t i) { return src.length(i); }, 64, 8);
  EXPECT_EQ(sampler.plan(), plan);
  // Every epoch is the same plan without shuffling.
  for (int64_t k = 0, n = sampler.packs_in_epoch(); k < n; ++k) sampler.next();
  EXPECT_EQ(sampler.epoch(), 1);
  EXPECT_EQ(sampler.plan(), plan);
}

bool same_pack(const Pack& a, const Pack& b) {
  return a.input_ids == b.input_ids && a.labels == b.labels && a.cu_seqlens == b.cu_seqlens &&
         a.sample_indices == b.sample_indices && a.num_padding == b.num_padding;
}

TEST(PackSampler, SaveRestoreContinuesIdentically) {
  InMemorySamples src(random_docs(7, 80, 2, 50));
  for (int stop : {0, 1, 7, 23, 40}) {
    SCOPED_TRACE(::testing::Message() << "stopped after " << stop << " packs");
    PackSampler original(src, small_config(2024));
    for (int i = 0; i < stop; ++i) original.next();
    // Round-trip through text, as a checkpoint does.
    const std::string saved = original.save_state().dump();

    PackSampler resumed(src, small_config(2024));
    resumed.restore_state(nlohmann::json::parse(saved));
    EXPECT_EQ(resumed.epoch(), original.epoch());
    EXPECT_EQ(resumed.index_in_epoch(), original.index_in_epoch());
    for (int i = 0; i < 60; ++i) {  // crosses at least one epoch boundary
      Pack a = original.next(), b = resumed.next();
      ASSERT_TRUE(same_pack(a, b)) << "pack " << i << " after resume differs";
    }
  }
}

TEST(PackSampler, RestoreRejectsChangedDataOrSettings) {
  InMemorySamples src(random_docs(8, 40, 2, 30));
  PackSampler s(src, small_config(1));
  s.next();
  const nlohmann::json state = s.save_state();

  auto expect_error = [&](PackSampler& target, const nlohmann::json& st,
                          const std::string& problem) {
    try {
      target.restore_state(st);
      ADD_FAILURE() << "no error for " << problem;
    } catch (const glmtune::Error& e) {
      EXPECT_EQ(e.where(), "sampler state");
      EXPECT_NE(e.problem().find(problem), std::string::npos) << e.problem();
    }
  };
  PackSampler other_seed(src, small_config(2));
  expect_error(other_seed, state, "\"seed\" is");
  PackingConfig longer = small_config(1);
  longer.pack_max_length = 128;
  PackSampler other_len(src, longer);
  expect_error(other_len, state, "\"pack_max_length\" is 64 in the saved state but 128 now");

  // Same count, one sample one token longer: only the fingerprint notices.
  auto docs = random_docs(8, 40, 2, 30);
  docs[17].input_ids.push_back(10);
  docs[17].labels.push_back(10);
  InMemorySamples changed(docs);
  PackSampler other_data(changed, small_config(1));
  expect_error(other_data, state, "\"data_fingerprint\"");

  PackSampler fresh(src, small_config(1));
  nlohmann::json bad = state;
  bad["index_in_epoch"] = 100000;
  expect_error(fresh, bad, "past the epoch");
  bad = state;
  bad.erase("epoch");
  expect_error(fresh, bad, "missing \"epoch\"");
  expect_error(fresh, nlohmann::json::array(), "missing \"format\"");
}

TEST(PackSampler, RejectsEmptySourceAndOversizedSamples) {
  InMemorySamples empty(std::vector<TokenizedSample>{});
  EXPECT_THROW(PackSampler(empty, small_config(0)), glmtune::Error);
  InMemorySamples big(random_docs(9, 3, 65, 70));
  EXPECT_THROW(PackSampler(big, small_config(0)), glmtune::Error);
  InMemorySamples ok(random_docs(9, 3, 5, 6));
  PackingConfig no_pad = small_config(0);
  no_pad.pad_id = -1;
  EXPECT_THROW(PackSampler(ok, no_pad), glmtune::Error);
}

}  // namespace
