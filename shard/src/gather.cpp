// gatherStreaming and gatherFull: rounds of gather_plan.h moved over the
// Communicator and handed to the sink piece by piece.
#include "shardema/shard/gather.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <utility>

#include "gather_agree.h"
#include "gather_plan.h"
#include "shardema/shard/communicator.h"

namespace shardema {
namespace shard {
namespace {

constexpr const char* kStreamingApi = "gatherStreaming";

std::string checkLocals(const ShardLayout& layout, const std::vector<at::Tensor>& locals,
                        int64_t rank) {
  try {
    layout.check();
    TORCH_CHECK_VALUE(locals.size() == layout.specs.size(), kStreamingApi, ": rank ", rank,
                      " passed ", locals.size(), " local tensors for a layout of ",
                      layout.specs.size());
    for (size_t i = 0; i < locals.size(); ++i) {
      const ShardSpec& spec = layout.specs[i];
      const at::Tensor& local = locals[i];
      TORCH_CHECK_VALUE(local.defined() && local.device().is_cpu() && local.is_contiguous(),
                        kStreamingApi, ": local '", spec.name, "' on rank ", rank,
                        " must be a defined, contiguous CPU tensor");
      TORCH_CHECK_VALUE(local.numel() == spec.rangeOf(rank).size(), kStreamingApi, ": local '",
                        spec.name, "' on rank ", rank, " has ", local.numel(),
                        " elements but the layout gives "
                        "this rank ",
                        spec.rangeOf(rank).size());
    }
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return {};
}

uint64_t dtypeHash(const std::vector<at::Tensor>& locals) {
  uint64_t hash = 14695981039346656037ull;  // FNV-1a over the dtype codes
  for (const at::Tensor& local : locals) {
    hash = (hash ^ static_cast<uint64_t>(local.scalar_type())) * 1099511628211ull;
  }
  return hash;
}

// Only after agree() saw differing dtype hashes (so every rank calls it):
// exchanges every rank's dtype codes and names the first tensor that
// differs.
void explainDtypes(Communicator& comm, const ShardLayout& layout,
                   const std::vector<at::Tensor>& locals) {
  const int64_t count = static_cast<int64_t>(locals.size());
  at::Tensor mine = detail::newBytes(count);
  auto* codes = mine.data_ptr<uint8_t>();
  for (int64_t i = 0; i < count; ++i) {
    codes[i] = static_cast<uint8_t>(locals[static_cast<size_t>(i)].scalar_type());
  }
  at::Tensor all = detail::newBytes(count * comm.worldSize());
  comm.allGather(mine, all, std::string(kStreamingApi) + " dtypes");
  const auto* allCodes = all.data_ptr<uint8_t>();
  for (int64_t r = 0; r < comm.worldSize(); ++r) {
    for (int64_t i = 0; i < count; ++i) {
      TORCH_CHECK_VALUE(allCodes[r * count + i] == codes[i], kStreamingApi, ": local '",
                        layout.specs[static_cast<size_t>(i)].name, "' is ",
                        c10::toString(static_cast<c10::ScalarType>(codes[i])), " on rank ",
                        comm.rank(), " but ",
                        c10::toString(static_cast<c10::ScalarType>(allCodes[r * count + i])),
                        " on rank ", r, "; every rank must pass one dtype per tensor");
    }
  }
  TORCH_CHECK_VALUE(false, kStreamingApi, ": the ranks passed different dtypes (rank ", comm.rank(),
                    "'s agree with every other's; another pair differs)");
}

// Contiguous bytes to contiguous bytes of the same size. std::memcpy, not
// Tensor::copy_: with many small pieces (16 tensors of a 1 MiB model over 4
// ranks are 16 KiB pieces) ATen's per-call dispatch costs more than the
// copy.
void copyBytes(const at::Tensor& to, const at::Tensor& from) {
  TORCH_INTERNAL_ASSERT(to.numel() == from.numel() && to.is_contiguous() && from.is_contiguous());
  if (to.numel() > 0) {
    std::memcpy(to.data_ptr(), from.data_ptr(), static_cast<size_t>(to.numel()));
  }
}

// This rank's bytes of piece `p` (a view of its local).
at::Tensor localPieceBytes(const ShardLayout& layout, const std::vector<at::Tensor>& locals,
                           int64_t rank, const detail::Piece& p) {
  const at::Tensor& local = locals[static_cast<size_t>(p.tensor)];
  const int64_t begin = layout.specs[static_cast<size_t>(p.tensor)].rangeOf(rank).begin;
  return detail::bytesView(local).narrow(0, (p.globalBegin - begin) * local.element_size(),
                                         p.count * local.element_size());
}

// This rank's block of a round: a view of its local when the block is one
// piece of the exact size, else the pieces packed into `into` (allocated
// when undefined).
at::Tensor ownBlock(const detail::Round& round, const ShardLayout& layout,
                    const std::vector<at::Tensor>& locals, int64_t rank, at::Tensor into) {
  const auto& pieces = round.pieces[static_cast<size_t>(rank)];
  const int64_t blockBytes = round.blockBytes[static_cast<size_t>(rank)];
  if (pieces.size() == 1 &&
      localPieceBytes(layout, locals, rank, pieces.front()).numel() == blockBytes) {
    return localPieceBytes(layout, locals, rank, pieces.front());
  }
  at::Tensor block = into.defined() ? into : detail::newBytes(blockBytes);
  for (const detail::Piece& p : pieces) {
    at::Tensor source = localPieceBytes(layout, locals, rank, p);
    copyBytes(block.narrow(0, p.blockOffset, source.numel()), source);
  }
  return block;
}

// The call's receive buffer, grown to the largest round and reused: fresh
// large buffers per round cost page faults comparable to the transfer.
at::Tensor scratchBytes(at::Tensor& scratch, int64_t size) {
  if (!scratch.defined() || scratch.numel() < size) {
    scratch = at::Tensor();  // release before allocating the larger one
    scratch = detail::newBytes(size);
  }
  return scratch.narrow(0, 0, size);
}

// Every rank's block of a round as seen here; undefined for ranks whose
// blocks this rank does not receive, or received straight into place.
using Blocks = std::vector<at::Tensor>;

// Where a piece received from another rank lands directly (gatherFull: its
// full tensor), as `bytes` contiguous bytes. Either empty (everything goes
// through the round's buffer and the sink) or it places every piece: a
// rank's block is unpacked whole or not at all.
using Destination = std::function<at::Tensor(int64_t tensor, int64_t globalBegin, int64_t bytes)>;

// A block whose pieces average at least this many bytes moves piece by
// piece (one broadcast each, straight from the owner's local), smaller ones
// packed as one broadcast: a Gloo broadcast has a fixed latency that a
// 1 MiB piece amortizes, and piecewise saves its packing and unpacking.
constexpr int64_t kPiecewiseBytes = int64_t{1} << 20;

bool piecewise(const detail::Round& round, int64_t rank) {
  const auto& pieces = round.pieces[static_cast<size_t>(rank)];
  return pieces.size() == 1 ||
         (!pieces.empty() && round.blockBytes[static_cast<size_t>(rank)] >=
                                 kPiecewiseBytes * static_cast<int64_t>(pieces.size()));
}

// Rank r's pieces, one broadcast each, of exactly the piece's bytes: from
// the owner's local; on the others into `direct`'s places when it is set
// (the returned block stays undefined: nothing to unpack), else into rank
// r's block of the round's buffer (`buffer()`, allocated at first need).
at::Tensor broadcastPieces(Communicator& comm, const detail::Round& round, int64_t r,
                           const ShardLayout& layout, const std::vector<at::Tensor>& locals,
                           const std::string& tag, const std::function<at::Tensor()>& buffer,
                           const Destination& direct) {
  const int64_t me = comm.rank();
  at::Tensor block;
  for (const detail::Piece& p : round.pieces[static_cast<size_t>(r)]) {
    const int64_t bytes = p.count * locals[static_cast<size_t>(p.tensor)].element_size();
    at::Tensor target;
    if (r == me) {
      target = localPieceBytes(layout, locals, me, p);
    } else if (direct) {
      target = direct(p.tensor, p.globalBegin, bytes);
      TORCH_INTERNAL_ASSERT(target.defined() && target.numel() == bytes);
    } else {
      block = block.defined() ? block : buffer();
      target = block.narrow(0, p.blockOffset, bytes);
    }
    comm.broadcast(target, r, tag);
  }
  return block;
}

// Rank r's packed block, copied piece by piece to `direct`'s places.
void unpackInto(const detail::Round& round, int64_t r, const std::vector<at::Tensor>& locals,
                const at::Tensor& block, const Destination& direct) {
  for (const detail::Piece& p : round.pieces[static_cast<size_t>(r)]) {
    const int64_t bytes = p.count * locals[static_cast<size_t>(p.tensor)].element_size();
    copyBytes(direct(p.tensor, p.globalBegin, bytes), block.narrow(0, p.blockOffset, bytes));
  }
}

// To every rank: each owner broadcasts its block, packed or piecewise
// (every rank decides from the plan alone, so all agree on each size).
// With Gloo, W broadcasts take less time than one all-gather of the same
// bytes (gather_bench, docs/performance.md), and they move no padding.
Blocks moveToAll(Communicator& comm, const detail::Round& round, const ShardLayout& layout,
                 const std::vector<at::Tensor>& locals, const std::string& tag, at::Tensor& scratch,
                 const Destination& direct) {
  const int64_t me = comm.rank();
  Blocks blocks(static_cast<size_t>(comm.worldSize()));
  at::Tensor recv;  // the rank-major buffer, allocated when first needed
  int64_t offset = 0;
  for (int64_t r = 0; r < comm.worldSize(); ++r) {
    const int64_t bytes = round.blockBytes[static_cast<size_t>(r)];
    const auto buffer = [&, offset, bytes] {
      recv = recv.defined() ? recv : scratchBytes(scratch, round.totalBytes());
      return recv.narrow(0, offset, bytes);
    };
    if (piecewise(round, r)) {
      blocks[r] = broadcastPieces(comm, round, r, layout, locals, tag, buffer, direct);
    } else if (bytes > 0 && direct) {
      // gatherFull: each block is unpacked into place as soon as it lands,
      // so the buffer holds one block, not the round (1/W of the memory and
      // of its page faults).
      const at::Tensor block = scratchBytes(scratch, round.maxBlockBytes()).narrow(0, 0, bytes);
      if (r == me) {
        ownBlock(round, layout, locals, me, block);  // several pieces: packs
      }
      comm.broadcast(block, r, tag);
      if (r != me) {
        unpackInto(round, r, locals, block, direct);
      }
    } else if (bytes > 0) {
      blocks[r] = r == me ? ownBlock(round, layout, locals, me, buffer()) : buffer();
      comm.broadcast(blocks[r], r, tag);
    }
    offset += bytes;
  }
  return blocks;
}

// To one root: the uneven all-to-all Gloo accepts, everyone -> root.
Blocks moveToRoot(Communicator& comm, const detail::Round& round, const at::Tensor& own,
                  int64_t root, const std::string& tag, at::Tensor& scratch) {
  const int64_t worldSize = comm.worldSize();
  const int64_t me = comm.rank();
  Blocks blocks(static_cast<size_t>(worldSize));
  std::vector<int64_t> inSplits(static_cast<size_t>(worldSize), 0);
  std::vector<int64_t> outSplits(static_cast<size_t>(worldSize), 0);
  inSplits[static_cast<size_t>(root)] = own.numel();
  at::Tensor recv = scratchBytes(scratch, me == root ? round.totalBytes() : 0);
  if (me == root) {
    outSplits = round.blockBytes;
  }
  comm.allToAll(own, recv, inSplits, outSplits, tag);
  int64_t offset = 0;
  for (int64_t r = 0; me == root && r < worldSize; ++r) {
    if (r != me) {
      blocks[static_cast<size_t>(r)] = recv.narrow(0, offset, round.blockBytes[r]);
    }
    offset += round.blockBytes[static_cast<size_t>(r)];
  }
  return blocks;
}

// Moves one round (every rank derives the same choice from the plan).
Blocks moveRound(Communicator& comm, const detail::Round& round, const ShardLayout& layout,
                 const std::vector<at::Tensor>& locals, int64_t root, at::Tensor& scratch,
                 const Destination& direct) {
  const int64_t me = comm.rank();
  const int64_t total = round.totalBytes();
  const bool rootOnly = root >= 0 && total == round.blockBytes[static_cast<size_t>(root)];
  if (comm.worldSize() == 1 || total == 0 || rootOnly) {
    return Blocks(static_cast<size_t>(comm.worldSize()));  // nothing moves (every rank knows)
  }
  const std::string tag = detail::roundTag(kStreamingApi, layout, round);
  if (root < 0) {
    return moveToAll(comm, round, layout, locals, tag, scratch, direct);
  }
  return moveToRoot(comm, round, ownBlock(round, layout, locals, me, at::Tensor()), root, tag,
                    scratch);
}

// Hands the round's pieces to the sink in segment order, rank after rank:
// this rank's straight from its locals, the others' from `blocks` (skipped
// where undefined: not received here, or already in place).
void emitRound(const detail::Round& round, const ShardLayout& layout,
               const std::vector<at::Tensor>& locals, int64_t me, const Blocks& blocks,
               const PieceSink& sink) {
  std::vector<size_t> next(blocks.size(), 0);
  for (const detail::Segment& segment : round.segments) {
    const ShardSpec& spec = layout.specs[static_cast<size_t>(segment.tensor)];
    const at::Tensor& local = locals[static_cast<size_t>(segment.tensor)];
    if (spec.numel() == 0) {
      sink(spec, 0, at::empty({0}, local.options()));
      continue;
    }
    for (size_t r = 0; r < blocks.size(); ++r) {
      const auto& pieces = round.pieces[r];
      const bool mine = static_cast<int64_t>(r) == me;
      if ((mine || blocks[r].defined()) && next[r] < pieces.size() &&
          pieces[next[r]].tensor == segment.tensor) {
        const detail::Piece& p = pieces[next[r]++];
        const at::Tensor bytes =
            mine ? localPieceBytes(layout, locals, me, p)
                 : blocks[r].narrow(0, p.blockOffset, p.count * local.element_size());
        sink(spec, p.globalBegin, bytes.view(local.scalar_type()));
      }
    }
  }
}

// gatherStreaming, with pieces from other ranks landing in `direct`'s
// places where it gives one (those skip the sink).
void gatherInto(Communicator& comm, const ShardLayout& layout,
                const std::vector<at::Tensor>& locals, const PieceSink& sink,
                const GatherOptions& options, const Destination& direct) {
  // One header exchange checks call, layout, inputs and dtypes (a hash);
  // the dtypes themselves move only when the hashes differ.
  std::string localError = options.localError;
  if (localError.empty()) {
    localError =
        detail::checkCall(kStreamingApi, comm, layout, options.root, true, options.bufferBytes);
  }
  if (localError.empty()) {
    localError = checkLocals(layout, locals, comm.rank());
  }
  if (detail::agree(kStreamingApi, comm, layout, localError,
                    {options.root, options.bufferBytes, dtypeHash(locals)})) {
    explainDtypes(comm, layout, locals);
  }
  std::vector<int64_t> elementBytes;
  for (const at::Tensor& local : locals) {
    elementBytes.push_back(static_cast<int64_t>(local.element_size()));
  }
  const bool receiving = options.root < 0 || options.root == comm.rank();
  detail::RoundPlanner planner(layout, elementBytes, options.bufferBytes);
  detail::Round round;
  at::Tensor scratch;
  std::exception_ptr sinkError;  // see gather.h: the rounds run on, unsunk
  while (planner.next(round)) {
    const Blocks blocks = moveRound(comm, round, layout, locals, options.root, scratch, direct);
    if (receiving && !sinkError) {
      try {
        emitRound(round, layout, locals, comm.rank(), blocks, sink);
      } catch (...) {
        sinkError = std::current_exception();
      }
    }
  }
  if (sinkError) {
    std::rethrow_exception(sinkError);
  }
}

}  // namespace

void gatherStreaming(Communicator& comm, const ShardLayout& layout,
                     const std::vector<at::Tensor>& locals, const PieceSink& sink,
                     GatherOptions options) {
  gatherInto(comm, layout, locals, sink, options, Destination());
}

std::vector<std::pair<std::string, at::Tensor>> gatherFull(Communicator& comm,
                                                           const ShardLayout& layout,
                                                           const std::vector<at::Tensor>& locals,
                                                           GatherOptions options) {
  std::vector<at::Tensor> full(layout.specs.size());
  const auto fullOf = [&](size_t i) -> at::Tensor& {
    if (!full[i].defined()) {  // locals are checked by now: their dtype is every rank's
      full[i] = at::empty(layout.specs[i].globalShape, locals[i].options());
    }
    return full[i];
  };
  const PieceSink sink = [&](const ShardSpec& spec, int64_t offset, const at::Tensor& piece) {
    const size_t i = static_cast<size_t>(&spec - layout.specs.data());
    at::Tensor& target = fullOf(i);
    copyBytes(detail::bytesView(target).narrow(0, offset * target.element_size(), piece.nbytes()),
              detail::bytesView(piece));
  };
  // Whole pieces from other ranks are received straight into the result:
  // no buffer, no second copy.
  const Destination direct = [&](int64_t tensor, int64_t globalBegin, int64_t bytes) {
    at::Tensor& target = fullOf(static_cast<size_t>(tensor));
    return detail::bytesView(target).narrow(0, globalBegin * target.element_size(), bytes);
  };
  gatherInto(comm, layout, locals, sink, options, direct);
  std::vector<std::pair<std::string, at::Tensor>> result;
  if (options.root < 0 || options.root == comm.rank()) {
    for (size_t i = 0; i < full.size(); ++i) {
      result.emplace_back(layout.specs[i].name, full[i]);
    }
  }
  return result;
}

}  // namespace shard
}  // namespace shardema
