// ShardedAverager: per-rank EMAs over every layout kind equal, together, the
// single-process EMA of the full tensors bit for bit (no communication: the
// W ranks run in this thread).
#include "shardema/sharded_averager.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "lib/sharded_fixture.h"
#include "support/value_error.h"

namespace shardema {
namespace {

using testing::ModelTensor;

constexpr int64_t kSteps = 12;

// Runs the reference and W ranks over the same values for kSteps steps.
void runPerTensorKind(const std::vector<ModelTensor>& model, shard::LayoutKind kind,
                      int64_t worldSize, const AveragerOptions& options) {
  std::vector<at::Tensor> full = testing::makeModel(model, 0);
  Averager reference(testing::trackedModel(model, full), options);
  std::vector<testing::RankModel> ranks = testing::makeRanks(model, kind, worldSize, options);
  for (int64_t step = 1; step <= kSteps; ++step) {
    testing::setModel(model, full, step);
    for (auto& rank : ranks) testing::setModel(model, rank.tensors, step);
    reference.update(step);
    for (auto& rank : ranks) rank.averager->update(step);
    // Sources change at the next step: fence first, as a training loop does.
    reference.fence();
    for (auto& rank : ranks) rank.averager->fence();
  }
  const std::string what = std::string(shard::layoutKindName(kind)) +
                           " W=" + std::to_string(worldSize) + " " +
                           std::string(c10::toString(model.front().dtype));
  testing::expectEqualsReference(reference, ranks.front().averager->layout(),
                                 testing::unionOfRanks(testing::averagersOf(ranks)), what);
  for (const auto& rank : ranks) EXPECT_EQ(rank.averager->step(), kSteps) << what;
  // The EMA lags the weights (it is an average, not a copy of them).
  EXPECT_FALSE(testing::sameTensor(reference.ema("prime"), full[2])) << what;
}

// FSDP1: the model's tensors are members of one flat parameter; each rank
// holds its padded flat shard (padding filled with NaN, which must never
// reach the EMA).
void runFsdp1(const std::vector<ModelTensor>& model, int64_t worldSize,
              const AveragerOptions& options) {
  std::vector<shard::FlatParamMember> members;
  for (const ModelTensor& t : model) members.push_back({t.name, t.shape});
  const shard::FlatParamLayout flat(members, model.front().dtype, worldSize);
  std::vector<ModelTensor> averaged = model;
  for (ModelTensor& t : averaged) t.role = TrackRole::kAverage;
  std::vector<at::Tensor> full = testing::makeModel(averaged, 0);
  Averager reference(testing::trackedModel(averaged, full), options);
  const std::vector<shard::ShardSpec> specs = flat.specs();
  auto fillShard = [&](at::Tensor& shard, int64_t rank) {
    for (size_t i = 0; i < specs.size(); ++i) {
      const shard::ElementRange range = specs[i].rangeOf(rank);
      shard.narrow(0, flat.localOffset(i, rank), range.size())
          .copy_(full[i].reshape({-1}).narrow(0, range.begin, range.size()));
    }
  };
  std::vector<at::Tensor> shards;
  std::vector<std::unique_ptr<ShardedAverager>> ranks;
  for (int64_t r = 0; r < worldSize; ++r) {
    shards.push_back(at::full({flat.shardNumel()}, NAN, at::TensorOptions().dtype(flat.dtype())));
    fillShard(shards.back(), r);
    ranks.push_back(std::make_unique<ShardedAverager>(
        r, worldSize, shardsFromFlatParam(flat, shards.back(), r), options));
  }
  for (int64_t step = 1; step <= kSteps; ++step) {
    testing::setModel(averaged, full, step);
    for (int64_t r = 0; r < worldSize; ++r) fillShard(shards[r], r);
    reference.update(step);
    for (auto& rank : ranks) rank->update(step);
    reference.fence();
    for (auto& rank : ranks) rank->fence();
  }
  std::vector<const ShardedAverager*> views;
  for (const auto& rank : ranks) views.push_back(rank.get());
  testing::expectEqualsReference(reference, ranks.front()->layout(), testing::unionOfRanks(views),
                                 "fsdp1 W=" + std::to_string(worldSize));
}

void sweep(const AveragerOptions& options) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const std::vector<ModelTensor> model = testing::unevenModel(dtype, /*withIntegerBuffer=*/true);
    for (int64_t w = 1; w <= 4; ++w) {
      for (const shard::LayoutKind kind :
           {shard::LayoutKind::kFsdp2, shard::LayoutKind::kReplicated,
            shard::LayoutKind::kRankZero}) {
        runPerTensorKind(model, kind, w, options);
      }
      runFsdp1(testing::unevenModel(dtype, /*withIntegerBuffer=*/false), w, options);
    }
  }
}

// The default storage: the asynchronous pinned-host pipeline.
TEST(ShardedAveragerTest, UnionOfRankEmasEqualsFullEmaBitForBit) {
  sweep(testing::smallChunkOptions(EmaStorage::kPinnedHost));
}

TEST(ShardedAveragerTest, UnionOfRankEmasEqualsFullEmaBitForBitOnTheDeviceStorage) {
  sweep(testing::smallChunkOptions(EmaStorage::kDevice));
}

TEST(ShardedAveragerTest, Fsdp2ShardsAreRowViewsOfTheFullTensor) {
  // Spec example: d0 = 5 over 4 ranks gives rows 2, 2, 1, 0.
  const at::Tensor full = at::arange(15, at::kFloat).reshape({5, 3});
  const std::vector<int64_t> rows = {2, 2, 1, 0};
  int64_t offset = 0;
  for (int64_t r = 0; r < 4; ++r) {
    const auto shards = shardsFromFullTensors({{"w", full}}, shard::LayoutKind::kFsdp2, r, 4);
    ASSERT_EQ(shards.size(), 1u);
    const at::Tensor& local = shards[0].local;
    EXPECT_EQ(local.sizes(), (std::vector<int64_t>{rows[r], 3})) << "rank " << r;
    EXPECT_EQ(shards[0].spec.rangeOf(r), (shard::ElementRange{offset * 3, (offset + rows[r]) * 3}));
    if (local.numel() > 0) {
      EXPECT_EQ(local.data_ptr<float>(), full.data_ptr<float>() + offset * 3) << "not a view";
    }
    offset += rows[r];
  }
  // Rank 0 full copy: everything on rank 0, nothing elsewhere.
  EXPECT_EQ(
      shardsFromFullTensors({{"w", full}}, shard::LayoutKind::kRankZero, 0, 3)[0].local.numel(),
      15);
  EXPECT_EQ(
      shardsFromFullTensors({{"w", full}}, shard::LayoutKind::kRankZero, 2, 3)[0].local.numel(), 0);
  EXPECT_VALUE_ERROR(shardsFromFullTensors({{"w", full}}, shard::LayoutKind::kFsdp1, 0, 2),
                     "shardsFromFlatParam");
  EXPECT_VALUE_ERROR(shardsFromFullTensors({{"w", full.t()}}, shard::LayoutKind::kFsdp2, 0, 2),
                     "'w'");
}

TEST(ShardedAveragerTest, AttachValidatesEveryShardNamingTheTensor) {
  AveragerOptions device;
  device.storage = EmaStorage::kDevice;
  const at::Tensor rows = at::zeros({2, 3});
  const shard::ShardSpec spec = shard::fsdp2Spec("layer.w", {5, 3}, at::kFloat, 3);
  // Rank 1 owns rows 2-3 (6 elements): a 2x3 local is right, others are not.
  EXPECT_NO_THROW(ShardedAverager(1, 3, {{rows, spec}}, device));
  EXPECT_VALUE_ERROR(ShardedAverager(2, 3, {{rows, spec}}), "'layer.w'");  // rank 2 owns 3
  EXPECT_VALUE_ERROR(ShardedAverager(1, 3, {{rows.to(at::kBFloat16), spec}}), "dtype");
  EXPECT_VALUE_ERROR(ShardedAverager(3, 3, {{rows, spec}}), "rank 3");
  EXPECT_VALUE_ERROR(ShardedAverager(1, 3, {{rows, spec}, {rows, spec}}), "given twice");
  const shard::ShardSpec other = shard::fsdp2Spec("layer.b", {5, 3}, at::kFloat, 2);
  EXPECT_VALUE_ERROR(ShardedAverager(1, 3, {{rows, spec}, {at::zeros({6}), other}}), "'layer.b'");
  EXPECT_VALUE_ERROR(ShardedAverager(1, 2, {{rows, spec}}), "'layer.w'");  // spec is for 3
  shard::ShardSpec broken = spec;
  broken.ranges[1].end += 1;
  EXPECT_VALUE_ERROR(ShardedAverager(1, 3, {{at::zeros({7}), broken}}), "layer.w");
  // A rank that owns nothing at all is fine.
  ShardedAverager none(0, 3, {}, device);
  EXPECT_TRUE(none.layout().specs.empty());
  EXPECT_TRUE(none.update(1));
}

TEST(ShardedAveragerTest, FlatParamShardsAreViewsAtTheLocalOffsets) {
  const shard::FlatParamLayout flat({{"a", {3}}, {"b", {2, 3}}, {"c", {5}}}, at::kFloat, 2);
  for (int64_t r = 0; r < 2; ++r) {
    const at::Tensor shard = at::zeros({flat.shardNumel()});
    const auto shards = shardsFromFlatParam(flat, shard, r);
    ASSERT_EQ(shards.size(), 3u);
    for (size_t i = 0; i < shards.size(); ++i) {
      EXPECT_EQ(shards[i].local.numel(), shards[i].spec.rangeOf(r).size());
      if (shards[i].local.numel() > 0) {
        EXPECT_EQ(shards[i].local.data_ptr<float>(),
                  shard.data_ptr<float>() + flat.localOffset(i, r));
      }
    }
  }
  EXPECT_VALUE_ERROR(shardsFromFlatParam(flat, at::zeros({flat.shardNumel() + 1}), 0), "elements");
  EXPECT_VALUE_ERROR(shardsFromFlatParam(flat, at::zeros({flat.shardNumel()}, at::kHalf), 0),
                     "dtype");
}

}  // namespace
}  // namespace shardema
