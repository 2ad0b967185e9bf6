#pragma once
// WeightSwap: EMA weights in live model tensors for a while (validation,
// evaluation), the raw values kept aside and written back after. The one
// swap of every lifecycle: EmaCallback's and PostHocCallback's validation,
// and the Python front's EMA.swap(); EMA.copy_to() (for good) goes through
// checkModelWritable(). DESIGN.md section 4.
//
// Memory: the raw values are kept in host memory (pinned where a target
// lives on a device, so the copy back is one DMA), never a second copy on
// the accelerator; host memory the size of the targets, for the swap's life.
//
// Every WeightSwap alive in the process is known, by the memory of its
// targets, so that swaps and updates cannot step on each other:
//   - a swap begins by fencing every Averager (fenceEveryAverager): no
//     update still reads what it is about to overwrite, and the swap's own
//     writes are not taken for the loop's (averager.h, SourceWrites);
//   - a second swap into memory another swap holds is refused, naming the
//     tensor and the holder: swaps do not nest (the second would keep the
//     first one's EMA as its raw values, and Lightning ends validation
//     hooks in the order it started them, not the reverse);
//   - Averager::update refuses to read memory a swap holds (swappedInBy):
//     it would fold another EMA's weights in as the model's.
//
// Threads: the training thread's, like the Averagers it fences; the
// registry itself is thread-safe.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardema {

class WeightSwap {
 public:
  /// Fences every Averager, registers `targets` (name, live tensor: a
  /// parameter, buffer or a view of one) for `owner` (who swaps, named in
  /// errors: "EmaCallback", "shardema.EMA"), and copies their values to host
  /// memory. Nothing is written into them yet (write() does). c10::Error
  /// naming the first target whose memory another swap holds, and the
  /// holder; nothing registered then. Blocks for the fences and the copies.
  WeightSwap(std::vector<std::pair<std::string, at::Tensor>> targets, std::string owner);
  /// restore() unless done; a failure to write the raw values back is
  /// warned about (a destructor must not throw).
  ~WeightSwap();
  WeightSwap(const WeightSwap&) = delete;
  WeightSwap& operator=(const WeightSwap&) = delete;

  /// Writes `values` into the targets of the same names (converted to each
  /// target's dtype and device; a value of another number of elements is a
  /// c10::ValueError naming it, checked before anything is written).
  /// Targets not named keep what they hold. Blocks until written.
  void write(const std::vector<std::pair<std::string, at::Tensor>>& values);
  /// Writes the raw values back and ends the swap (unregistered). Blocks.
  /// Idempotent. If a copy throws, the error propagates and the swap stays
  /// registered (the model still holds some EMA weights).
  void restore();
  /// Whether restore() has run.
  bool restored() const { return restored_; }
  /// The targets, as given.
  const std::vector<std::pair<std::string, at::Tensor>>& targets() const { return targets_; }

 private:
  std::vector<std::pair<std::string, at::Tensor>> targets_;
  std::vector<at::Tensor> raw_;  // host copies, one per target
  std::string owner_;
  bool restored_ = false;
};

/// The owner of the live WeightSwap whose targets share memory with
/// `tensor` (any overlap of their storage bytes), or nullopt. One atomic
/// load when no swap is alive. Any thread.
std::optional<std::string> swappedInBy(const at::Tensor& tensor);

/// Before writing `targets` for good (EMA.copy_to()): fences every
/// Averager, then c10::Error naming the first target a live WeightSwap
/// holds and its holder (the write would be undone when that swap ends).
/// `api` starts the message.
void checkModelWritable(const std::vector<std::pair<std::string, at::Tensor>>& targets,
                        const char* api);

}  // namespace shardema
