#pragma once
// Internal: what gather and scatter do before any data moves. Each rank
// validates its own call and inputs without throwing; then one small
// all-gather of a header (layout hash, status, root, bufferBytes, one
// caller word) lets every rank fail together with a ValueError, instead of
// the healthy ranks timing out in a collective the failed one skipped (or
// running collectives of different sizes).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shardema/shard/communicator.h"
#include "shardema/shard/gather.h"

namespace shardema {
namespace shard {
namespace detail {

/// This rank's checks of the call itself (layout's world size against the
/// communicator's, root, bufferBytes): the message, or "" when they pass.
/// Never throws, so a failing rank still joins the header exchange.
std::string checkCall(const char* api, const Communicator& comm, const ShardLayout& layout,
                      int64_t root, bool rootMayBeAll, int64_t bufferBytes);

/// The words every rank must agree on besides the layout.
struct CallWords {
  int64_t root = 0;
  int64_t bufferBytes = 0;
  /// Any further word (gather: a hash of the dtypes); a difference is only
  /// reported back, see agree().
  uint64_t extra = 0;
};

/// agreeAcrossRanks (shard/agreement.h) over {layout hash, root,
/// bufferBytes, extra} and localError (this rank's validation message, ""
/// when it passed): one 40-byte all-gather; when any rank failed, every
/// rank throws one c10::ValueError naming each failed rank and its reason. Then every rank
/// throws c10::ValueError when the layouts, roots or bufferBytes differ.
/// Returns true, on every rank alike, when some rank's `extra` differs, so
/// the caller can find out which in a further exchange that the common case
/// never pays for.
bool agree(const char* api, Communicator& comm, const ShardLayout& layout,
           const std::string& localError, const CallWords& words);

/// Contiguous bytes of a CPU tensor (1-D uint8 view).
at::Tensor bytesView(const at::Tensor& tensor);

/// A fresh 1-D uint8 tensor.
at::Tensor newBytes(int64_t size);

/// The tag collectives carry in errors: "api 'name' [begin, end)" plus how
/// many more tensors the round holds.
std::string roundTag(const char* api, const ShardLayout& layout, const struct Round& round);

}  // namespace detail
}  // namespace shard
}  // namespace shardema
