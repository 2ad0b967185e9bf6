#include "shardema/shard/communicator.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>

#include "communicator_impl.h"
#include "gloo_backend.h"

namespace shardema {
namespace shard {
namespace {

std::chrono::milliseconds resolved(const CommunicatorOptions& options) {
  TORCH_CHECK_VALUE(options.timeout.count() > 0,
                    "Communicator: options.timeout must be positive, got ", options.timeout.count(),
                    " ms");
  return options.timeout;
}

std::string envText(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK_VALUE(value != nullptr && *value != '\0', "Communicator::fromEnvironment: ", name,
                    " is not set; set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (as "
                    "torchrun does)");
  return value;
}

int64_t envInt(const char* name, int64_t low, int64_t high) {
  const std::string text = envText(name);
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && end != nullptr && *end == '\0' && value >= low && value <= high,
                    "Communicator::fromEnvironment: ", name, "='", text, "' is not an integer in [",
                    low, ", ", high, "]");
  return value;
}

void waitForEveryRank(c10d::Store& store, int64_t rank, int64_t worldSize,
                      std::chrono::steady_clock::time_point deadline) {
  const auto key = [](int64_t r) { return "shardema/joined/" + std::to_string(r); };
  store.set(key(rank), std::vector<uint8_t>{1});
  std::vector<std::string> keys;
  for (int64_t r = 0; r < worldSize; ++r) keys.push_back(key(r));
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  try {
    TORCH_CHECK(left.count() > 0, "the time ran out while joining the store");
    store.wait(keys, left);
  } catch (const c10::Error&) {
    std::string missing;
    for (int64_t r = 0; r < worldSize; ++r) {
      if (!store.check({key(r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    TORCH_CHECK(false, "rank(s) ", missing.empty() ? std::string("?") : missing,
                " did not join in time");
  }
}

}  // namespace

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Communicator::Communicator(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                           int64_t worldSize, const CommunicatorOptions& options)
    : Communicator(store, rank, worldSize, options,
                   std::chrono::steady_clock::now() + resolved(options)) {}

Communicator::Communicator(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                           int64_t worldSize, const CommunicatorOptions& options,
                           std::chrono::steady_clock::time_point deadline) {
  TORCH_CHECK_VALUE(store, "Communicator: store is null");
  TORCH_CHECK_VALUE(worldSize >= 1 && worldSize <= std::numeric_limits<int>::max(),
                    "Communicator: worldSize must be >= 1, got ", worldSize);
  TORCH_CHECK_VALUE(rank >= 0 && rank < worldSize, "Communicator: rank must be in [0, ", worldSize,
                    "), got ", rank);
  if (options.backend == CommBackend::kNccl) detail::requireNccl(rank, worldSize);
  auto impl = std::make_unique<Impl>(rank, worldSize, options);
  store->setTimeout(resolved(options));
  impl->store = store;
  try {
    // Every rank checks in and waits for all the others, for what is left
    // of the deadline, before the backend's own rendezvous: that one waits
    // a full timeout of its own for a missing rank.
    waitForEveryRank(*store, rank, worldSize, deadline);
    if (options.backend == CommBackend::kNccl) {
      impl->group = detail::makeNccl(store, rank, worldSize, options);
      impl->stageOnCuda = true;
    } else {
      impl->group =
          detail::makeGlooBackend(store, rank, worldSize, options.glooHostname, options.timeout);
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "Communicator rendezvous on ", impl->who(), " failed (timeout ",
                options.timeout.count(), " ms): ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "Communicator rendezvous on ", impl->who(), " failed (timeout ",
                options.timeout.count(), " ms): ", e.what());
  }
  impl_ = std::move(impl);
}

Communicator::Communicator(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                           const CommunicatorOptions& options) {
  TORCH_CHECK_VALUE(group, "Communicator: process group is null");
  auto impl = std::make_unique<Impl>(group->getRank(), group->getSize(), options);
  resolved(options);
  impl->stageOnCuda = group->getBackendName() == "nccl";
  // Collectives go to the device's Backend, which is what we create
  // ourselves too, so both constructors share one code path.
  impl->group = group->getBackend(impl->stageOnCuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU);
  impl_ = std::move(impl);
}

Communicator Communicator::fromEnvironment(const CommunicatorOptions& options) {
  const auto deadline = std::chrono::steady_clock::now() + resolved(options);
  const std::string host = envText("MASTER_ADDR");
  const int64_t port = envInt("MASTER_PORT", 1, 65535);
  const int64_t worldSize = envInt("WORLD_SIZE", 1, std::numeric_limits<int>::max());
  const int64_t rank = envInt("RANK", 0, worldSize - 1);
  c10d::TCPStoreOptions storeOptions;
  storeOptions.port = static_cast<std::uint16_t>(port);
  storeOptions.isServer = rank == 0;
  storeOptions.numWorkers = static_cast<std::size_t>(worldSize);
  // No wait for the workers in the store's constructor: it gives up quietly
  // at its timeout, and the backend's rendezvous then waited a second full
  // timeout for the same missing rank (2x on rank 0). The rendezvous below
  // waits for every rank anyway, within the one deadline. The timeout here
  // bounds a client's connect retries.
  storeOptions.waitWorkers = false;
  storeOptions.timeout = resolved(options);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(host, storeOptions);
  } catch (const std::exception& e) {
    const auto* c10Error = dynamic_cast<const c10::Error*>(&e);
    TORCH_CHECK(false, "Communicator rendezvous at ", host, ":", port, " on rank ", rank, " of ",
                worldSize, " failed (timeout ", options.timeout.count(),
                " ms): ", c10Error ? c10Error->what_without_backtrace() : e.what());
  }
  return Communicator(store, rank, worldSize, options, deadline);
}

Communicator::~Communicator() = default;
Communicator::Communicator(Communicator&& other) noexcept = default;
Communicator& Communicator::operator=(Communicator&& other) noexcept = default;

int64_t Communicator::rank() const { return impl_->rank; }
int64_t Communicator::worldSize() const { return impl_->worldSize; }
const CommunicatorOptions& Communicator::options() const { return impl_->options; }
bool Communicator::broken() const { return impl_->broken; }
const std::string& Communicator::firstFailure() const { return impl_->firstFailure; }

}  // namespace shard
}  // namespace shardema
