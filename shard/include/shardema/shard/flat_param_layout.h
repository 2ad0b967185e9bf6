#pragma once
// FSDP1 FlatParameter layout of one FSDP unit (docs/spec/shard_layouts.md,
// pytorch torch/distributed/fsdp/_flat_param.py): the members are laid end
// to end in one 1-D flat parameter (16-byte aligned with use_orig_params),
// right-padded to a multiple of W; rank r owns [r*S, (r+1)*S).
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shardema/shard/shard_spec.h"

namespace shardema {
namespace shard {

/// One original parameter of an FSDP unit, in named_modules() then
/// named_parameters(recurse=False) order, shared parameters once.
struct FlatParamMember {
  std::string name;
  std::vector<int64_t> shape;
};

struct FlatParamOptions {
  /// true (FSDP1 use_orig_params=True): padding before each member so it
  /// starts at a multiple of 16 bytes / element size. false: no alignment
  /// padding (members packed).
  bool useOrigParams = true;
};

class FlatParamLayout {
 public:
  /// Lays the members out for `worldSize` ranks. All members share the flat
  /// parameter's dtype (float32, bfloat16 or float16 in practice; any dtype
  /// whose element size divides 16 is accepted). Alignment padding goes
  /// before every member, empty ones included, as FSDP does; the first
  /// member starts at 0. c10::ValueError for an empty or duplicate name, a
  /// negative dim or worldSize < 1.
  FlatParamLayout(std::vector<FlatParamMember> members, c10::ScalarType dtype, int64_t worldSize,
                  FlatParamOptions options = {});

  const std::vector<FlatParamMember>& members() const { return members_; }
  c10::ScalarType dtype() const { return dtype_; }
  int64_t worldSize() const { return worldSize_; }
  /// Where member i starts in the flat parameter (after its alignment padding).
  int64_t memberOffset(size_t i) const;
  /// Length before / after the right padding to a multiple of W.
  int64_t unpaddedNumel() const { return unpaddedNumel_; }
  int64_t paddedNumel() const { return paddedNumel_; }
  /// Elements in every rank's local flat shard (S), padding included.
  int64_t shardNumel() const { return paddedNumel_ / worldSize_; }

  /// One kFsdp1 ShardSpec per member: rank r's range is the part of the
  /// member inside [r*S, (r+1)*S), mapped to the member's own flattened
  /// indices. Padding is in no spec.
  std::vector<ShardSpec> specs() const;
  /// Where member i's piece starts inside rank's local flat shard (the
  /// offset of spec.ranges[rank].begin); 0 when that piece is empty.
  int64_t localOffset(size_t i, int64_t rank) const;

 private:
  std::vector<FlatParamMember> members_;
  c10::ScalarType dtype_;
  int64_t worldSize_;
  std::vector<int64_t> offsets_;
  int64_t unpaddedNumel_ = 0;
  int64_t paddedNumel_ = 0;
};

}  // namespace shard
}  // namespace shardema
