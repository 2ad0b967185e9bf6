#pragma once
// Internal to lib/src: the EmaStore of EmaStorage::kPinnedHost (what it
// promises: averager.h; the data path: DESIGN.md section 2), over one
// UpdatePipeline, PinnedArena and copy engine.
#include <c10/util/SmallVector.h>

#include <memory>
#include <vector>

#include "ema_store.h"
#include "shardema/averager.h"
#include "shardema/offload/copy_engine.h"
#include "shardema/offload/pinned_arena.h"
#include "shardema/offload/update_pipeline.h"

namespace shardema {
namespace detail {

class PinnedHostEmaStore final : public EmaStore {
 public:
  /// Builds the engine (options.offload.engine), the arena and the
  /// pipeline, then copies every source into arena memory. c10::ValueError
  /// for bad pipeline options or a pool without workers.
  PinnedHostEmaStore(const std::vector<TrackedTensor>& tracked, const AveragerOptions& options);
  /// The pipeline waits for an update in flight (an error is only warned
  /// about) while the engine and the arena still exist.
  ~PinnedHostEmaStore() override = default;

  void update(const EmaUpdate& update) override;
  void fence() override { pipeline_.fence(); }
  void wait() override { pipeline_.wait(); }
  bool sourcesReleased() const override { return pipeline_.sourcesReleased(); }
  void copyTo(int profile) override;
  offload::PipelineStats stats() const override { return pipeline_.stats(); }
  Writes writes() const override;

 private:
  // What the pipeline reads for tracked tensor `index`, in `dtype` (the
  // live source, or a tensor of this store's); checks the source's shape
  // against its EMA's (the store's one check of it: the pipeline validates
  // the job it is handed, once).
  const at::Tensor& pipelineSource(size_t index, at::ScalarType dtype);
  // A new job of tracked tensor `index`: its EMA tensors and name.
  offload::PipelineJob newJob(size_t index, UpdateOp op) const;

  const bool fenceInUpdate_;
  // Members are destroyed in reverse order: the pipeline first (it waits
  // for an update in flight and synchronizes the engine), then the arena
  // and the engine it uses. In any other order a constructor that throws
  // after the pipeline exists (an allocation of the EMA storage, say) would
  // destroy the engine under a pipeline that still calls it.
  std::unique_ptr<offload::CopyEngine> engine_;
  offload::PinnedArena arena_;
  offload::UpdatePipeline pipeline_;
  // changesInForward tensors only: the host copy taken inside update(),
  // read by the pipeline instead of the live source. Allocated at the
  // first update; undefined for the others.
  std::vector<at::Tensor> snapshots_;
  // A private converted or contiguous copy of a source that needs one.
  std::vector<at::Tensor> converted_;
  // Each EMA's shape (what pipelineSource() checks the source against),
  // beside the store rather than in the EMA's TensorImpl, so an update
  // does not read that.
  std::vector<c10::SmallVector<int64_t, 5>> emaShapes_;
  // The tracked index of each job the pipeline was last handed (its
  // takeJobs() gives them back): an update of the same tensors changes
  // those jobs where they differ instead of building new ones.
  std::vector<size_t> jobTensors_;
  // The last update's jobs that read a live source in the background: job
  // index -> tracked index (-1 for a snapshot, read inside update()).
  std::vector<int64_t> backgroundJobs_;
};

}  // namespace detail
}  // namespace shardema
