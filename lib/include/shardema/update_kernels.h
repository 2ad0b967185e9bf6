#pragma once
// Raw update kernels: fused fp32 EMA <- fp32/bf16/fp16 source, no torch, no
// temporaries. Single-threaded per call; updateSpans() spreads work over a
// WorkerPool. Memory bound by design: one read of the source, one read and
// one write of the EMA per element.
#include <cstdint>
#include <vector>

namespace shardema {

class WorkerPool;

/// Element type of an update source (the EMA is always float32).
enum class SourceType { kFloat32, kBFloat16, kFloat16 };

/// Bytes per element of a source type (4 or 2).
int sourceTypeSize(SourceType type);

enum class UpdateOp {
  /// ema[i] = ema[i] + weight * (src[i] - ema[i]), in float32.
  kLerp,
  /// ema[i] = float(src[i]).
  kCopy,
};

/// ema[i] += weight * (src[i] - ema[i]) for i in [0, count). src holds
/// `count` elements of `type`; buffers must not overlap.
void lerpRange(float* ema, const void* src, SourceType type, int64_t count, float weight);
/// ema[i] = float(src[i]) for i in [0, count).
void copyRange(float* ema, const void* src, SourceType type, int64_t count);

/// One contiguous span to update.
struct UpdateSpan {
  float* ema = nullptr;
  const void* src = nullptr;
  SourceType type = SourceType::kFloat32;
  int64_t count = 0;
  UpdateOp op = UpdateOp::kLerp;
};

/// Applies every span with the lerp weight `weight` (ignored by kCopy). The
/// total work is cut into pieces of at least `minGrain` elements balanced
/// over the pool's threads and the caller, so one huge tensor and a thousand
/// small ones both use every core. pool == nullptr runs on the caller.
/// Blocks until done. Results do not depend on the split (no FMA contraction).
/// c10::ValueError for minGrain < 1 or a negative count. Spans must not
/// overlap each other's ema.
void updateSpans(const std::vector<UpdateSpan>& spans, float weight, WorkerPool* pool,
                 int64_t minGrain = 1 << 15);

}  // namespace shardema
