// scatterFull: the rounds of gather_plan.h run backwards, root -> owners.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <string>

#include "gather_agree.h"
#include "gather_plan.h"
#include "shardema/shard/communicator.h"
#include "shardema/shard/gather.h"

namespace shardema {
namespace shard {
namespace {

constexpr const char* kScatterApi = "scatterFull";

std::string checkFull(const ShardLayout& layout, const std::vector<at::Tensor>& full) {
  try {
    layout.check();
    TORCH_CHECK_VALUE(full.size() == layout.specs.size(), kScatterApi, ": root passed ", full.size(),
                      " full tensors for a layout of ", layout.specs.size());
    for (size_t i = 0; i < full.size(); ++i) {
      const ShardSpec& spec = layout.specs[i];
      TORCH_CHECK_VALUE(full[i].defined() && full[i].device().is_cpu(), kScatterApi, ": full '", spec.name,
                        "' must be a defined CPU tensor");
      TORCH_CHECK_VALUE(full[i].sizes().vec() == spec.globalShape, kScatterApi, ": full '", spec.name,
                        "' has shape ", full[i].sizes(), " but the layout says ",
                        c10::IntArrayRef(spec.globalShape));
    }
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return {};
}

// Root's dtypes, broadcast to every rank (the others have no tensors).
std::vector<c10::ScalarType> rootDtypes(Communicator& comm, const ShardLayout& layout,
                                        const std::vector<at::Tensor>& full, int64_t root) {
  const int64_t count = static_cast<int64_t>(layout.specs.size());
  std::vector<c10::ScalarType> dtypes;
  if (count == 0) {
    return dtypes;
  }
  at::Tensor codes = detail::newBytes(count);
  for (int64_t i = 0; comm.rank() == root && i < count; ++i) {
    codes.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(full[static_cast<size_t>(i)].scalar_type());
  }
  comm.broadcast(codes, root, std::string(kScatterApi) + " dtypes");
  for (int64_t i = 0; i < count; ++i) {
    dtypes.push_back(static_cast<c10::ScalarType>(codes.data_ptr<uint8_t>()[i]));
  }
  return dtypes;
}

// Root: every rank's block of the round, rank after rank.
at::Tensor packForAll(const detail::Round& round, const std::vector<at::Tensor>& fullBytes,
                      const std::vector<int64_t>& elementBytes) {
  at::Tensor send = detail::newBytes(round.totalBytes());
  int64_t offset = 0;
  for (size_t r = 0; r < round.pieces.size(); ++r) {
    for (const detail::Piece& p : round.pieces[r]) {
      const int64_t e = elementBytes[static_cast<size_t>(p.tensor)];
      send.narrow(0, offset + p.blockOffset, p.count * e)
          .copy_(
              fullBytes[static_cast<size_t>(p.tensor)].narrow(0, p.globalBegin * e, p.count * e));
    }
    offset += round.blockBytes[r];
  }
  return send;
}

// This rank's block of one round, from the root: only the root owns the
// window (it copies, nothing moves) or an uneven all-to-all root -> owners.
at::Tensor scatterRound(Communicator& comm, const ShardLayout& layout, const detail::Round& round,
                        const std::vector<at::Tensor>& fullBytes,
                        const std::vector<int64_t>& elementBytes, int64_t root) {
  const int64_t me = comm.rank();
  const int64_t worldSize = comm.worldSize();
  const int64_t mine = round.blockBytes[static_cast<size_t>(me)];
  at::Tensor send = me == root ? packForAll(round, fullBytes, elementBytes) : detail::newBytes(0);
  if (worldSize == 1 || round.totalBytes() == round.blockBytes[static_cast<size_t>(root)]) {
    int64_t offset = 0;  // the root's block is preceded by the (empty) lower ranks'
    for (int64_t r = 0; r < root; ++r) {
      offset += round.blockBytes[static_cast<size_t>(r)];
    }
    return me == root ? send.narrow(0, offset, mine) : send;
  }
  std::vector<int64_t> inSplits(static_cast<size_t>(worldSize), 0);
  std::vector<int64_t> outSplits(static_cast<size_t>(worldSize), 0);
  if (me == root) {
    inSplits = round.blockBytes;
  }
  outSplits[static_cast<size_t>(root)] = mine;
  at::Tensor block = detail::newBytes(mine);
  comm.allToAll(send, block, inSplits, outSplits, detail::roundTag(kScatterApi, layout, round));
  return block;
}

// A kPerRank tensor's rounds delivered it to rank 0 alone (its range);
// every rank holds the whole, so rank 0 passes its copy on. Every rank
// derives the same broadcasts from the layout.
void shareRankZeroCopies(Communicator& comm, const ShardLayout& layout,
                         const std::vector<at::Tensor>& result) {
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const ShardSpec& spec = layout.specs[i];
    if (spec.kind != LayoutKind::kPerRank || spec.numel() == 0 || comm.worldSize() == 1) continue;
    comm.broadcast(detail::bytesView(result[i]), 0,
                   std::string(kScatterApi) + " '" + spec.name + "' (per_rank, rank 0's)");
  }
}

}  // namespace

std::vector<at::Tensor> scatterFull(Communicator& comm, const ShardLayout& layout,
                                    const std::vector<at::Tensor>& full, GatherOptions options) {
  const int64_t me = comm.rank();
  const int64_t root = options.root;
  std::string localError = options.localError;
  if (localError.empty()) {
    localError = detail::checkCall(kScatterApi, comm, layout, root, false, options.bufferBytes);
  }
  if (localError.empty() && me == root) {
    localError = checkFull(layout, full);
  }
  detail::agree(kScatterApi, comm, layout, localError, {root, options.bufferBytes});
  const std::vector<c10::ScalarType> dtypes = rootDtypes(comm, layout, full, root);
  std::vector<int64_t> elementBytes;
  std::vector<at::Tensor> result;
  std::vector<at::Tensor> resultBytes;
  std::vector<at::Tensor> fullBytes;
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    elementBytes.push_back(static_cast<int64_t>(c10::elementSize(dtypes[i])));
    result.push_back(
        at::empty({layout.specs[i].heldRange(me).size()}, at::TensorOptions().dtype(dtypes[i])));
    resultBytes.push_back(detail::bytesView(result.back()));
    if (me == root) {
      fullBytes.push_back(detail::bytesView(full[i].contiguous()));
    }
  }
  detail::RoundPlanner planner(layout, elementBytes, options.bufferBytes);
  detail::Round round;
  while (planner.next(round)) {
    const at::Tensor block = scatterRound(comm, layout, round, fullBytes, elementBytes, root);
    for (const detail::Piece& p : round.pieces[static_cast<size_t>(me)]) {
      const int64_t e = elementBytes[static_cast<size_t>(p.tensor)];
      const int64_t local =
          p.globalBegin - layout.specs[static_cast<size_t>(p.tensor)].heldRange(me).begin;
      resultBytes[static_cast<size_t>(p.tensor)]
          .narrow(0, local * e, p.count * e)
          .copy_(block.narrow(0, p.blockOffset, p.count * e));
    }
  }
  shareRankZeroCopies(comm, layout, result);
  return result;
}

}  // namespace shard
}  // namespace shardema
