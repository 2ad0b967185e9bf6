// Must compile: the facade sees every layer (tests/layering), so a failure
// of the other probes is the include root, not a broken probe build.
#include "shardema/detail/update_kernels.h"
#include "shardema/offload/copy_engine.h"
#include "shardema/shard/shard_spec.h"
#include "shardema/shardema.h"
