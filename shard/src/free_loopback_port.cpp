// Communicator::freeLoopbackPort: a port below the kernel's ephemeral range.
// A port the kernel picks for a bind to port 0 comes from the ephemeral
// range, which is also where every outgoing connection on the host takes
// its local end (Gloo's pairs of other jobs, ctest's parallel tests): one of
// them can take it between this call and the job's bind, and the
// rendezvous then fails with EADDRINUSE. A port below that range is taken
// only by an explicit bind, so only another picker can collide, and it
// draws from a few thousand ports at random.
#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <random>

#include "shardema/shard/communicator.h"

namespace shardema {
namespace shard {
namespace {

// The first port of the ephemeral range (Linux's default when it cannot be
// read).
int ephemeralLow() {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (range >> low >> high && low > 1024 && low <= high) return low;
  return 32768;
}

// True when nothing holds `port` on loopback now. No SO_REUSEADDR: a port
// with a connection still in TIME_WAIT counts as taken.
bool bindable(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return free;
}

// What the kernel picks (the ephemeral range): the fallback when no port
// below it is free.
int kernelPickedPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "freeLoopbackPort: socket() failed");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(address);
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0;
  ::close(fd);
  TORCH_CHECK(bound, "freeLoopbackPort: no loopback port could be bound");
  return ntohs(address.sin_port);
}

}  // namespace

int Communicator::freeLoopbackPort() {
  const int high = ephemeralLow() - 1;
  const int low = std::max(1025, high - 12000);
  std::random_device entropy;  // not a seeded engine: parallel pickers differ
  std::uniform_int_distribution<int> draw(low, high);
  for (int attempt = 0; attempt < 64 && low < high; ++attempt) {
    const int port = draw(entropy);
    if (bindable(port)) return port;
  }
  return kernelPickedPort();
}

}  // namespace shard
}  // namespace shardema
