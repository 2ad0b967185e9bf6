#include "shardema/shard/flat_param_layout.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_set>
#include <utility>

namespace shardema {
namespace shard {
namespace {

constexpr const char* kFlatLayoutApi = "FlatParamLayout";
// FSDP1 aligns every original parameter to 16 bytes with use_orig_params.
constexpr int64_t kAlignmentBytes = 16;

int64_t memberNumel(const FlatParamMember& member) {
  int64_t numel = 1;
  for (size_t d = 0; d < member.shape.size(); ++d) {
    TORCH_CHECK_VALUE(member.shape[d] >= 0, kFlatLayoutApi, ": member '", member.name, "' has negative dim ",
                      d, " (", member.shape[d], ")");
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(numel, member.shape[d], &numel), kFlatLayoutApi, ": member '",
                      member.name, "' has more elements than int64 can count");
  }
  return numel;
}

void checkNames(const std::vector<FlatParamMember>& members) {
  std::unordered_set<std::string> seen;
  for (const FlatParamMember& member : members) {
    TORCH_CHECK_VALUE(!member.name.empty(), kFlatLayoutApi, ": a member has an empty name");
    TORCH_CHECK_VALUE(seen.insert(member.name).second, kFlatLayoutApi, ": member '", member.name,
                      "' appears twice (a shared parameter counts once, at its first owner)");
  }
}

int64_t alignmentElements(c10::ScalarType dtype) {
  const int64_t size = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK_VALUE(size > 0 && kAlignmentBytes % size == 0, kFlatLayoutApi, ": dtype ", dtype, " has ", size,
                    "-byte elements, which do not divide the 16-byte alignment");
  return kAlignmentBytes / size;
}

int64_t checkedAdd(int64_t a, int64_t b) {
  int64_t sum = 0;
  TORCH_CHECK_VALUE(!__builtin_add_overflow(a, b, &sum), kFlatLayoutApi,
                    ": the flat parameter has more elements than int64 can count");
  return sum;
}

}  // namespace

FlatParamLayout::FlatParamLayout(std::vector<FlatParamMember> members, c10::ScalarType dtype,
                                 int64_t worldSize, FlatParamOptions options)
    : members_(std::move(members)), dtype_(dtype), worldSize_(worldSize) {
  TORCH_CHECK_VALUE(worldSize_ >= 1, kFlatLayoutApi, ": world size must be >= 1, got ", worldSize_);
  checkNames(members_);
  const int64_t align = options.useOrigParams ? alignmentElements(dtype_) : 1;
  int64_t length = 0;
  offsets_.reserve(members_.size());
  for (const FlatParamMember& member : members_) {
    const int64_t numel = memberNumel(member);
    // FSDP pads before every member, empty ones included, so a trailing
    // empty member can still lengthen the flat parameter.
    length = checkedAdd(length, (align - length % align) % align);
    offsets_.push_back(length);
    length = checkedAdd(length, numel);
  }
  unpaddedNumel_ = length;
  paddedNumel_ = checkedAdd(length, (worldSize_ - length % worldSize_) % worldSize_);
}

int64_t FlatParamLayout::memberOffset(size_t i) const {
  TORCH_CHECK_INDEX(i < members_.size(), kFlatLayoutApi, "::memberOffset: member ", i, " of ",
                    members_.size());
  return offsets_[i];
}

std::vector<ShardSpec> FlatParamLayout::specs() const {
  const int64_t shard = shardNumel();
  std::vector<ShardSpec> specs;
  specs.reserve(members_.size());
  for (size_t i = 0; i < members_.size(); ++i) {
    ShardSpec spec;
    spec.name = members_[i].name;
    spec.globalShape = members_[i].shape;
    spec.dtype = dtype_;
    spec.kind = LayoutKind::kFsdp1;
    const int64_t numel = memberNumel(members_[i]);
    // Clamping rank r's slice [r*S, (r+1)*S) to the member gives its piece
    // in member-local indices; an empty piece lands where the tiling needs
    // it (0 before the member, numel after it).
    for (int64_t r = 0; r < worldSize_; ++r) {
      const int64_t begin = std::clamp(r * shard - offsets_[i], int64_t{0}, numel);
      const int64_t end = std::clamp((r + 1) * shard - offsets_[i], int64_t{0}, numel);
      spec.ranges.push_back({begin, end});
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

int64_t FlatParamLayout::localOffset(size_t i, int64_t rank) const {
  TORCH_CHECK_INDEX(i < members_.size(), kFlatLayoutApi, "::localOffset: member ", i, " of ",
                    members_.size());
  TORCH_CHECK_INDEX(rank >= 0 && rank < worldSize_, kFlatLayoutApi, "::localOffset: rank ", rank,
                    " outside [0, ", worldSize_, ")");
  const int64_t shard = shardNumel();
  const int64_t numel = memberNumel(members_[i]);
  const int64_t begin = std::clamp(rank * shard, offsets_[i], offsets_[i] + numel);
  const int64_t end = std::clamp((rank + 1) * shard, offsets_[i], offsets_[i] + numel);
  return begin == end ? 0 : begin - rank * shard;
}

}  // namespace shard
}  // namespace shardema
