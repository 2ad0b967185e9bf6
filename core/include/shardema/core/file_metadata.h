#pragma once
// The metadata of shardema's files (DESIGN.md section 5) in one place: every
// key we write, the values of shardema.kind, how numbers are spelled
// (integers as plain decimal digits, doubles with 17 significant digits so
// they read back bit-exactly) and the one builder of deployable-weights
// metadata. A writer and its reader that share these cannot drift apart.
// Core only: pure functions, callable from any thread.
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace shardema {
namespace detail {

// Keys. Every file also carries kFormatKey (tensor_file.h), added by the
// writer.
constexpr const char* kKindKey = "shardema.kind";
constexpr const char* kStepKey = "shardema.step";
constexpr const char* kSigmaRelKey = "shardema.sigma_rel";
constexpr const char* kGammaKey = "shardema.gamma";
constexpr const char* kProfileIndexKey = "shardema.profile_index";
constexpr const char* kRankKey = "shardema.rank";
constexpr const char* kWorldSizeKey = "shardema.world_size";
constexpr const char* kLayoutKey = "shardema.layout";
constexpr const char* kSplitDimsKey = "shardema.split_dims";
constexpr const char* kLayoutFingerprintKey = "shardema.layout_fingerprint";
constexpr const char* kScheduleKey = "shardema.schedule";
constexpr const char* kSourceWorldSizeKey = "shardema.source_world_size";
constexpr const char* kSynthesisKey = "shardema.synthesis";
constexpr const char* kInitializedKey = "shardema.initialized";
constexpr const char* kLastDecayKey = "shardema.last_decay";
constexpr const char* kRolesKey = "shardema.roles";
/// The profiles of an Averager state of several (averager.h, AveragerStateInfo::profiles).
constexpr const char* kProfilesKey = "shardema.profiles";
/// XXH64 of an Averager state's own keys (averager.h, checkAveragerStateMetadata).
constexpr const char* kStateChecksumKey = "shardema.state_xxh64";
constexpr const char* kPostHocCallsKey = "shardema.posthoc.calls";
/// A deployable file's names written from the model, not the EMA (a JSON
/// list; ShardedAverager::exportWeights' untracked tensors).
constexpr const char* kFromModelKey = "shardema.from_model";
/// EmaCallback's progress keys ("shardema.ema.step", ...) in a training
/// checkpoint.
constexpr const char* kEmaCallbackPrefix = "shardema.ema.";

/// safetensors' own key, outside our prefix: "pt" says the file holds
/// PyTorch tensors, and transformers' from_pretrained refuses a file
/// without it (it reads the key to tell PyTorch files from TF/Flax ones).
/// Deployable files carry it.
constexpr const char* kSafetensorsFormatKey = "format";
constexpr const char* kPyTorchFormat = "pt";

// Values of kKindKey.
constexpr const char* kPostHocSnapshotKind = "posthoc_snapshot";
constexpr const char* kDeployableKind = "deployable_weights";
constexpr const char* kAveragerStateKind = "averager_state";
constexpr const char* kTrainingCheckpointKind = "training_checkpoint";

// Values of kSynthesisKey.
constexpr const char* kRawSynthesis = "raw";
constexpr const char* kNormalizedSynthesis = "normalized";

/// `value` as printf's %.17g: the shortest printf form that round-trips
/// every double through strtod, and the spelling the file format fixes.
std::string formatDecimal17(double value);

/// Parses what formatDecimal17 writes for a finite double, and nothing
/// else strtod would take: no leading spaces, hex, "inf", "nan" or trailing
/// text. Returns false (and leaves `value` untouched) on any such text.
bool parseFiniteDecimal(const std::string& text, double* value);

/// Parses plain decimal digits: no sign, no spaces, no leading zeros except
/// "0" itself (so every number has one spelling), no int64 overflow.
/// Returns false (and leaves `value` untouched) on any other text.
bool parseDecimalDigits(const std::string& text, int64_t* value);

/// What a deployable-weights file says about where its weights came from.
struct DeployableInfo {
  /// An EMA exported as it stands (ShardedAverager::exportWeights, the CLI's
  /// export): the schedule it ran and the world size it was trained on.
  struct Exported {
    /// DecaySchedule::toJson().
    std::string scheduleJson;
    int64_t sourceWorldSize = 0;
  };
  /// A post-hoc synthesis: the target profile and how the sum was formed.
  struct Synthesized {
    double sigmaRel = 0;
    double gamma = 0;
    /// True: weights scaled to sum to one (shardema.synthesis=normalized).
    bool normalized = false;
  };

  /// Training step the weights stand for.
  int64_t step = 0;
  /// Exactly one of these is set.
  std::optional<Exported> exported;
  std::optional<Synthesized> synthesized;
};

/// The metadata of a deployable-weights file: format = pt (safetensors'
/// key, which transformers requires), shardema.kind = deployable_weights
/// and shardema.step, plus shardema.schedule and
/// shardema.source_world_size for an exported EMA, or shardema.sigma_rel,
/// shardema.gamma (17 significant digits) and shardema.synthesis for a
/// synthesized one. TORCH_INTERNAL_ASSERT unless exactly one source is set.
std::map<std::string, std::string> deployableMetadata(const DeployableInfo& info);

}  // namespace detail
}  // namespace shardema
