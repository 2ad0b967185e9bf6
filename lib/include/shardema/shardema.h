#pragma once
// shardema: the whole public API in one include. Each header below is one
// concept; include it alone to keep compile times down.
//
// Averaging        averager.h (one set of tensors), sharded_averager.h
//                  (this rank's shards of an FSDP/DDP model)
// What is tracked  tracking_policy.h, module_tracking.h (torch::nn::Module)
// Schedules        decay_schedule.h, power_function.h (sigma_rel <-> gamma)
// Lifecycles       ema_callback.h (VersatIL), posthoc_callback.h (FastVideo),
//                  ema_substitution.h (the EMA into a checkpoint, raw kept),
//                  weight_swap.h (the EMA into the model for a while, raw kept),
//                  averager_registry.h (every Averager of the process, fenced at once)
// Checkpoints      training_checkpoint.h (one file), sharded_checkpoint.h
//                  (per-rank files + manifest, export, reshard)
// Post-hoc EMA     synthesis.h (snapshots into a file or tensors)
// Files            tensor_file.h (safetensors)
// Collectives      shard/communicator.h (the c10d group the sharded calls use)
#include "shardema/averager.h"
#include "shardema/averager_registry.h"
#include "shardema/core/decay_schedule.h"
#include "shardema/core/power_function.h"
#include "shardema/core/tensor_file.h"
#include "shardema/ema_callback.h"
#include "shardema/ema_substitution.h"
#include "shardema/module_tracking.h"
#include "shardema/posthoc_callback.h"
#include "shardema/shard/communicator.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"
#include "shardema/synthesis.h"
#include "shardema/tracking_policy.h"
#include "shardema/training_checkpoint.h"
#include "shardema/weight_swap.h"
