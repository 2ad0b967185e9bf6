// Must not compile: shard and offload are siblings (tests/layering).
#include "shardema/offload/update_pipeline.h"
