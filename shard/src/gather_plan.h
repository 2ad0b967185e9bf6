#pragma once
// Internal: the rounds of gather/scatter. Every rank derives the same plan
// from the layout and the agreed element sizes, so no sizes are exchanged.
//
// A round is a window of the model's flattened tensors, in layout order,
// of at most bufferBytes; it may hold the tail of one tensor, several small
// tensors and the head of the next. Rank r's block in a round is its
// elements of the window (its range intersected with each segment),
// concatenated in segment order. The receiver's buffer holds the blocks
// rank after rank (rank-major): because ranges are ordered by rank, the
// pieces of one segment, taken rank after rank, run in increasing offset.
#include <cstdint>
#include <string>
#include <vector>

#include "shardema/shard/shard_layout.h"

namespace shardema {
namespace shard {
namespace detail {

/// Pieces start at multiples of this many bytes inside a block, and blocks
/// are padded to it, so every piece can be viewed as its dtype in place.
constexpr int64_t kPieceAlignment = 16;

/// Elements [begin, end) of layout.specs[tensor] fall in this round.
struct Segment {
  int64_t tensor = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

/// One rank's run of one segment: `count` elements from global offset
/// `globalBegin`, at byte `blockOffset` of that rank's block.
struct Piece {
  int64_t tensor = 0;
  int64_t globalBegin = 0;
  int64_t count = 0;
  int64_t blockOffset = 0;
};

struct Round {
  std::vector<Segment> segments;
  /// pieces[r]: rank r's pieces, in segment order.
  std::vector<std::vector<Piece>> pieces;
  /// blockBytes[r]: size of rank r's block.
  std::vector<int64_t> blockBytes;

  int64_t totalBytes() const;
  int64_t maxBlockBytes() const;
};

/// Cuts the layout into rounds of at most bufferBytes (at least one
/// element per round, so a tiny buffer still makes progress).
class RoundPlanner {
 public:
  RoundPlanner(const ShardLayout& layout, std::vector<int64_t> elementBytes, int64_t bufferBytes);
  /// The next round; false when every tensor has been covered.
  bool next(Round& round);

 private:
  void addPieces(Round& round, const Segment& segment) const;

  const ShardLayout& layout_;
  std::vector<int64_t> elementBytes_;
  int64_t bufferBytes_;
  size_t tensor_ = 0;
  int64_t offset_ = 0;
};

/// 64-bit FNV-1a of what every rank must agree on before data moves: world
/// size, names, element counts and every rank's range. (Not the layout's
/// public fingerprint: that one hashes the canonical JSON, which is more
/// than a gather needs and slower to build at every call.)
uint64_t agreementHash(const ShardLayout& layout);

}  // namespace detail
}  // namespace shard
}  // namespace shardema
