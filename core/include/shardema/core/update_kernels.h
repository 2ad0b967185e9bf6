#pragma once
// Raw update kernels: fused fp32 EMA <- fp32/bf16/fp16 source, no torch, no
// temporaries. Every call runs on the calling thread and starts none: the
// layer that owns threads (offload) hands each one its part, a range of the
// spans' elements (offload/parallel_update.h; the pipeline's chunks), so
// work can never nest inside a worker. Memory bound by design: one read of
// the source, one read and one write of the EMA per element.
#include <cstdint>
#include <vector>

namespace shardema {

/// Element type of an update source (the EMA is always float32).
enum class SourceType { kFloat32, kBFloat16, kFloat16 };

/// Bytes per element of a source type (4 or 2).
int sourceTypeSize(SourceType type);

/// What one update does to one tracked tensor's EMA: the Averager decides
/// it (lib/src/averager.cpp), the pipeline carries it with the tensor's job
/// (offload), and the kernels here run kLerp and kCopy.
enum class UpdateOp {
  /// Nothing this update (kCopyOnce tensors after construction); never
  /// reaches the pipeline or a kernel.
  kSkip,
  /// ema[i] = ema[i] + weight * (src[i] - ema[i]), in float32.
  kLerp,
  /// ema[i] = float(src[i]): a float32 EMA set to its source (the first
  /// update, a weight of 1, a frozen tensor).
  kCopy,
  /// ema = src byte for byte: the EMA keeps the source's dtype (tensors
  /// that are copied, not averaged, such as integer buffers). The pipeline
  /// runs it as a memcpy; the kernels do not take it.
  kCopyRaw,
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
  /// kLerp or kCopy (callers validate: tensor_update.h, the pipeline).
  UpdateOp op = UpdateOp::kLerp;
};

/// Every element of the spans laid end to end.
constexpr int64_t kAllElements = INT64_MAX;

/// Applies the spans with the lerp weight `weight` (ignored by kCopy), on
/// the calling thread: the elements [begin, end) of the spans laid end to
/// end (every element by default), so that threads given disjoint ranges
/// share one call's work. Results do not depend on the split (no FMA
/// contraction). c10::ValueError for a negative count, an op other than
/// kLerp or kCopy, or begin < 0. Spans must not overlap each other's ema.
void updateSpans(const std::vector<UpdateSpan>& spans, float weight, int64_t begin = 0,
                 int64_t end = kAllElements);

// --- Several EMA profiles of one source in one pass (post-hoc EMA) -------
// Post-hoc EMA keeps one EMA per sigma_rel of the same weights. Updating
// them one at a time reads the source k times; these read it once, so k
// profiles move (2 or 4) + 8k bytes per element instead of k * (10 or 12).

/// Most profiles one multi call accepts (the weights live on the stack).
constexpr int kMaxProfiles = 16;

/// For each profile p in [0, numEmas): emas[p][i] += weights[p] * (src[i] -
/// emas[p][i]) for i in [0, count). Bit-identical to calling
/// lerpRange(emas[p], src, type, count, weights[p]) for each p.
/// c10::ValueError unless 1 <= numEmas <= kMaxProfiles. No two EMAs, nor an
/// EMA and src, may overlap.
void lerpRangeMulti(float* const* emas, const float* weights, int numEmas, const void* src,
                    SourceType type, int64_t count);
/// emas[p][i] = float(src[i]) for every profile; same limits as above.
void copyRangeMulti(float* const* emas, int numEmas, const void* src, SourceType type,
                    int64_t count);

/// One contiguous span of source with one EMA per profile.
struct MultiUpdateSpan {
  std::vector<float*> emas;
  const void* src = nullptr;
  SourceType type = SourceType::kFloat32;
  int64_t count = 0;
  UpdateOp op = UpdateOp::kLerp;
};

/// updateSpans for several profiles: profile p of every span is lerped with
/// weights[p] (kCopy ignores the weights), over the source elements
/// [begin, end) of the spans laid end to end (each updating every profile);
/// the result does not depend on the split. c10::ValueError for a negative
/// count, an op other than kLerp or kCopy, weights.size() not in [1,
/// kMaxProfiles], a span whose emas.size() != weights.size(), or begin < 0.
void updateSpansMulti(const std::vector<MultiUpdateSpan>& spans, const std::vector<float>& weights,
                      int64_t begin = 0, int64_t end = kAllElements);

/// Elements of the spans laid end to end (what the ranges above index).
int64_t totalElements(const std::vector<UpdateSpan>& spans);
int64_t totalElements(const std::vector<MultiUpdateSpan>& spans);

}  // namespace shardema
