#pragma once
// planNode: what keeping the EMA in pinned host memory costs one node of
// an FSDP job, per update, on paper (docs/performance.md, "At scale, on
// paper"; `shardema plan`; shardema.plan_node). Pure arithmetic over the
// inputs: no threads, no devices, nothing measured here; the inputs are
// where the measurements come in, and each default says where it comes from.
//
// The model, per update of one node whose ranks each hold 1/ranks of every
// tracked tensor (FSDP2's rows; padding ignored):
//   - PCIe: each rank copies its elements' source bytes to the host once
//     (device to host only; the EMA never goes back), on its own link;
//   - host memory, shared by the node's ranks: the DMA writes those bytes
//     into staging, the kernel reads them back and reads and writes each
//     float32 profile (2 x source bytes + 8 x profiles per element);
//   - CPU: one core moves coreGbps of the kernel's traffic (source bytes
//     + 8 x profiles per element);
//   - the copies and the math overlap the next step's forward and backward
//     (update() after optimizer.step(), fence() before the next one), so an
//     update costs the step only what its slowest stage takes beyond one
//     step, plus the update() call on the training thread.
// What it leaves out: the GPU's own PCIe link also carries its inter-node
// collectives where the NIC sits behind it (GPUDirect RDMA): give pcieGbps
// as what is left of it. The pipeline's fill (one chunk) and NUMA placement
// are not modelled.
#include <cstdint>

namespace shardema {

struct NodePlanInputs {
  /// Parameters of the model (tracked elements, all ranks together), in
  /// [1, 2^50].
  /// Required: no default.
  int64_t parameters = 0;
  /// FSDP world size: every tracked tensor is sharded over all of them;
  /// >= 1. Default 8.
  int64_t ranks = 8;
  /// GPUs (ranks) per node; >= 1. Default 8. A node runs min(ranks,
  /// gpusPerNode) of the ranks.
  int64_t gpusPerNode = 8;
  /// Bytes per element of the weights the EMA reads: 4 (default) for FSDP2's
  /// float32 sharded parameters under a bf16 MixedPrecisionPolicy
  /// (torchtitan's default), 2 for bf16 or fp16 weights.
  int64_t sourceBytes = 4;
  /// float32 EMA profiles kept of the same weights: 1 (default) for one
  /// EMA, 2 for post-hoc EMA's two sigma_rel profiles; 1 to kMaxProfiles.
  int64_t profiles = 1;
  /// Device-to-host GB/s of one GPU's link into pinned memory, all GPUs
  /// copying at once; > 0. Default 50: about 0.8 of PCIe 5.0 x16's 63 GB/s
  /// per direction (assumed; bench/gpu/run.sh measures a plain pinned copy).
  double pcieGbps = 50.0;
  /// Host memory GB/s of the node, all sockets, shared by its ranks; > 0.
  /// Default 400: about 0.7 of the 563 GB/s peak of 16 channels of DDR5 at
  /// 4400 MT/s (two Xeon 8480C with 32 DIMMs; assumed fraction).
  double hostMemoryGbps = 400.0;
  /// GB/s of the update kernel's traffic one core moves; > 0. Default 46.8:
  /// update_bench's one-thread in-place limit (docs/performance.md, this
  /// project's 2-vCPU VM; the kernel runs at 0.98-1.02 of it).
  double coreGbps = 46.8;
  /// Seconds of one training step; 0 (default) derives it as
  /// 6 x parameters x tokensPerGpu / (gpuTflops x 1e12); else > 0.
  double stepSeconds = 0.0;
  /// Tokens one GPU processes per step, for the derived step time; > 0.
  /// Default 8192 (assumed: one sequence of Llama 3's 8K pretraining context).
  double tokensPerGpu = 8192.0;
  /// Achieved TFLOP/s per GPU, for the derived step time; > 0. Default 400
  /// (Llama 3 405B's 380-430 BF16 TFLOP/s per H100, "The Llama 3 Herd of
  /// Models", 2024).
  double gpuTflops = 400.0;
  /// Pinned staging per rank (numSlots x chunkBytes); >= 0. Default 32 MiB,
  /// the Averager's 4 slots of 8 MiB.
  int64_t stagingBytesPerRank = int64_t{32} << 20;
  /// Seconds update() takes on the training thread; >= 0. Default 1.4e-3:
  /// python_bench's update() return for 1000 tensors with cold caches
  /// (docs/performance.md). Counted in full, as if the training thread were
  /// the step's critical path.
  double updateCallSeconds = 1.4e-3;
  /// Host memory of one node in GiB, for ramFraction; > 0. Default 2048
  /// (32 x 64 GiB, the H200 node of MLCommons inference v4.1).
  double nodeRamGib = 2048.0;
};

/// One node's costs per update (the busiest node: min(ranks, gpusPerNode)
/// ranks). Bytes are per update unless named otherwise; seconds are wall
/// time of the stage on its shared resource.
struct NodePlan {
  NodePlanInputs inputs;
  /// min(ranks, gpusPerNode).
  int64_t ranksPerNode = 0;
  /// ceil(parameters / ranks).
  int64_t elementsPerRank = 0;
  /// elementsPerRank x ranksPerNode.
  int64_t elementsPerNode = 0;
  /// Device-to-host bytes of the node (each rank's on its own link).
  int64_t pcieBytes = 0;
  /// One rank's copies at pcieGbps (the ranks copy in parallel).
  double pcieSeconds = 0.0;
  /// Host memory traffic of the node: (2 x sourceBytes + 8 x profiles) per element.
  int64_t hostMemoryBytes = 0;
  double hostMemorySeconds = 0.0;
  /// The kernel's traffic of the node: (sourceBytes + 8 x profiles) per element.
  int64_t kernelBytes = 0;
  /// One core's time for kernelBytes.
  double coreSeconds = 0.0;
  /// Cores the node's math needs to keep pace: at least one worker per
  /// rank, and enough that the math is no slower than the step or the
  /// slower of PCIe and host memory, whichever is longer.
  int64_t coresNeeded = 0;
  /// The training step (given or derived).
  double stepSeconds = 0.0;
  /// The update's wall time: its slowest stage with coresNeeded cores.
  double emaSeconds = 0.0;
  /// What one update adds to the step: max(0, emaSeconds - stepSeconds) + updateCallSeconds.
  double overheadSeconds = 0.0;
  /// Host memory the node holds: profiles x 4 bytes x elementsPerNode + staging.
  int64_t hostRamBytes = 0;
  /// hostRamBytes over nodeRamGib (above 1: it does not fit).
  double ramFraction = 0.0;

  /// The step overhead as a fraction of the step when updating every
  /// `updateEvery` steps (>= 1): overheadSeconds / updateEvery / stepSeconds.
  /// c10::ValueError naming update_every otherwise.
  double overheadFraction(int64_t updateEvery) const;
};

/// The plan of one node for `inputs`. c10::ValueError naming the first
/// input out of range (its snake_case name, as Python and the CLI spell it).
NodePlan planNode(const NodePlanInputs& inputs);

}  // namespace shardema
