// UpdatePipeline::copyTo: host tensors (the EMA) into their
// destinations (the model's tensors, on any device) through the engine.
#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "error_text.h"
#include "shardema/offload/update_pipeline.h"

namespace shardema::offload {
namespace {

void checkSwapJob(const SwapJob& job) {
  const char* api = "UpdatePipeline::copyTo";
  TORCH_CHECK_VALUE(job.host.defined() && job.destination.defined(), api, ": tensor '", job.name,
                    "' has an undefined host or destination tensor");
  TORCH_CHECK_VALUE(job.host.device().is_cpu() && job.host.is_contiguous(), api, ": host tensor '",
                    job.name, "' must be a contiguous CPU tensor");
  TORCH_CHECK_VALUE(job.host.sizes() == job.destination.sizes(), api, ": tensor '", job.name,
                    "' has host shape ", job.host.sizes(), " but destination shape ",
                    job.destination.sizes());
}

// Whether queueSwapCopies converts `job` through a staging slot: a
// contiguous destination of another dtype, unless it is in host memory and
// the engine copies on the host's timeline (then nothing queued on another
// timeline can still read it, and ATen converts it in place, unstaged).
bool stagesConversion(const SwapJob& job, const CopyEngine& engine) {
  const at::Tensor& dst = job.destination;
  return dst.numel() > 0 && dst.is_contiguous() && dst.scalar_type() != job.host.scalar_type() &&
         !(dst.device().is_cpu() && engine.copiesOnHostTimeline());
}

}  // namespace

// Outstanding copies of one copyTo call. Callbacks run on the
// engine's thread; engine->synchronize() is called before this goes away.
struct UpdatePipeline::SwapState {
  std::mutex mutex;
  std::condition_variable slotFreed;
  std::vector<bool> slotBusy;  // guarded by mutex
  std::string error;           // first copy error, guarded by mutex
  const std::string* errorName = nullptr;

  // The message is taken on the engine's thread: the exception object
  // itself never crosses threads.
  void done(int slot, const std::string* name, std::exception_ptr e);
};

void UpdatePipeline::SwapState::done(int slot, const std::string* name, std::exception_ptr e) {
  const std::string message = e ? detail::describeError(e) : std::string();
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (e && error.empty()) {
      error = message;
      errorName = name;
    }
    if (slot >= 0) slotBusy[slot] = false;
  }
  slotFreed.notify_all();
}

void UpdatePipeline::copyTo(const std::vector<SwapJob>& jobs) {
  wait();
  int64_t converted = 0;  // the largest staged conversion, bytes
  int64_t chunks = 0;     // the staging slots they take in turn
  for (const SwapJob& job : jobs) {
    checkSwapJob(job);
    if (stagesConversion(job, *options_.engine)) {
      // queueSwapCopies' cut: chunkBytes / element size elements a chunk.
      const int64_t perChunk = options_.chunkBytes / job.destination.element_size();
      converted = std::max(converted, std::min(perChunk, job.destination.numel()) *
                                          job.destination.element_size());
      chunks += (job.destination.numel() + perChunk - 1) / perChunk;
    }
  }
  // Nothing is in flight (wait() above): the slots the conversions take in
  // turn (chunk k in slot k % numSlots) are allocated or grown here, before
  // the first copy.
  const auto slots = static_cast<int>(std::min<int64_t>(options_.numSlots, chunks));
  for (int slot = 0; slot < slots; ++slot) reserveSlot(slot, converted);
  SwapState state;
  state.slotBusy.assign(options_.numSlots, false);
  CopyEngine& engine = *options_.engine;
  // The destinations may still be read by the training side's queued work.
  engine.recordProducerPoint();
  try {
    queueSwapCopies(jobs, state);
  } catch (...) {
    engine.synchronize();  // callbacks point at `state`
    throw;
  }
  engine.synchronize();
  TORCH_CHECK(state.error.empty(), "UpdatePipeline::copyTo: copying tensor '", *state.errorName,
              "' to its destination failed: ", state.error);
}

void UpdatePipeline::queueSwapCopies(const std::vector<SwapJob>& jobs, SwapState& state) {
  CopyEngine& engine = *options_.engine;
  int nextSlot = 0;
  for (const SwapJob& job : jobs) {
    const std::string* name = &job.name;
    at::Tensor dst = job.destination;
    if (dst.numel() == 0) continue;
    if (!dst.is_contiguous()) {
      // Rare (parameters are contiguous): ATen's own copy on this thread.
      engine.synchronize();
      dst.detach().copy_(job.host);
      continue;
    }
    if (dst.scalar_type() != job.host.scalar_type() && !stagesConversion(job, engine)) {
      dst.detach().copy_(job.host);  // see stagesConversion
      continue;
    }
    auto* dstBytes = static_cast<char*>(dst.data_ptr());
    if (dst.scalar_type() == job.host.scalar_type()) {
      // Same dtype: straight from the (pinned) host tensor, one copy.
      engine.copyFromHost(job.host.data_ptr(), dstBytes, static_cast<size_t>(job.host.nbytes()),
                          [&state, name](std::exception_ptr e) { state.done(-1, name, e); });
      continue;
    }
    // Another dtype: convert chunk by chunk into a staging slot, then copy.
    const int64_t size = dst.element_size();
    const int64_t perChunk = options_.chunkBytes / size;
    const at::Tensor flat = job.host.view({-1});
    for (int64_t first = 0; first < flat.numel(); first += perChunk) {
      const int64_t count = std::min(perChunk, flat.numel() - first);
      const int slot = nextSlot;
      nextSlot = (nextSlot + 1) % options_.numSlots;
      {
        std::unique_lock<std::mutex> lock(state.mutex);
        state.slotFreed.wait(lock, [&] { return !state.slotBusy[slot]; });
        state.slotBusy[slot] = true;
      }
      at::Tensor staged = staging_[slot].narrow(0, 0, count * size).view(dst.scalar_type());
      staged.copy_(flat.narrow(0, first, count));
      engine.copyFromHost(
          stagingData_[slot], dstBytes + first * size, static_cast<size_t>(count * size),
          [&state, slot, name](std::exception_ptr e) { state.done(slot, name, e); });
    }
  }
}

}  // namespace shardema::offload
