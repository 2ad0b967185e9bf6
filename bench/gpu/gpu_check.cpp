// One-shot GPU check (bench/gpu/run.sh): on a machine with a CUDA device
// and a CUDA LibTorch,
//   1. the pinned-host EMA over device tensors allocates no device memory
//      (cudaMemGetInfo before/after, beside the device storage's cost),
//      and its values match a float64 reference;
//   2. pinned D2H/H2D GB/s through the CUDA copy engine (32 MiB chunks, as
//      the pipeline issues them) beside plain cudaMemcpy of the same bytes.
// Exit status: 0 all checks passed, 1 a check failed, 2 no usable device.
#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/randn.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "shardema/averager.h"
#include "shardema/offload/copy_engine.h"
#include "shardema/offload/detail/cuda_copy_engine.h"
#include "shardema/offload/detail/device_probe.h"
#include "shardema/offload/pinned_arena.h"

namespace {

using shardema::offload::CopyEngine;

void checkCuda(cudaError_t status, const char* call) {
  TORCH_CHECK(status == cudaSuccess, "gpu_check: ", call, " failed: ", cudaGetErrorString(status));
}

int64_t deviceBytesInUse() {
  checkCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  size_t free = 0, total = 0;
  checkCuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return static_cast<int64_t>(total - free);
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Steps 1..steps with decay 0.5: step 1 copies, later ones lerp. The
// sources move by +0.25 per step, on the device, in place (no allocation).
int64_t runAverager(shardema::EmaStorage storage, std::vector<at::Tensor>& sources, int steps,
                    double* maxError) {
  std::vector<shardema::TrackedTensor> tracked;
  for (size_t i = 0; i < sources.size(); ++i) {
    tracked.push_back({"t" + std::to_string(i), sources[i], shardema::TrackRole::kAverage});
  }
  shardema::AveragerOptions options;
  options.storage = storage;
  shardema::ConstantScheduleOptions constant;
  constant.decay = 0.5;
  options.schedule = shardema::DecaySchedule::constant(constant);
  options.offload.engine = shardema::offload::EngineChoice::kCuda;
  const at::Tensor start = sources.back().cpu().to(at::kDouble);
  const int64_t before = deviceBytesInUse();
  shardema::Averager averager(tracked, options);
  at::Tensor reference;
  for (int step = 1; step <= steps; ++step) {
    for (at::Tensor& s : sources) s.add_(0.25);
    averager.update(step);
    averager.fence();  // the sources change again at the next step
    const at::Tensor x = start + 0.25 * step;
    reference = step == 1 ? x : reference + 0.5 * (x - reference);
  }
  averager.wait();
  const int64_t used = deviceBytesInUse() - before;
  const at::Tensor ema = averager.ema("t" + std::to_string(sources.size() - 1));
  // kDevice keeps the EMA on the GPU; the reference is on the host.
  *maxError = (ema.to(at::kCPU, at::kDouble) - reference).abs().max().item<double>();
  return used;
}

bool checkNoDeviceMemory() {
  if (!at::hasCUDA()) {
    std::printf("memory check: SKIPPED (this LibTorch has no CUDA: no device tensors)\n");
    return true;
  }
  // Mixed sizes and dtypes, about 600 MiB of sources.
  std::vector<at::Tensor> sources;
  const auto dev = at::TensorOptions().device(at::kCUDA);
  for (int64_t n :
       {int64_t{1}, int64_t{1000}, int64_t{3} << 20, int64_t{64} << 20, (int64_t{40} << 20) + 7}) {
    sources.push_back(at::randn({n}, dev.dtype(at::kFloat)));
    sources.push_back(at::randn({n}, dev.dtype(at::kBFloat16)));
  }
  sources.push_back(at::randn({(int64_t{8} << 20) + 3}, dev.dtype(at::kFloat)));  // checked
  int64_t sourceBytes = 0;
  for (const at::Tensor& s : sources) sourceBytes += static_cast<int64_t>(s.nbytes());
  {
    // Pays CUDA's one-off costs of streams, events and pinned memory first,
    // so the measurement below sees only what the EMA itself allocates.
    auto warm = shardema::offload::makeCopyEngine(shardema::offload::EngineChoice::kCuda);
    shardema::offload::PinnedArena arena;
    at::Tensor host = arena.allocate({1024}, at::kFloat);
    warm->recordProducerPoint();
    warm->copyToHost(sources.back().data_ptr(), host.data_ptr(), 4096, nullptr);
    warm->synchronize();
  }
  double errHost = 0, errDevice = 0;
  const int64_t host = runAverager(shardema::EmaStorage::kPinnedHost, sources, 5, &errHost);
  const int64_t device = runAverager(shardema::EmaStorage::kDevice, sources, 5, &errDevice);
  // Below CUDA's 2 MiB allocation granularity: any real allocation shows.
  const int64_t tolerance = int64_t{1} << 20;
  const bool ok = host < tolerance && errHost <= 1e-5 && errDevice <= 1e-5;
  std::printf("memory check: %s\n", ok ? "PASS" : "FAIL");
  std::printf("  sources on device            %10.1f MiB (%zu tensors, fp32 + bf16)\n",
              mib(sourceBytes), sources.size());
  std::printf("  device memory, pinned-host EMA %8.3f MiB (%lld bytes; must be < 1 MiB)\n",
              mib(host), static_cast<long long>(host));
  std::printf("  device memory, device EMA    %10.1f MiB (for comparison)\n", mib(device));
  std::printf("  max |ema - float64 reference|: pinned-host %.3g, device %.3g\n", errHost,
              errDevice);
  return ok;
}

// Best of `reps` timings of fn, in seconds.
template <typename Fn>
double bestSeconds(int reps, Fn&& fn) {
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {  // r == 0 warms up
    const auto start = std::chrono::steady_clock::now();
    fn();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (r > 0) best = std::min(best, s);
  }
  return best;
}

void engineCopies(CopyEngine& engine, bool toHost, char* host, char* device, size_t bytes) {
  constexpr size_t kChunk = size_t{32} << 20;
  engine.recordProducerPoint();
  for (size_t off = 0; off < bytes; off += kChunk) {
    const size_t n = std::min(kChunk, bytes - off);
    if (toHost) {
      engine.copyToHost(device + off, host + off, n, nullptr);
    } else {
      engine.copyFromHost(host + off, device + off, n, nullptr);
    }
  }
  engine.synchronize();
}

bool checkBandwidth() {
  const size_t bytes = size_t{1} << 30;
  shardema::offload::PinnedArena arena;
  if (arena.kind() != shardema::offload::HostMemoryKind::kCudaPinned) {
    std::printf("bandwidth: FAIL (the arena is not pinned: %s)\n",
                shardema::offload::hostMemoryKindName(arena.kind()));
    return false;
  }
  at::Tensor pinned = arena.allocate({static_cast<int64_t>(bytes)}, at::kByte);
  auto* host = static_cast<char*>(pinned.data_ptr());
  char* device = nullptr;
  checkCuda(cudaMalloc(reinterpret_cast<void**>(&device), bytes), "cudaMalloc");
  checkCuda(cudaMemset(device, 0x5A, bytes), "cudaMemset");
  auto engine = shardema::offload::makeCopyEngine(shardema::offload::EngineChoice::kCuda);
  const int reps = 5;
  const double peakD2H = bestSeconds(reps, [&] {
    checkCuda(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  });
  std::memset(host, 0, bytes);
  const double engD2H =
      bestSeconds(reps, [&] { engineCopies(*engine, true, host, device, bytes); });
  bool landed = true;
  for (size_t i = 0; i < bytes; i += 4093) landed = landed && host[i] == 0x5A;
  const double peakH2D = bestSeconds(reps, [&] {
    checkCuda(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  });
  const double engH2D =
      bestSeconds(reps, [&] { engineCopies(*engine, false, host, device, bytes); });
  checkCuda(cudaFree(device), "cudaFree");
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("bandwidth (1 GiB, pinned, best of %d): %s\n", reps,
              landed ? "bytes checked" : "FAIL");
  std::printf("  D2H  engine %6.1f GB/s   cudaMemcpy %6.1f GB/s   engine/peak %.2f\n", gb / engD2H,
              gb / peakD2H, peakD2H / engD2H);
  std::printf("  H2D  engine %6.1f GB/s   cudaMemcpy %6.1f GB/s   engine/peak %.2f\n", gb / engH2D,
              gb / peakH2D, peakH2D / engH2D);
  return landed;
}

}  // namespace

int main() {
  const auto& probe = shardema::offload::probeCudaDevices();
  if (!shardema::offload::CudaCopyEngine::compiledIn() || probe.deviceCount == 0) {
    std::printf("gpu_check: no usable CUDA device (%s)\n", probe.reason.c_str());
    return 2;
  }
  std::printf("gpu_check: %d device(s); producer stream: %s\n", probe.deviceCount,
              shardema::offload::CudaCopyEngine::usesTorchStream() ? "c10 current stream"
                                                                   : "legacy default stream");
  try {
    const bool memory = checkNoDeviceMemory();
    const bool bandwidth = checkBandwidth();
    return memory && bandwidth ? 0 : 1;
  } catch (const c10::Error& e) {
    std::printf("gpu_check: FAIL: %s\n", e.what_without_backtrace());
    return 1;
  }
}
