// Must not compile: core sees only its own include root (tests/layering).
#include "shardema/offload/copy_engine.h"
