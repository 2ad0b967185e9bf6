#include "shardema/module_tracking.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>

#include "support/test_net.h"

namespace shardema {
namespace {

std::vector<std::string> namesOf(const NamedTensors& tensors) {
  std::vector<std::string> names;
  for (const auto& t : tensors) names.push_back(t.first);
  return names;
}

TEST(ModuleTrackingTest, ListsTensorsInStateDictOrder) {
  testing::TestNet net;
  EXPECT_EQ(namesOf(moduleTensors(*net)), testing::testNetNames());
}

TEST(ModuleTrackingTest, HandlesAliasTheLiveTensors) {
  testing::TestNet net;
  const NamedTensors tensors = moduleTensors(*net);
  EXPECT_TRUE(tensors[2].second.is_same(net->fc1->weight));
  const NamedTensors clones = cloneModuleTensors(*net);
  EXPECT_FALSE(clones[2].second.is_same(net->fc1->weight));
  EXPECT_TRUE(clones[2].second.equal(net->fc1->weight));
}

TEST(ModuleTrackingTest, SharedModuleCountsOnceUnderItsFirstName) {
  torch::nn::Linear shared(2, 2);
  torch::nn::Sequential seq(shared, shared);
  EXPECT_EQ(namesOf(moduleTensors(*seq)), (std::vector<std::string>{"0.weight", "0.bias"}));
}

TEST(ModuleTrackingTest, VersatilRolesCopyBuffersBatchNormAndFrozen) {
  testing::TestNet net;
  std::map<std::string, TrackRole> roles;
  for (const auto& t : trackModule(*net, TrackingPolicy::kVersatil)) roles[t.name] = t.role;
  for (const char* averaged : {"frozen", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}) {
    EXPECT_EQ(roles.at(averaged), TrackRole::kAverageIfTrainable) << averaged;
  }
  for (const char* copied : {"scale", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                             "bn.num_batches_tracked"}) {
    EXPECT_EQ(roles.at(copied), TrackRole::kCopy) << copied;
  }
}

TEST(ModuleTrackingTest, EmaPytorchRolesAverageFloatsAndKeepIntegers) {
  testing::TestNet net;
  for (const auto& t : trackModule(*net, TrackingPolicy::kEmaPytorch)) {
    const TrackRole expected =
        t.name == "bn.num_batches_tracked" ? TrackRole::kCopyOnce : TrackRole::kAverage;
    EXPECT_EQ(t.role, expected) << t.name;
  }
}

// Buffers change in forward() and are read inside Averager::update();
// parameters only change in the optimizer step (covered by fence()).
TEST(ModuleTrackingTest, EveryBufferAndNoParameterChangesInForward) {
  testing::TestNet net;
  const std::set<std::string> buffers = {"scale", "bn.running_mean", "bn.running_var",
                                         "bn.num_batches_tracked"};
  for (TrackingPolicy policy : {TrackingPolicy::kVersatil, TrackingPolicy::kEmaPytorch}) {
    for (const auto& t : trackModule(*net, policy)) {
      EXPECT_EQ(t.changesInForward, buffers.count(t.name) == 1) << t.name;
    }
  }
}

TEST(ModuleTrackingTest, LoadIntoModuleStrictAndNonStrict) {
  testing::TestNet net;
  NamedTensors values = {{"fc1.bias", torch::full({8}, 3.0)}, {"ghost", torch::zeros({1})}};
  EXPECT_THROW(loadIntoModule(*net, values), c10::ValueError);
  EXPECT_FALSE(net->fc1->bias.equal(torch::full({8}, 3.0))) << "strict failure writes nothing";
  const LoadReport report = loadIntoModule(*net, values, LoadStrictness::kNonStrict);
  EXPECT_TRUE(net->fc1->bias.equal(torch::full({8}, 3.0)));
  EXPECT_EQ(report.unexpected, std::vector<std::string>{"ghost"});
  EXPECT_EQ(report.missing.size(), testing::testNetNames().size() - 1);
  EXPECT_THROW(loadIntoModule(*net, {{"fc1.bias", torch::zeros({7})}}, LoadStrictness::kNonStrict),
               c10::ValueError);
}

}  // namespace
}  // namespace shardema
