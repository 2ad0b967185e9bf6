#pragma once
// KernelVariant: which instruction set runs the EMA's lerp and copy loops
// (lerpRange / copyRange, update_kernels.h). The loops are memory bound, so
// a variant's worth is holding the memory rate wherever the code lands: the
// explicit AVX2 and AVX-512 loops are unrolled (4 vectors per iteration),
// while the baseline loop is what GCC vectorises at x86-64's SSE2 and
// halved its speed when a link moved it across a 64-byte boundary.
//
// Every variant runs the same float ops per element (sub, mul, add; no FMA,
// and bf16/fp16 widen exactly), so all give bit-identical results: which
// one ran never changes the EMA.
#include <cstdint>
#include <vector>

#include "shardema/core/update_kernels.h"

namespace shardema {

enum class KernelVariant {
  /// The portable loops, vectorised by the compiler for the build's target
  /// (SSE2 on x86-64), fp16 widened in software. Any CPU.
  kBaseline,
  /// AVX2 with F16C: 8 floats per vector.
  kAvx2,
  /// AVX-512F: 16 floats per vector.
  kAvx512,
};

/// "baseline", "avx2", "avx512".
const char* kernelVariantName(KernelVariant variant);
/// Compiled in (x86-64 builds) and supported by this CPU.
bool kernelVariantAvailable(KernelVariant variant);
/// The available variants, baseline first.
std::vector<KernelVariant> availableKernelVariants();
/// The variant lerpRange / copyRange use, chosen once per process: AVX2
/// where the CPU has it (AVX-512 measured no faster, see
/// kernel_variants.cpp), else the baseline; or the one SHARDEMA_KERNEL
/// names ("baseline", "avx2", "avx512"), which must be available
/// (c10::ValueError naming it, at the first update).
KernelVariant activeKernelVariant();

/// lerpRange / copyRange with a chosen variant (tests and benchmarks
/// compare them); c10::ValueError naming a variant that is not available.
void lerpRangeWith(KernelVariant variant, float* ema, const void* src, SourceType type,
                   int64_t count, float weight);
void copyRangeWith(KernelVariant variant, float* ema, const void* src, SourceType type,
                   int64_t count);

}  // namespace shardema
