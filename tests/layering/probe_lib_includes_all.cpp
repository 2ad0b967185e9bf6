// Must compile: lib sees every floor (tests/layering), so a failure
// of the other probes is the include root, not a broken probe build.
#include "shardema/core/update_kernels.h"
#include "shardema/offload/copy_engine.h"
#include "shardema/shard/shard_spec.h"
#include "shardema/shardema.h"
