#include "shardema/training_checkpoint.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardema/core/tensor_file.h"
#include "shardema/ema_substitution.h"
#include "support/temp_dir.h"
#include "support/test_net.h"

namespace shardema {
namespace {

TEST(TrainingCheckpointTest, SavesWeightsRawWeightsAndMetadata) {
  testing::TempDir dir;
  testing::TestNet net;
  TrainingCheckpoint checkpoint = TrainingCheckpoint::capture(*net);
  checkpoint.rawWeights = {{"fc1.bias", torch::arange(8, torch::kFloat)}};
  checkpoint.metadata["global_step"] = "42";
  checkpoint.save(dir.file("c.safetensors"));

  // The file itself: deployable names as they are, raw ones under the prefix.
  const TensorFile file = readTensorFile(dir.file("c.safetensors"));
  EXPECT_TRUE(file.contains("fc1.weight"));
  EXPECT_TRUE(file.contains(std::string(kRawWeightsPrefix) + "fc1.bias"));
  EXPECT_EQ(file.metadata.at("shardema.kind"), "training_checkpoint");

  const TrainingCheckpoint loaded = TrainingCheckpoint::load(dir.file("c.safetensors"));
  ASSERT_EQ(loaded.weights.size(), checkpoint.weights.size());
  for (size_t i = 0; i < loaded.weights.size(); ++i) {
    EXPECT_EQ(loaded.weights[i].first, checkpoint.weights[i].first);
    EXPECT_TRUE(loaded.weights[i].second.equal(checkpoint.weights[i].second));
  }
  ASSERT_EQ(loaded.rawWeights.size(), 1u);
  EXPECT_EQ(loaded.rawWeights[0].first, "fc1.bias");
  EXPECT_TRUE(loaded.rawWeights[0].second.equal(torch::arange(8, torch::kFloat)));
  EXPECT_EQ(loaded.metadata.at("global_step"), "42");
}

TEST(TrainingCheckpointTest, RejectsFilesThatAreNotCheckpoints) {
  testing::TempDir dir;
  TensorFile other;
  other.tensors = {{"w", torch::zeros({2})}};
  writeTensorFile(dir.file("o.safetensors"), other);
  try {
    TrainingCheckpoint::load(dir.file("o.safetensors"));
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("o.safetensors"), std::string::npos) << e.what();
  }
  TrainingCheckpoint reserved;
  reserved.metadata["shardema.kind"] = "x";
  EXPECT_THROW(reserved.save(dir.file("r.safetensors")), c10::ValueError);
}

// The float32 EMA kept beside narrowed weights travels under its own
// prefix and comes back; a file written before it existed loads with none.
TEST(TrainingCheckpointTest, KeepsTheFloat32EmaUnderItsPrefixAndLoadsFilesWithout) {
  testing::TempDir dir;
  TrainingCheckpoint checkpoint;
  const at::Tensor exact = torch::full({3}, 1.0 / 3.0);
  checkpoint.weights = {{"w", exact.to(torch::kBFloat16)}};
  checkpoint.rawWeights = {{"w", torch::ones({3}, torch::kBFloat16)}};
  checkpoint.float32Ema = {{"w", exact}};
  checkpoint.save(dir.file("new.safetensors"));
  const TensorFile file = readTensorFile(dir.file("new.safetensors"));
  EXPECT_TRUE(file.contains(std::string(kFloat32EmaPrefix) + "w"));
  const TrainingCheckpoint loaded = TrainingCheckpoint::load(dir.file("new.safetensors"));
  ASSERT_EQ(loaded.weights.size(), 1u);
  EXPECT_EQ(loaded.weights[0].second.scalar_type(), torch::kBFloat16);
  ASSERT_EQ(loaded.float32Ema.size(), 1u);
  EXPECT_EQ(loaded.float32Ema[0].first, "w");
  EXPECT_TRUE(loaded.float32Ema[0].second.equal(exact));

  // The layout of a training checkpoint before float32Ema, written directly.
  TensorFile old;
  old.tensors = {{"w", exact}, {std::string(kRawWeightsPrefix) + "w", torch::ones({3})}};
  old.metadata["shardema.kind"] = "training_checkpoint";
  writeTensorFile(dir.file("old.safetensors"), old);
  const TrainingCheckpoint before = TrainingCheckpoint::load(dir.file("old.safetensors"));
  EXPECT_TRUE(before.float32Ema.empty());
  ASSERT_EQ(before.weights.size(), 1u);
  EXPECT_TRUE(before.weights[0].second.equal(exact));
  ASSERT_EQ(before.rawWeights.size(), 1u);
}

// substituteEma, the one checkpoint substitution (EmaCallback and
// shardema._C.substitute_ema). Values are chosen off the bf16 grid, so a
// narrowed value differs from the float32 one.
NamedTensors substitutionEma() {
  return {{"a", torch::arange(6, torch::kFloat).reshape({2, 3}) / 7.0 + 1.0 / 3.0},
          {"b", torch::arange(4, torch::kFloat) / 9.0},
          {"d", torch::ones({2})}};  // no slot: a non-persistent buffer
}

NamedTensors substitutionSlots() {
  return {{"a", torch::full({2, 3}, 2.0, torch::kBFloat16)},
          {"b", torch::full({4}, 3.0)},
          {"c", torch::arange(2, torch::kLong)}};  // no EMA: not tracked
}

TEST(EmaSubstitutionTest, ABf16SlotKeepsTheFloat32EmaAsideAFloat32SlotHasNone) {
  const NamedTensors ema = substitutionEma();
  NamedTensors slots = substitutionSlots();
  const at::Tensor untouched = slots[2].second;
  const EmaSubstitution taken = substituteEma(slots, ema);

  ASSERT_EQ(slots.size(), 3u);
  EXPECT_EQ(slots[0].second.scalar_type(), torch::kBFloat16) << "the slot keeps its dtype";
  EXPECT_TRUE(slots[0].second.equal(ema[0].second.to(torch::kBFloat16)));
  EXPECT_FALSE(slots[0].second.to(torch::kFloat).equal(ema[0].second)) << "narrowing loses bits";
  EXPECT_EQ(slots[1].second.scalar_type(), torch::kFloat);
  EXPECT_TRUE(slots[1].second.equal(ema[1].second));
  EXPECT_TRUE(slots[2].second.is_same(untouched)) << "a slot without an EMA is left alone";

  ASSERT_EQ(taken.raw.size(), 2u);
  EXPECT_EQ(taken.raw[0].first, "a");
  EXPECT_TRUE(taken.raw[0].second.equal(torch::full({2, 3}, 2.0, torch::kBFloat16)));
  EXPECT_EQ(taken.raw[1].first, "b");
  EXPECT_TRUE(taken.raw[1].second.equal(torch::full({4}, 3.0)));
  ASSERT_EQ(taken.float32Ema.size(), 1u) << "only the narrowed slot";
  EXPECT_EQ(taken.float32Ema[0].first, "a");
  EXPECT_EQ(taken.float32Ema[0].second.scalar_type(), torch::kFloat);
  EXPECT_TRUE(taken.float32Ema[0].second.equal(ema[0].second));
}

// The raw values outlive the parameters they were read from (the next
// optimizer step), and what the checkpoint holds outlives the EMA's
// storage (the next update).
TEST(EmaSubstitutionTest, RawValuesAndResultsAreClonesThatDoNotAlias) {
  NamedTensors ema = substitutionEma();
  NamedTensors slots = substitutionSlots();
  const NamedTensors live = slots;  // the "parameters" the slots alias
  const EmaSubstitution taken = substituteEma(slots, ema);
  {
    torch::NoGradGuard noGrad;
    for (const auto& [name, tensor] : live) tensor.add_(100);
    for (auto& [name, tensor] : ema) tensor.add_(100);
  }
  EXPECT_TRUE(taken.raw[0].second.equal(torch::full({2, 3}, 2.0, torch::kBFloat16)));
  EXPECT_TRUE(taken.raw[1].second.equal(torch::full({4}, 3.0)));
  const NamedTensors fresh = substitutionEma();
  EXPECT_TRUE(slots[0].second.equal(fresh[0].second.to(torch::kBFloat16)));
  EXPECT_TRUE(slots[1].second.equal(fresh[1].second));
  EXPECT_TRUE(taken.float32Ema[0].second.equal(fresh[0].second));

  // adoptEma: fresh copies handed over are taken as they are.
  NamedTensors handed = substitutionEma();
  NamedTensors adopting = substitutionSlots();
  const NamedTensors adoptingLive = adopting;
  const EmaSubstitution adopted = substituteEma(adopting, handed, {}, /*adoptEma=*/true);
  EXPECT_EQ(adopting[1].second.data_ptr(), handed[1].second.data_ptr())
      << "same dtype: no second copy";
  EXPECT_EQ(adopted.float32Ema[0].second.data_ptr(), handed[0].second.data_ptr());
  EXPECT_NE(adopting[0].second.data_ptr(), handed[0].second.data_ptr()) << "bf16: narrowed";
  EXPECT_NE(adopted.raw[1].second.data_ptr(), adoptingLive[1].second.data_ptr())
      << "the raw values are cloned all the same";
}

TEST(EmaSubstitutionTest, AShapeMismatchNamesTheTensorAndChangesNothing) {
  NamedTensors ema = substitutionEma();
  ema[1].second = torch::zeros({5});
  NamedTensors slots = substitutionSlots();
  const NamedTensors before = slots;
  try {
    substituteEma(slots, ema);
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'b' is [4] in the checkpoint but its EMA is [5]"), std::string::npos)
        << what;
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    EXPECT_TRUE(slots[i].second.is_same(before[i].second)) << "checked before any write";
  }
}

TEST(EmaSubstitutionTest, ASecondSubstitutionIsRefused) {
  const NamedTensors ema = substitutionEma();
  NamedTensors slots = substitutionSlots();
  const EmaSubstitution first = substituteEma(slots, ema);
  std::vector<std::string> rawKept;
  for (const auto& [name, raw] : first.raw) rawKept.push_back(name);
  const NamedTensors once = slots;
  try {
    substituteEma(slots, ema, rawKept);
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("already keeps the raw value of 'a'"), std::string::npos) << what;
  }
  for (size_t i = 0; i < slots.size(); ++i) EXPECT_TRUE(slots[i].second.is_same(once[i].second));
}

}  // namespace
}  // namespace shardema
