// Must not compile: offload sees core and itself (tests/layering).
#include "shardema/averager.h"
