#pragma once
// Internal: c10d's Gloo backend, made without Gloo's headers.
//
// PyPI's torch wheel ships ProcessGroupGloo.hpp but not the Gloo headers it
// includes (gloo/context.h, gloo/rendezvous/store.h, ...), and no package
// this platform reaches carries the Gloo of the commit compiled into
// libtorch_cpu. Headers of another Gloo would compile against declarations
// that may not match the binary. So nothing of ours includes a Gloo header:
// the backend is made by torch's own Python binding
// (torch.distributed.ProcessGroupGloo), which is compiled with that very
// Gloo, and reaches us as a c10d::Backend, whose header the wheel has.
//
// In a Python process (the extension) that binding is already loaded. In a
// C++ program (tests, the demo, the CLI, benchmarks) makeGlooBackend starts
// an interpreter once, never finalized: the Python whose torch this LibTorch
// is (SHARDEMA_TORCH_PYTHON, fixed at build time), isolated from PYTHONPATH
// and the user's site-packages, and refuses it unless its torch lives in
// the folder the process already loaded libtorch_cpu.so from. That costs a
// C++ program about 0.7 s and the import of torch, once.
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace shardema {
namespace shard {
namespace detail {

/// c10d's ProcessGroupGloo for `rank` of `worldSize` over `store`, its
/// transport bound to `hostname` ("": Gloo's default device, this host
/// name's address), every operation bounded by `timeout`. Blocks in Gloo's
/// own rendezvous until every rank has joined, or fails at `timeout`.
/// Thread-safe; any thread. c10::Error naming the cause when the
/// interpreter, torch or the rendezvous fails.
c10::intrusive_ptr<c10d::Backend> makeGlooBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int64_t rank, int64_t worldSize,
                                                  const std::string& hostname,
                                                  std::chrono::milliseconds timeout);

}  // namespace detail
}  // namespace shard
}  // namespace shardema
