// gatherFull / gatherStreaming / scatterFull over thread ranks: for W in
// 1..4, every layout kind, uneven sizes, three dtypes and buffers from one
// element to everything, the gathered tensors equal the originals bit for
// bit; gather after scatter and scatter after gather are identities.
#include "shardema/shard/gather.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "shard/gather_fixture.h"
#include "shardema/shard/communicator.h"
#include "shardema/shard/flat_param_layout.h"
#include "support/thread_ranks.h"
#include "support/value_error.h"

namespace shardema::shard {
namespace {

using namespace gather_fixture;  // NOLINT: test-local helpers

TEST(GatherTest, GatherFullRebuildsEveryLayoutBitForBit) {
  const int64_t buffers[] = {1, 16, 100, int64_t{64} << 20};
  for (int64_t w = 1; w <= 4; ++w) {
    for (const std::string kind : {"fsdp2", "replicated", "rank0", "fsdp1", "per_rank"}) {
      const ShardLayout layout = makeLayout(kind, w);
      const auto full = fullTensors(layout, w % 2 ? at::kFloat : at::kBFloat16);
      runThreadRanks(w, [&](Communicator& comm) {
        const auto locals = localsOf(layout, full, comm.rank());
        for (int64_t buffer : buffers) {
          for (int64_t root : {int64_t{-1}, int64_t{0}, w - 1}) {
            const std::string where = kind + " W=" + std::to_string(w) + " buffer " +
                                      std::to_string(buffer) + " root " + std::to_string(root) +
                                      " rank " + std::to_string(comm.rank());
            expectGathered(comm, layout, locals, full, root, buffer, where);
          }
        }
      });
    }
  }
}

TEST(GatherTest, StreamingPiecesAreBoundedOrderedAndCoverOnce) {
  const ShardLayout layout = makeLayout("fsdp2", 3);
  const auto full = fullTensors(layout, at::kFloat);
  runThreadRanks(3, [&](Communicator& comm) {
    const auto locals = localsOf(layout, full, comm.rank());
    GatherOptions options;
    options.root = 1;
    options.bufferBytes = 24;
    std::vector<int64_t> covered(layout.specs.size(), 0);
    size_t tensor = 0;
    gatherStreaming(
        comm, layout, locals,
        [&](const ShardSpec& spec, int64_t offset, const at::Tensor& piece) {
          while (layout.specs[tensor].name != spec.name) {
            ASSERT_EQ(covered[tensor], layout.specs[tensor].numel()) << "order of tensors";
            ++tensor;
          }
          EXPECT_EQ(offset, covered[tensor]) << spec.name << ": increasing, no gap, no overlap";
          EXPECT_LE(piece.numel() * piece.element_size(), 24) << spec.name;
          EXPECT_EQ(piece.dim(), 1);
          EXPECT_EQ(
              firstMismatch(full[tensor].reshape({-1}).narrow(0, offset, piece.numel()), piece), "")
              << spec.name << " at " << offset;
          covered[tensor] += piece.numel();
        },
        options);
    if (comm.rank() == 1) {
      for (size_t i = 0; i < covered.size(); ++i) {
        EXPECT_EQ(covered[i], layout.specs[i].numel()) << layout.specs[i].name;
      }
    }
  });
}

TEST(GatherTest, ScatterAndGatherAreInverses) {
  for (int64_t w = 1; w <= 4; ++w) {
    for (const std::string kind : {"fsdp2", "rank0", "fsdp1"}) {
      const ShardLayout layout = makeLayout(kind, w);
      const auto full = fullTensors(layout, at::kHalf);
      runThreadRanks(w, [&](Communicator& comm) {
        for (int64_t buffer : {int64_t{8}, int64_t{1} << 20}) {
          GatherOptions options;
          options.bufferBytes = buffer;
          const int64_t root = w - 1;
          options.root = root;
          // scatter then gather: the full tensors come back
          const auto mine = scatterFull(
              comm, layout, comm.rank() == root ? full : std::vector<at::Tensor>{}, options);
          const auto expected = localsOf(layout, full, comm.rank());
          for (size_t i = 0; i < mine.size(); ++i) {
            EXPECT_EQ(firstMismatch(expected[i], mine[i]), "")
                << kind << " " << layout.specs[i].name;
          }
          options.root = -1;
          expectSame(full, gatherFull(comm, layout, mine, options), layout, kind);
          // gather then scatter: the locals come back
          std::vector<at::Tensor> again;
          for (auto& entry : gatherFull(comm, layout, expected, options)) {
            again.push_back(entry.second);
          }
          options.root = 0;
          const auto back = scatterFull(comm, layout, again, options);
          for (size_t i = 0; i < back.size(); ++i) {
            EXPECT_EQ(firstMismatch(expected[i], back[i]), "")
                << kind << " " << layout.specs[i].name;
          }
        }
      });
    }
  }
}

// A per-rank tensor: every rank holds its own copy, and rank 0's stands for
// it. The gather takes rank 0's (the others pass none of theirs, their
// range being empty); the scatter gives every rank the whole of the root's,
// beside a sharded tensor cut as usual.
TEST(GatherTest, PerRankTensorsGatherRankZerosAndScatterWhole) {
  for (int64_t w = 1; w <= 3; ++w) {
    ShardLayout layout = makeLayout("per_rank", w);
    layout.specs.push_back(fsdp2Spec("rows", {5, 3}, at::kFloat, w));
    const auto full = fullTensors(layout, at::kFloat);
    runThreadRanks(w, [&](Communicator& comm) {
      // Each rank's own copies differ; only rank 0's may reach the result.
      std::vector<at::Tensor> own;
      for (size_t i = 0; i < full.size(); ++i) {
        const bool perRank = layout.specs[i].kind == LayoutKind::kPerRank;
        own.push_back(perRank ? full[i] + comm.rank() : full[i]);
      }
      std::vector<at::Tensor> locals;
      for (size_t i = 0; i < own.size(); ++i) {
        const ElementRange range = layout.specs[i].rangeOf(comm.rank());
        locals.push_back(own[i].reshape({-1}).narrow(0, range.begin, range.size()).contiguous());
      }
      for (int64_t buffer : {int64_t{8}, int64_t{1} << 20}) {
        expectGathered(comm, layout, locals, full, -1, buffer, "per_rank W=" + std::to_string(w));
        GatherOptions options;
        options.bufferBytes = buffer;
        options.root = w - 1;
        const auto mine = scatterFull(
            comm, layout, comm.rank() == w - 1 ? full : std::vector<at::Tensor>{}, options);
        ASSERT_EQ(mine.size(), full.size());
        for (size_t i = 0; i < mine.size(); ++i) {
          const ElementRange held = layout.specs[i].heldRange(comm.rank());
          EXPECT_EQ(mine[i].numel(), held.size());
          const at::Tensor want = full[i].reshape({-1}).narrow(0, held.begin, held.size());
          EXPECT_EQ(firstMismatch(want, mine[i]), "")
              << layout.specs[i].name << " rank " << comm.rank() << " W " << w;
        }
      }
    });
  }
}

TEST(GatherTest, BadLocalsFailOnEveryRankBeforeDataMoves) {
  const ShardLayout layout = makeLayout("fsdp2", 2);
  const auto full = fullTensors(layout, at::kFloat);
  runThreadRanks(2, [&](Communicator& comm) {
    auto locals = localsOf(layout, full, comm.rank());
    auto bad = locals;
    if (comm.rank() == 1) {
      bad[4] = at::zeros({3});  // wrong element count on one rank only
    }
    // Every rank names the failed rank and its own reason.
    EXPECT_VALUE_ERROR(gatherFull(comm, layout, bad), "rank 1: ");
    EXPECT_VALUE_ERROR(gatherFull(comm, layout, bad), "local 'fsdp2.t4' on rank 1 has 3 elements");
    auto mixed = locals;
    if (comm.rank() == 0) {
      mixed[3] = mixed[3].to(at::kDouble);  // dtype differs between ranks
    }
    EXPECT_VALUE_ERROR(gatherFull(comm, layout, mixed), "local 'fsdp2.t3' is");
    EXPECT_VALUE_ERROR(scatterFull(comm, layout, {}), "rank 0: scatterFull: root passed 0");
    GatherOptions options;
    options.root = 2;
    EXPECT_VALUE_ERROR(gatherFull(comm, layout, locals, options), "root must be -1");
    options.root = comm.rank() == 0 ? 0 : 7;  // invalid on one rank only
    EXPECT_VALUE_ERROR(gatherFull(comm, layout, locals, options), "rank 1: ");
    EXPECT_VALUE_ERROR(gatherFull(comm, layout, locals, options), "got 7");
    options.root = 0;
    options.bufferBytes = comm.rank() == 0 ? 0 : 16;
    EXPECT_VALUE_ERROR(gatherFull(comm, layout, locals, options),
                       "rank 0: gatherStreaming: options.bufferBytes must be >= 1, got 0");
    // The layout is for 3 ranks, the communicator has 2: still every rank
    // fails together, naming the sizes.
    EXPECT_VALUE_ERROR(gatherFull(comm, makeLayout("fsdp2", 3), locals),
                       "the layout is for 3 ranks but the communicator has 2");
    EXPECT_FALSE(comm.broken());
    EXPECT_EQ(gatherFull(comm, layout, locals).size(), comm.rank() == 0 ? layout.specs.size() : 0u);
  });
}

// gatherStreaming with a sink that copies each piece into zeroed 1-D
// tensors shaped like `full`.
std::vector<at::Tensor> streamInto(Communicator& comm, const ShardLayout& layout,
                                   const std::vector<at::Tensor>& locals,
                                   const std::vector<at::Tensor>& full,
                                   const GatherOptions& options) {
  std::vector<at::Tensor> streamed;
  for (const at::Tensor& f : full) {
    streamed.push_back(at::zeros({f.numel()}, f.options()));
  }
  gatherStreaming(
      comm, layout, locals,
      [&](const ShardSpec& spec, int64_t offset, const at::Tensor& piece) {
        const size_t i = static_cast<size_t>(&spec - layout.specs.data());
        streamed[i].narrow(0, offset, piece.numel()).copy_(piece);
      },
      options);
  return streamed;
}

// Blocks of pieces >= 1 MiB move piece by piece (gatherFull: straight into
// the result), smaller ones packed; a mix of both in one round, uneven
// shapes, every root, gatherFull and gatherStreaming, must rebuild the
// tensors exactly.
TEST(GatherTest, LargePiecesMovePiecewiseAndStayExact) {
  for (int64_t w = 2; w <= 3; ++w) {
    ShardLayout layout;
    const std::vector<std::vector<int64_t>> shapes = {
        {3 * w + 1, 131072}, {5, 7}, {2 * w, 524288}, {w * 70000 + 3}};
    for (size_t i = 0; i < shapes.size(); ++i) {
      const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};  // as fullTensors
      const at::ScalarType dtype = dtypes[i % 3];
      layout.specs.push_back(fsdp2Spec("big.t" + std::to_string(i), shapes[i], dtype, w));
    }
    const auto full = fullTensors(layout, at::kFloat);
    runThreadRanks(w, [&](Communicator& comm) {
      const auto locals = localsOf(layout, full, comm.rank());
      for (int64_t buffer : {int64_t{3} << 20, int64_t{64} << 20}) {
        for (int64_t root : {int64_t{-1}, w - 1}) {
          const std::string where = "W=" + std::to_string(w) + " buffer " + std::to_string(buffer) +
                                    " root " + std::to_string(root);
          expectGathered(comm, layout, locals, full, root, buffer, where);
          GatherOptions options;
          options.root = root;
          options.bufferBytes = buffer;
          const auto streamed = streamInto(comm, layout, locals, full, options);
          for (size_t i = 0; (root < 0 || root == comm.rank()) && i < full.size(); ++i) {
            EXPECT_EQ(firstMismatch(full[i].reshape({-1}), streamed[i]), "")
                << where << " streaming " << layout.specs[i].name;
          }
        }
      }
    });
  }
}

// A sink that throws stops being called, but its rank still takes part in
// the remaining rounds: the error comes out there, the other ranks finish
// normally, nobody waits for a timeout, and the communicator stays usable.
TEST(GatherTest, ThrowingSinkKeepsRanksInStep) {
  const ShardLayout layout = makeLayout("fsdp2", 3);
  const auto full = fullTensors(layout, at::kFloat);
  runThreadRanks(3, [&](Communicator& comm) {
    const auto locals = localsOf(layout, full, comm.rank());
    for (int64_t root : {int64_t{0}, int64_t{-1}}) {
      GatherOptions options;
      options.root = root;
      options.bufferBytes = 16;  // many rounds after the throw
      int64_t calls = 0;
      const auto start = std::chrono::steady_clock::now();
      const auto run = [&] {
        gatherStreaming(
            comm, layout, locals,
            [&](const ShardSpec&, int64_t, const at::Tensor&) {
              ++calls;
              TORCH_CHECK(comm.rank() != 0 || calls < 3, "sink refuses");
            },
            options);
      };
      std::string error;
      try {
        run();
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
      }
      if (comm.rank() == 0) {
        EXPECT_NE(error.find("sink refuses"), std::string::npos)
            << "root " << root << ": " << error;
        EXPECT_EQ(calls, 3) << "root " << root << ": no call after the throw";
      } else {
        EXPECT_EQ(error, "") << "root " << root;
      }
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
      EXPECT_FALSE(comm.broken());
    }
    GatherOptions all;
    all.root = -1;
    expectSame(full, gatherFull(comm, layout, locals, all), layout, "after the throws");
  });
}

}  // namespace
}  // namespace shardema::shard
