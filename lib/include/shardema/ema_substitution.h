#pragma once
// The checkpoint substitution of an EMA callback, written once: the EMA
// goes into a checkpoint in place of the weights (what a deployment loads),
// the replaced raw weights are kept for resume. EmaCallback::onSaveCheckpoint
// and the Python EMACallback.on_save_checkpoint (shardema._C.substitute_ema,
// on each DTensor's to_local()) both call it, so the two cannot drift.
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "shardema/module_tracking.h"

namespace shardema {

/// What substituteEma took out of a checkpoint's slots.
struct EmaSubstitution {
  /// The values the EMA replaced, by slot name in slot order: clones with
  /// their own storage (a checkpoint's entries may alias live parameters,
  /// which the next optimizer step overwrites).
  NamedTensors raw;
  /// The float32 EMA of each replaced slot of another dtype (a bf16 or
  /// fp16 model's), where writing it at the slot's dtype narrowed it: a
  /// resume loads this copy and loses nothing. Clones, in slot order.
  NamedTensors float32Ema;
};

/// Replaces every slot that has an EMA of the same name with that EMA,
/// converted to the slot's dtype (a checkpoint keeps the model's dtypes),
/// on the EMA's device (a checkpoint costs no accelerator memory), in its
/// own storage. Slots without an EMA, and EMA names without a slot (a
/// non-persistent buffer), are left alone. Everything is checked before
/// the first slot changes: c10::ValueError naming the tensor when a slot's
/// shape differs from its EMA's, or when `rawKept` (the names whose raw
/// values the checkpoint already keeps) holds a slot to replace: a second
/// substitution would keep the EMA as the raw weights. adoptEma: the `ema`
/// tensors are fresh copies the caller hands over (what shardema.EMA's
/// ema_tensors() and full_state_dict() return), so a slot of the EMA's
/// dtype, and float32Ema, take them as they are instead of a second copy
/// (a one-file save of a large model holds one EMA, not two); false (the
/// default, EmaCallback's: views of the Averager's storage) copies.
/// Runs on the calling thread and returns when every copy is done (no
/// collective, no background work); the caller must keep the EMA from
/// changing meanwhile (EmaCallback reads emaTensors(), which waits for an
/// update in flight first). The returned tensors and the new slots are
/// owned by the caller.
EmaSubstitution substituteEma(NamedTensors& slots, const NamedTensors& ema,
                              const std::vector<std::string>& rawKept = {},
                              bool adoptEma = false);

}  // namespace shardema
