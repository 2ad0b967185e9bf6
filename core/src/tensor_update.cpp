#include "shardema/core/tensor_update.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace shardema {
namespace {

// "source of 'layer.weight'", or just "source" for the one-tensor forms.
std::string subject(const char* arg, const std::string& name) {
  return name.empty() ? std::string(arg) : std::string(arg) + " of '" + name + "'";
}

// Byte range a contiguous tensor occupies (empty for zero elements).
std::pair<uintptr_t, uintptr_t> byteRange(const at::Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {begin, begin + static_cast<uintptr_t>(t.numel()) * t.element_size()};
}

bool overlaps(std::pair<uintptr_t, uintptr_t> a, std::pair<uintptr_t, uintptr_t> b) {
  return a.first < a.second && b.first < b.second && a.first < b.second && b.first < a.second;
}

// Checks shared by ema and source: defined, dense, on the CPU.
void checkCommon(const at::Tensor& t, const char* arg, const std::string& name, const char* api) {
  TORCH_CHECK_VALUE(t.defined(), api, ": ", subject(arg, name), " is an undefined tensor");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, api, ": ", subject(arg, name),
                    " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK_VALUE(t.device().is_cpu(), api, ": ", subject(arg, name),
                    " must be on the CPU, got device ", t.device(),
                    " (copy it to host memory first)");
}

// Two updates writing one EMA would race on the workers: refuse them.
void checkDistinctEmas(const std::vector<TensorUpdate>& updates, const char* api) {
  std::vector<std::pair<std::pair<uintptr_t, uintptr_t>, size_t>> ranges;
  ranges.reserve(updates.size());
  for (size_t i = 0; i < updates.size(); ++i) {
    if (updates[i].ema.numel() > 0) {
      ranges.push_back({byteRange(updates[i].ema), i});
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k) {
    TORCH_CHECK_VALUE(ranges[k].first.first >= ranges[k - 1].first.second, api, ": ",
                      subject("ema", updates[ranges[k].second].name), " overlaps ",
                      subject("ema", updates[ranges[k - 1].second].name),
                      " in memory; each EMA tensor may appear once");
  }
}

SourceType sourceTypeIn(const at::Tensor& source, const std::string& name, const char* api) {
  switch (source.scalar_type()) {
    case at::kFloat:
      return SourceType::kFloat32;
    case at::kBFloat16:
      return SourceType::kBFloat16;
    case at::kHalf:
      return SourceType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, api, ": ", subject("source", name),
                       " must be float32, bfloat16 or float16, got ", source.scalar_type());
  }
}

void checkPair(const TensorUpdate& update, const char* api) {
  const at::Tensor& ema = update.ema;
  const at::Tensor& source = update.source;
  TORCH_CHECK_VALUE(update.op == UpdateOp::kLerp || update.op == UpdateOp::kCopy, api, ": '",
                    update.name, "': the kernels run kLerp and kCopy only");
  checkCommon(ema, "ema", update.name, api);
  checkCommon(source, "source", update.name, api);
  TORCH_CHECK_TYPE(ema.scalar_type() == at::kFloat, api, ": ", subject("ema", update.name),
                   " must be float32, got ", ema.scalar_type());
  sourceTypeIn(source, update.name, api);
  TORCH_CHECK_VALUE(ema.is_contiguous(), api, ": ", subject("ema", update.name),
                    " must be contiguous (it is updated in place through its memory), got strides ",
                    ema.strides());
  TORCH_CHECK_VALUE(source.is_contiguous(), api, ": ", subject("source", update.name),
                    " is not contiguous (strides ", source.strides(),
                    "); pass source.contiguous() instead");
  TORCH_CHECK_VALUE(ema.sizes() == source.sizes(), api,
                    ": shape mismatch: ", subject("ema", update.name), " has shape ", ema.sizes(),
                    " but source has shape ", source.sizes());
  TORCH_CHECK_VALUE(!overlaps(byteRange(ema), byteRange(source)), api, ": ",
                    subject("ema", update.name), " and its source overlap in memory");
}

std::vector<UpdateSpan> checkedSpans(const std::vector<TensorUpdate>& updates, double weight,
                                     const char* api) {
  // Written so that NaN fails too.
  TORCH_CHECK_VALUE(weight >= 0.0 && weight <= 1.0, api,
                    ": weight (1 - decay) must be in [0, 1], got ", weight);
  for (const TensorUpdate& update : updates) {
    checkPair(update, api);
  }
  checkDistinctEmas(updates, api);
  std::vector<UpdateSpan> spans;
  spans.reserve(updates.size());
  for (const TensorUpdate& update : updates) {
    UpdateSpan span;
    span.ema = update.ema.data_ptr<float>();
    span.src = update.source.data_ptr();
    span.type = sourceTypeIn(update.source, update.name, api);
    span.count = update.ema.numel();
    span.op = update.op;
    spans.push_back(span);
  }
  return spans;
}

}  // namespace

SourceType sourceTypeOf(const at::Tensor& source, const std::string& name) {
  return sourceTypeIn(source, name, "shardema::sourceTypeOf");
}

void checkTensorUpdate(const TensorUpdate& update) {
  checkPair(update, "shardema::checkTensorUpdate");
}

void applyTensorUpdates(const std::vector<TensorUpdate>& updates, double weight) {
  updateSpans(checkedSpans(updates, weight, "shardema::applyTensorUpdates"),
              static_cast<float>(weight));
}

std::vector<UpdateSpan> spansOf(const std::vector<TensorUpdate>& updates, double weight) {
  return checkedSpans(updates, weight, "shardema::spansOf");
}

void lerpInto(const at::Tensor& ema, const at::Tensor& source, double weight) {
  updateSpans(checkedSpans({TensorUpdate{ema, source, UpdateOp::kLerp, ""}}, weight,
                           "shardema::lerpInto"),
              static_cast<float>(weight));
}

void copyInto(const at::Tensor& ema, const at::Tensor& source) {
  updateSpans(checkedSpans({TensorUpdate{ema, source, UpdateOp::kCopy, ""}}, 0.0,
                           "shardema::copyInto"),
              0.0f);
}

}  // namespace shardema
