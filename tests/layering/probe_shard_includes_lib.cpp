// Must not compile: shard sees core and itself (tests/layering).
#include "shardema/sharded_averager.h"
