#pragma once
// Internal to lib/src: how an Averager enters and leaves the registry of
// averager_registry.h (its constructors and destructor call these).
namespace shardema {

class Averager;

namespace detail {

void registerAverager(Averager* averager);
void unregisterAverager(Averager* averager);

}  // namespace detail
}  // namespace shardema
