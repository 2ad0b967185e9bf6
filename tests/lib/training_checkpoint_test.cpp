#include "shardema/training_checkpoint.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "shardema/core/tensor_file.h"
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

}  // namespace
}  // namespace shardema
