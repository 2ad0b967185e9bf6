#include "gather_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace shardema {
namespace shard {
namespace detail {
namespace {

int64_t alignUp(int64_t bytes) {
  return (bytes + kPieceAlignment - 1) / kPieceAlignment * kPieceAlignment;
}

}  // namespace

int64_t Round::totalBytes() const {
  int64_t total = 0;
  for (int64_t bytes : blockBytes) {
    total += bytes;
  }
  return total;
}

int64_t Round::maxBlockBytes() const {
  return blockBytes.empty() ? 0 : *std::max_element(blockBytes.begin(), blockBytes.end());
}

RoundPlanner::RoundPlanner(const ShardLayout& layout, std::vector<int64_t> elementBytes,
                           int64_t bufferBytes)
    : layout_(layout), elementBytes_(std::move(elementBytes)), bufferBytes_(bufferBytes) {
  TORCH_INTERNAL_ASSERT(elementBytes_.size() == layout_.specs.size());
}

bool RoundPlanner::next(Round& round) {
  const int64_t worldSize = layout_.worldSize();
  round.segments.clear();
  round.pieces.assign(static_cast<size_t>(worldSize), {});
  round.blockBytes.assign(static_cast<size_t>(worldSize), 0);
  int64_t room = bufferBytes_;
  while (tensor_ < layout_.specs.size()) {
    const int64_t numel = layout_.specs[tensor_].numel();
    const int64_t elementBytes = elementBytes_[tensor_];
    int64_t fit = std::min(numel - offset_, room / elementBytes);
    if (fit <= 0 && numel > 0) {
      if (!round.segments.empty()) {
        break;
      }
      fit = 1;  // a buffer smaller than one element still moves one
    }
    const Segment segment{static_cast<int64_t>(tensor_), offset_, offset_ + fit};
    round.segments.push_back(segment);
    addPieces(round, segment);
    room -= fit * elementBytes;
    offset_ += fit;
    if (offset_ == numel) {
      ++tensor_;
      offset_ = 0;
    }
  }
  return !round.segments.empty();
}

void RoundPlanner::addPieces(Round& round, const Segment& segment) const {
  const ShardSpec& spec = layout_.specs[static_cast<size_t>(segment.tensor)];
  const int64_t elementBytes = elementBytes_[static_cast<size_t>(segment.tensor)];
  for (int64_t r = 0; r < layout_.worldSize(); ++r) {
    const ElementRange part =
        intersect(spec.ranges[static_cast<size_t>(r)], ElementRange{segment.begin, segment.end});
    if (part.empty()) {
      continue;
    }
    // Aligned offsets let a piece be viewed as its dtype in place (ATen's
    // dtype view wants the byte offset to be a multiple of the element).
    auto& bytes = round.blockBytes[static_cast<size_t>(r)];
    bytes = alignUp(bytes);
    round.pieces[static_cast<size_t>(r)].push_back(
        Piece{segment.tensor, part.begin, part.size(), bytes});
    bytes = alignUp(bytes + part.size() * elementBytes);
  }
}

uint64_t agreementHash(const ShardLayout& layout) {
  uint64_t hash = 14695981039346656037ull;
  const auto mix = [&hash](const void* data, size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) {
      hash = (hash ^ bytes[i]) * 1099511628211ull;
    }
  };
  const auto mixInt = [&mix](int64_t value) { mix(&value, sizeof value); };
  mixInt(static_cast<int64_t>(layout.specs.size()));
  for (const ShardSpec& spec : layout.specs) {
    mixInt(static_cast<int64_t>(spec.name.size()));
    mix(spec.name.data(), spec.name.size());
    mixInt(spec.numel());
    mixInt(spec.worldSize());
    for (const ElementRange& range : spec.ranges) {
      mixInt(range.begin);
      mixInt(range.end);
    }
  }
  return hash;
}

}  // namespace detail
}  // namespace shard
}  // namespace shardema
