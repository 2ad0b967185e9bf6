#pragma once
// at::Tensor front of the update kernels: validates, then calls the raw
// kernels on the tensors' memory (no temporaries, no ATen ops).
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "shardema/core/update_kernels.h"

namespace shardema {

/// One EMA tensor and the source it follows.
struct TensorUpdate {
  /// float32, contiguous, CPU. Updated in place.
  at::Tensor ema;
  /// float32, bfloat16 or float16, CPU, contiguous, same shape as ema.
  at::Tensor source;
  UpdateOp op = UpdateOp::kLerp;
  /// Used in error messages; may be empty.
  std::string name;
};

/// Checks one pair; throws c10::TypeError (dtype) or c10::ValueError
/// (shape, device, layout, ema and source sharing memory) naming `name` and
/// the argument. A non-contiguous source is an error that says to pass
/// source.contiguous().
void checkTensorUpdate(const TensorUpdate& update);

/// Maps a source dtype to SourceType; c10::TypeError for other dtypes.
SourceType sourceTypeOf(const at::Tensor& source, const std::string& name);

/// ema = lerp(ema, source, weight) for kLerp, ema = source for kCopy, for
/// every entry. weight = 1 - decay, in [0, 1] (c10::ValueError otherwise).
/// Validates all entries before touching any (two entries whose emas share
/// memory are refused too: they would race). Runs on the calling thread
/// (offload::updateOnPool(pool, spansOf(updates, weight), weight) spreads
/// the same work over a pool). Writes through the raw memory: autograd
/// version counters are not bumped.
void applyTensorUpdates(const std::vector<TensorUpdate>& updates, double weight);

/// The raw spans of `updates` after the checks of applyTensorUpdates (same
/// errors); the tensors must outlive the spans.
std::vector<UpdateSpan> spansOf(const std::vector<TensorUpdate>& updates, double weight);

/// Convenience forms for one tensor.
void lerpInto(const at::Tensor& ema, const at::Tensor& source, double weight);
void copyInto(const at::Tensor& ema, const at::Tensor& source);

}  // namespace shardema
