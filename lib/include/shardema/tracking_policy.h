#pragma once
// What happens to each tensor of a model: averaged, copied, or copied once.
// Spec section 7: the default follows the VersatIL callback, the option
// follows ema-pytorch.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace shardema {

enum class TrackRole {
  /// fp32 EMA: ema = lerp(ema, source, 1 - decay) on every due update.
  kAverage,
  /// Copied from the source on every due update (kept in the source dtype).
  kCopy,
  /// Copied when the Averager is built and then left alone (ema-pytorch's
  /// integer buffers keep their deepcopy-time value).
  kCopyOnce,
  /// fp32 storage; averaged on updates where the source requires grad and
  /// copied on the others. VersatIL asks requires_grad at every update, so a
  /// layer unfrozen (or frozen) mid-training changes treatment with it.
  kAverageIfTrainable,
};

enum class TrackingPolicy {
  /// VersatIL (default): every buffer copied; parameters of BatchNorm
  /// modules copied; other floating parameters kAverageIfTrainable (averaged
  /// while requires_grad, copied while frozen, decided at each update).
  kVersatil,
  /// ema-pytorch: floating parameters and floating buffers averaged
  /// (requires_grad and BatchNorm play no role); integer/bool tensors copied
  /// once.
  kEmaPytorch,
};

/// Whether a role keeps float32 storage that lerps (kAverage,
/// kAverageIfTrainable) rather than a copy in the source dtype.
inline bool isAveragingRole(TrackRole role) {
  return role == TrackRole::kAverage || role == TrackRole::kAverageIfTrainable;
}

/// What a policy needs to know about one tensor of a module.
struct TensorTraits {
  bool isBuffer = false;
  bool isFloating = true;
  bool requiresGrad = true;
  /// The tensor is a direct parameter/buffer of a BatchNorm module.
  bool inBatchNorm = false;
};

/// The role a policy gives a tensor.
TrackRole roleFor(TrackingPolicy policy, const TensorTraits& traits);

const char* trackRoleName(TrackRole role);
/// Parses trackRoleName() output; c10::ValueError naming the text otherwise.
TrackRole parseTrackRole(const std::string& name);

/// One tensor an Averager follows. `source` is a handle to the live tensor
/// (a module parameter or buffer): the Averager reads it at every update and
/// writes it only when asked to (swapping EMA weights in).
struct TrackedTensor {
  std::string name;
  at::Tensor source;
  TrackRole role = TrackRole::kAverage;
  /// The source changes outside the optimizer step: buffers such as
  /// BatchNorm running statistics, which the forward pass updates while an
  /// asynchronous update may still be reading them. Such a tensor is read
  /// synchronously inside Averager::update() (into a host snapshot the
  /// background update then uses), so fence() only has to cover tensors the
  /// optimizer writes. trackModule() sets it for every buffer. Default false.
  bool changesInForward = false;
  /// The version counter that in-place writes to the tensor bump, when it
  /// is not the source's own: a DTensor's local tensor (the source) keeps
  /// its counter while the optimizer's writes through the DTensor bump the
  /// DTensor's. A handle: it keeps no tensor alive. Default: the source's.
  /// How writes are judged: SourceWrites (averager.h).
  std::optional<c10::VariableVersion> writeVersion = std::nullopt;
};

}  // namespace shardema
