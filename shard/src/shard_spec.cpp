// Placeholder until the layout arithmetic lands.
#include "shardema/shard/shard_spec.h"
