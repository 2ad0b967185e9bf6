// Must not compile: offload sees core and itself, not its sibling shard/
// (tests/layering).
#include "shardema/shard/shard_spec.h"
