#pragma once
// ShardLayout: every tracked tensor's ShardSpec for one job. It is what a
// per-rank checkpoint records (as JSON plus a fingerprint) so a load can
// tell "same layout" from "needs resharding".
#include <cstdint>
#include <string>
#include <vector>

#include "shardema/shard/shard_spec.h"

namespace shardema {
namespace shard {

struct ShardLayout {
  /// In tracking order; names unique; all with the same world size.
  std::vector<ShardSpec> specs;

  /// World size shared by the specs (0 when there are none).
  int64_t worldSize() const;
  /// checkShardSpec for each, unique names, one world size; c10::ValueError.
  void check() const;
  /// Spec by name; c10::IndexError naming it when absent.
  const ShardSpec& at(const std::string& name) const;

  /// Canonical JSON text (stable across runs and machines: no whitespace,
  /// fixed key order), e.g.
  ///   {"format":1,"world_size":2,"tensors":[{"name":"w","kind":"fsdp2",
  ///    "dtype":"F32","shape":[3,2],"ranges":[[0,4],[4,6]]}]}
  /// kind as layoutKindName(), dtype as the safetensors code (F64, F32, F16,
  /// BF16, I64, I32, I16, I8, U8, BOOL; another dtype is a c10::ValueError
  /// naming the tensor). An empty layout has world_size 0.
  /// fromJson validates (check(), unknown keys, types, world_size matching
  /// every entry) and names the offending entry on error (c10::ValueError).
  std::string toJson() const;
  static ShardLayout fromJson(const std::string& text);
  /// 16 hex digits: XXH64 of toJson(). Equal layouts, equal fingerprints.
  std::string fingerprint() const;
  /// One line for error messages, e.g. "fsdp2 over 4 ranks, 12 tensors,
  /// fingerprint 0123456789abcdef".
  std::string describe() const;
};

/// A layout of the same tensors (names, shapes, dtypes, kinds, order) for
/// another world size: what resharding W -> W' targets. kFsdp1 specs cannot
/// be re-derived per tensor (the cut depends on the unit's other members)
/// and become kFsdp2; the returned specs' kind says so. c10::ValueError only
/// for worldSize < 1.
ShardLayout relayout(const ShardLayout& layout, int64_t worldSize);

/// What first tells `saved` from `here`, naming the tensor, for errors of a
/// load into another model: "tensor 'w' has shape [4, 3] in the checkpoint
/// but [5, 3] here" (also: missing on one side, dtype, kind, ranges,
/// order). Empty when the layouts are equal.
std::string layoutDifference(const ShardLayout& saved, const ShardLayout& here);

}  // namespace shard
}  // namespace shardema
