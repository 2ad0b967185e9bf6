// UpdatePipeline's jobs: the one validation of each job per update (its
// EMAs checked once per index and then trusted, checkedEmas_) and the jobs
// handed back to a caller that submits them again (takeJobs). Runs on the
// submitting thread, before any chunk is handed out.
#include <c10/util/Exception.h>

#include <mutex>
#include <utility>

#include "shardema/core/tensor_update.h"
#include "shardema/offload/update_pipeline.h"

namespace shardema::offload {

// Whether `job` names the EMA tensors `checked` holds (the same TensorImpl
// addresses, which the held handles keep from being reused): their checks
// and addresses then stand. Reads the job's handles, not the tensors.
bool UpdatePipeline::sameEmas(const CheckedEma& checked, const PipelineJob& job) {
  if (!checked.ema.defined() || checked.ema.unsafeGetTensorImpl() != job.ema.unsafeGetTensorImpl() ||
      checked.more.size() != job.moreEmas.size()) {
    return false;
  }
  for (size_t p = 0; p < checked.more.size(); ++p) {
    if (checked.more[p].unsafeGetTensorImpl() != job.moreEmas[p].unsafeGetTensorImpl()) return false;
  }
  return true;
}

// The one validation of a job per update; returns its source type (unused
// for raw copies), which plan() and the workers then trust. The source is
// checked every time (a parameter may change under the caller); the EMAs,
// the pipeline's to write, when first seen at this index.
SourceType UpdatePipeline::checkJob(const PipelineJob& job, size_t index, size_t profiles) {
  const char* api = "UpdatePipeline::submit";
  TORCH_CHECK_VALUE(job.ema.defined() && job.source.defined(), api, ": tensor '", job.name,
                    "' has an undefined ema or source");
  CheckedEma& checked = checkedEmas_[index];
  const bool known = sameEmas(checked, job);
  if (!known) {
    TORCH_CHECK_VALUE(job.ema.device().is_cpu() && job.ema.is_contiguous(), api, ": ema of '",
                      job.name, "' must be a contiguous CPU tensor, got device ", job.ema.device());
  }
  TORCH_CHECK_VALUE(job.source.is_contiguous(), api, ": source of '", job.name,
                    "' is not contiguous (strides ", job.source.strides(),
                    "); pass source.contiguous()");
  const int64_t emaNumel = known ? checked.numel : job.ema.numel();
  TORCH_CHECK_VALUE(emaNumel == job.source.numel(), api, ": tensor '", job.name, "' has ",
                    job.source.numel(), " source elements but ", emaNumel, " EMA elements");
  TORCH_CHECK_VALUE(job.op != UpdateOp::kSkip, api, ": tensor '", job.name,
                    "' has op kSkip; leave skipped tensors out of the jobs");
  const c10::ScalarType emaType = known ? checked.dtype : job.ema.scalar_type();
  SourceType type = SourceType::kFloat32;
  if (job.op == UpdateOp::kCopyRaw) {
    TORCH_CHECK_VALUE(job.moreEmas.empty(), api, ": raw copy of '", job.name,
                      "' cannot have more EMAs (copies are shared by every profile)");
    TORCH_CHECK_TYPE(emaType == job.source.scalar_type(), api, ": raw copy of '", job.name,
                     "' needs equal dtypes, got ema ", emaType, " and source ",
                     job.source.scalar_type());
  } else {
    TORCH_CHECK_TYPE(emaType == at::kFloat, api, ": ema of '", job.name,
                     "' must be float32, got ", emaType);
    // float32 / bfloat16 / float16, else TypeError naming the tensor
    type = sourceTypeOf(job.source, job.name);
    TORCH_CHECK_VALUE(job.moreEmas.size() + 1 == profiles, api, ": tensor '", job.name, "' has ",
                      job.moreEmas.size() + 1, " EMAs but ", profiles, " weights were given");
    for (size_t p = 0; p < job.moreEmas.size() && !known; ++p) {
      const at::Tensor& more = job.moreEmas[p];
      TORCH_CHECK_VALUE(more.defined() && more.device().is_cpu() && more.is_contiguous() &&
                            more.scalar_type() == at::kFloat && more.numel() == job.ema.numel(),
                        api, ": EMA ", p + 1, " of '", job.name,
                        "' must be a contiguous float32 CPU tensor of ", job.ema.numel(),
                        " elements");
      // Empty tensors may share a (null or arena) pointer: nothing is written.
      TORCH_CHECK_VALUE(more.numel() == 0 || more.data_ptr() != job.ema.data_ptr(), api,
                        ": EMA ", p + 1, " of '", job.name, "' shares memory with its first EMA");
    }
  }
  if (!known) {
    checked = CheckedEma{job.ema,
                         job.moreEmas,
                         static_cast<char*>(job.ema.data_ptr()),
                         job.ema.numel(),
                         static_cast<int64_t>(job.ema.element_size()),
                         job.ema.scalar_type()};
  }
  return type;
}

std::vector<PipelineJob> UpdatePipeline::takeJobs() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!inFlight_, "UpdatePipeline::takeJobs: the update of step ", step_,
                " has not been waited for; call wait() first");
  }
  return std::exchange(jobs_, {});
}

}  // namespace shardema::offload
