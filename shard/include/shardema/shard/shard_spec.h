#pragma once
// ShardSpec: which elements of one global tensor each rank of a job owns,
// as element ranges of the row-major flattened tensor (docs/spec/shard_layouts.md).
// One representation serves replicated, FSDP2, FSDP1 and per-rank layouts.
// Pure arithmetic: nothing here communicates.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardema {
namespace shard {

/// Half-open range [begin, end) of flattened element indices.
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;

  int64_t size() const { return end - begin; }
  bool empty() const { return end == begin; }
  bool operator==(const ElementRange& other) const {
    return begin == other.begin && end == other.end;
  }
  bool operator!=(const ElementRange& other) const { return !(*this == other); }
};

/// The intersection of two ranges (empty, with begin == end, when disjoint).
ElementRange intersect(const ElementRange& a, const ElementRange& b);

enum class LayoutKind {
  /// DDP: every rank holds the whole tensor; ownership of the EMA is still
  /// split as FSDP2 chunks of dim 0 so each rank averages 1/W of it.
  kReplicated,
  /// Rank-0 full copy: rank 0 owns everything, the others nothing.
  kRankZero,
  /// FSDP2 fully_shard: torch.chunk on dim 0 (trailing ranks may be empty).
  kFsdp2,
  /// FSDP1 FlatParameter: a contiguous slice of the flat parameter, which
  /// may cut a tensor anywhere (see FlatParamLayout).
  kFsdp1,
  /// Every rank keeps the whole tensor as its own: a tensor the ranks do not
  /// keep equal, such as BatchNorm statistics under DDP (which broadcasts
  /// rank 0's only at the next forward) and FSDP2 (which never does). Each
  /// rank's local is all of its own copy (heldRange), so each rank keeps the
  /// EMA of its own tensor; rank 0's copy is the tensor wherever one value
  /// stands for the job (gathers, files, exports, resharding), as it is
  /// DDP's authority. So the ranges are kRankZero's: rank 0 [0, numel), the
  /// others empty. Costs the tensor's size on every rank (buffers: small).
  kPerRank,
};

/// "replicated", "rank0", "fsdp2", "fsdp1", "per_rank"
const char* layoutKindName(LayoutKind kind);
/// Parses layoutKindName() output; c10::ValueError naming the text otherwise.
LayoutKind parseLayoutKind(const std::string& name);

/// How one global tensor is split over every rank of a job. Carries the
/// global shape and every rank's range, so each rank knows every other
/// rank's piece size without asking (uneven shards never make ranks
/// disagree on sizes).
struct ShardSpec {
  /// Global (module) name of the tensor.
  std::string name;
  /// Global shape; {} for a 0-dim tensor (numel 1).
  std::vector<int64_t> globalShape;
  /// Dtype of the source (the EMA itself is float32).
  c10::ScalarType dtype = c10::ScalarType::Float;
  LayoutKind kind = LayoutKind::kFsdp2;
  /// One range per rank (size = world size). Disjoint, union [0, numel()).
  std::vector<ElementRange> ranges;

  int64_t worldSize() const { return static_cast<int64_t>(ranges.size()); }
  /// Product of globalShape (1 for 0-dim).
  int64_t numel() const;
  /// ranges[rank]: the elements `rank` stands for in gathers, files and
  /// resharding. c10::IndexError naming the tensor for a bad rank.
  const ElementRange& rangeOf(int64_t rank) const;
  /// The elements `rank`'s local tensor holds: rangeOf(rank), except under
  /// kPerRank, where every rank holds its own copy of all of them
  /// ([0, numel)). c10::IndexError naming the tensor for a bad rank.
  ElementRange heldRange(int64_t rank) const;
  bool operator==(const ShardSpec& other) const;
  bool operator!=(const ShardSpec& other) const { return !(*this == other); }
};

/// Checks a spec's invariants: non-empty name, non-negative dims, at least
/// one rank, and ranges that tile [0, numel()) in rank order:
/// ranges[0].begin == 0, ranges[r].begin == ranges[r-1].end, the last end ==
/// numel(). So they are disjoint and cover the tensor, and an empty range
/// sits where the previous one ended (e.g. [numel, numel) for trailing FSDP2
/// ranks; FSDP1 members before rank r's slice get [0, 0)). Every spec made
/// here has that canonical form, which keeps == and fingerprints meaningful.
/// A kPerRank spec's ranges are rank 0's [0, numel) and empty elsewhere.
/// c10::ValueError naming the tensor and the broken invariant.
void checkShardSpec(const ShardSpec& spec);

/// FSDP2's dim-0 chunk of `rank`: c = ceil(d0 / W), rows [min(r*c, d0),
/// min((r+1)*c, d0)), times the inner size. 0-dim tensors: rank 0 owns the
/// one element. c10::ValueError for a bad rank, world size or shape.
ElementRange fsdp2Range(const std::vector<int64_t>& globalShape, int64_t rank, int64_t worldSize);

/// Whole-tensor specs of the per-tensor layouts. kReplicated uses the
/// FSDP2 ranges; kRankZero and kPerRank give rank 0 [0, numel) and the
/// others [numel, numel). c10::ValueError naming the tensor for
/// worldSize < 1 or a negative dim.
ShardSpec fsdp2Spec(const std::string& name, const std::vector<int64_t>& globalShape,
                    c10::ScalarType dtype, int64_t worldSize);
ShardSpec replicatedSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                         c10::ScalarType dtype, int64_t worldSize);
ShardSpec rankZeroSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                       c10::ScalarType dtype, int64_t worldSize);
ShardSpec perRankSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                      c10::ScalarType dtype, int64_t worldSize);
/// The spec of `kind` (kFsdp2, kReplicated, kRankZero or kPerRank: one of
/// the four above). kFsdp1 is a c10::ValueError naming the tensor: its
/// specs come from a FlatParamLayout.
ShardSpec layoutSpec(const std::string& name, const std::vector<int64_t>& globalShape,
                     c10::ScalarType dtype, LayoutKind kind, int64_t worldSize);

}  // namespace shard
}  // namespace shardema
