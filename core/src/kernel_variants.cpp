// The lerp and copy loops of each KernelVariant, and the choice of one per
// process (kernel_variant.h). Compiled alone with -O3 -ffp-contract=off
// (core/CMakeLists.txt): the explicit loops use no FMA, and the baseline
// loops may not contract either, so every variant rounds alike.
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "shardema/core/kernel_variant.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "scalar_loops.h"

namespace shardema {
namespace {

using detail::copyLoop;
using detail::lerpLoop;
using detail::LoadBF16;
using detail::LoadF16;
using detail::LoadF32;

void lerpBaseline(float* ema, const void* src, SourceType type, int64_t count, float weight) {
  switch (type) {
    case SourceType::kFloat32:
      lerpLoop(ema, static_cast<const float*>(src), count, weight, LoadF32{});
      break;
    case SourceType::kBFloat16:
      lerpLoop(ema, static_cast<const uint16_t*>(src), count, weight, LoadBF16{});
      break;
    case SourceType::kFloat16:
      lerpLoop(ema, static_cast<const uint16_t*>(src), count, weight, LoadF16{});
      break;
  }
}

void copyBaseline(float* ema, const void* src, SourceType type, int64_t count) {
  switch (type) {
    case SourceType::kFloat32:
      if (count > 0) std::memcpy(ema, src, static_cast<size_t>(count) * sizeof(float));
      break;
    case SourceType::kBFloat16:
      copyLoop(ema, static_cast<const uint16_t*>(src), count, LoadBF16{});
      break;
    case SourceType::kFloat16:
      copyLoop(ema, static_cast<const uint16_t*>(src), count, LoadF16{});
      break;
  }
}

#if defined(__x86_64__)
#define SHARDEMA_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define SHARDEMA_TARGET_AVX512 __attribute__((target("avx512f")))

// One vector of source elements as floats, per instruction set and source
// type; Scalar loads the tail the vectors leave.
struct Avx2F32 {
  using Source = float;
  using Scalar = LoadF32;
  static constexpr int kWidth = 8;
  SHARDEMA_TARGET_AVX2 static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
};
struct Avx2BF16 {
  using Source = uint16_t;
  using Scalar = LoadBF16;
  static constexpr int kWidth = 8;
  SHARDEMA_TARGET_AVX2 static __m256 load(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
};
struct Avx2F16 {
  using Source = uint16_t;
  using Scalar = LoadF16;
  static constexpr int kWidth = 8;
  SHARDEMA_TARGET_AVX2 static __m256 load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

// Four vectors per iteration: enough loads in flight to keep the memory
// system busy, and a loop body far longer than a cache line, so where the
// linker places it no longer matters.
template <typename L>
SHARDEMA_TARGET_AVX2 void lerpAvx2(float* ema, const typename L::Source* src, int64_t count,
                                   float weight) {
  constexpr int64_t kStep = 4 * L::kWidth;
  const __m256 w = _mm256_set1_ps(weight);
  int64_t i = 0;
  for (; i + kStep <= count; i += kStep) {
    const __m256 e0 = _mm256_loadu_ps(ema + i);
    const __m256 e1 = _mm256_loadu_ps(ema + i + 8);
    const __m256 e2 = _mm256_loadu_ps(ema + i + 16);
    const __m256 e3 = _mm256_loadu_ps(ema + i + 24);
    const __m256 x0 = L::load(src + i);
    const __m256 x1 = L::load(src + i + 8);
    const __m256 x2 = L::load(src + i + 16);
    const __m256 x3 = L::load(src + i + 24);
    _mm256_storeu_ps(ema + i, _mm256_add_ps(e0, _mm256_mul_ps(w, _mm256_sub_ps(x0, e0))));
    _mm256_storeu_ps(ema + i + 8, _mm256_add_ps(e1, _mm256_mul_ps(w, _mm256_sub_ps(x1, e1))));
    _mm256_storeu_ps(ema + i + 16, _mm256_add_ps(e2, _mm256_mul_ps(w, _mm256_sub_ps(x2, e2))));
    _mm256_storeu_ps(ema + i + 24, _mm256_add_ps(e3, _mm256_mul_ps(w, _mm256_sub_ps(x3, e3))));
  }
  for (; i + L::kWidth <= count; i += L::kWidth) {
    const __m256 e = _mm256_loadu_ps(ema + i);
    _mm256_storeu_ps(ema + i,
                     _mm256_add_ps(e, _mm256_mul_ps(w, _mm256_sub_ps(L::load(src + i), e))));
  }
  lerpLoop(ema + i, src + i, count - i, weight, typename L::Scalar{});
}

template <typename L>
SHARDEMA_TARGET_AVX2 void copyAvx2(float* ema, const typename L::Source* src, int64_t count) {
  int64_t i = 0;
  for (; i + L::kWidth <= count; i += L::kWidth) _mm256_storeu_ps(ema + i, L::load(src + i));
  copyLoop(ema + i, src + i, count - i, typename L::Scalar{});
}

// GCC 12 warns that its own AVX-512 intrinsics (_mm512_set1_ps and the
// widening loads start from _mm512_undefined_*) may read uninitialised
// values, a false positive of those headers.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

struct Avx512F32 {
  using Source = float;
  using Scalar = LoadF32;
  static constexpr int kWidth = 16;
  SHARDEMA_TARGET_AVX512 static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
};
struct Avx512BF16 {
  using Source = uint16_t;
  using Scalar = LoadBF16;
  static constexpr int kWidth = 16;
  SHARDEMA_TARGET_AVX512 static __m512 load(const uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
};
struct Avx512F16 {
  using Source = uint16_t;
  using Scalar = LoadF16;
  static constexpr int kWidth = 16;
  SHARDEMA_TARGET_AVX512 static __m512 load(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

template <typename L>
SHARDEMA_TARGET_AVX512 void lerpAvx512(float* ema, const typename L::Source* src, int64_t count,
                                       float weight) {
  constexpr int64_t kStep = 4 * L::kWidth;
  const __m512 w = _mm512_set1_ps(weight);
  int64_t i = 0;
  for (; i + kStep <= count; i += kStep) {
    const __m512 e0 = _mm512_loadu_ps(ema + i);
    const __m512 e1 = _mm512_loadu_ps(ema + i + 16);
    const __m512 e2 = _mm512_loadu_ps(ema + i + 32);
    const __m512 e3 = _mm512_loadu_ps(ema + i + 48);
    const __m512 x0 = L::load(src + i);
    const __m512 x1 = L::load(src + i + 16);
    const __m512 x2 = L::load(src + i + 32);
    const __m512 x3 = L::load(src + i + 48);
    _mm512_storeu_ps(ema + i, _mm512_add_ps(e0, _mm512_mul_ps(w, _mm512_sub_ps(x0, e0))));
    _mm512_storeu_ps(ema + i + 16, _mm512_add_ps(e1, _mm512_mul_ps(w, _mm512_sub_ps(x1, e1))));
    _mm512_storeu_ps(ema + i + 32, _mm512_add_ps(e2, _mm512_mul_ps(w, _mm512_sub_ps(x2, e2))));
    _mm512_storeu_ps(ema + i + 48, _mm512_add_ps(e3, _mm512_mul_ps(w, _mm512_sub_ps(x3, e3))));
  }
  for (; i + L::kWidth <= count; i += L::kWidth) {
    const __m512 e = _mm512_loadu_ps(ema + i);
    _mm512_storeu_ps(ema + i,
                     _mm512_add_ps(e, _mm512_mul_ps(w, _mm512_sub_ps(L::load(src + i), e))));
  }
  lerpLoop(ema + i, src + i, count - i, weight, typename L::Scalar{});
}

template <typename L>
SHARDEMA_TARGET_AVX512 void copyAvx512(float* ema, const typename L::Source* src, int64_t count) {
  int64_t i = 0;
  for (; i + L::kWidth <= count; i += L::kWidth) _mm512_storeu_ps(ema + i, L::load(src + i));
  copyLoop(ema + i, src + i, count - i, typename L::Scalar{});
}

#pragma GCC diagnostic pop

void lerpVector(KernelVariant variant, float* ema, const void* src, SourceType type, int64_t count,
                float weight) {
  const auto* f32 = static_cast<const float*>(src);
  const auto* half = static_cast<const uint16_t*>(src);
  const bool wide = variant == KernelVariant::kAvx512;
  switch (type) {
    case SourceType::kFloat32:
      return wide ? lerpAvx512<Avx512F32>(ema, f32, count, weight)
                  : lerpAvx2<Avx2F32>(ema, f32, count, weight);
    case SourceType::kBFloat16:
      return wide ? lerpAvx512<Avx512BF16>(ema, half, count, weight)
                  : lerpAvx2<Avx2BF16>(ema, half, count, weight);
    case SourceType::kFloat16:
      return wide ? lerpAvx512<Avx512F16>(ema, half, count, weight)
                  : lerpAvx2<Avx2F16>(ema, half, count, weight);
  }
}

void copyVector(KernelVariant variant, float* ema, const void* src, SourceType type,
                int64_t count) {
  const auto* half = static_cast<const uint16_t*>(src);
  const bool wide = variant == KernelVariant::kAvx512;
  switch (type) {
    case SourceType::kFloat32:
      return copyBaseline(ema, src, type, count);  // memcpy is already the limit
    case SourceType::kBFloat16:
      return wide ? copyAvx512<Avx512BF16>(ema, half, count) : copyAvx2<Avx2BF16>(ema, half, count);
    case SourceType::kFloat16:
      return wide ? copyAvx512<Avx512F16>(ema, half, count) : copyAvx2<Avx2F16>(ema, half, count);
  }
}

// CPUID leaf 1, ECX bit 29: clang 14 (the second toolchain CI builds the
// module with) knows no __builtin_cpu_supports("f16c").
static bool cpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

bool cpuSupports(KernelVariant variant) {
  switch (variant) {
    case KernelVariant::kBaseline:
      return true;
    case KernelVariant::kAvx2:
      return __builtin_cpu_supports("avx2") && cpuHasF16c();
    case KernelVariant::kAvx512:
      return __builtin_cpu_supports("avx512f");
  }
  return false;
}
#else
void lerpVector(KernelVariant, float* ema, const void* src, SourceType type, int64_t count,
                float weight) {
  lerpBaseline(ema, src, type, count, weight);
}
void copyVector(KernelVariant, float* ema, const void* src, SourceType type, int64_t count) {
  copyBaseline(ema, src, type, count);
}
bool cpuSupports(KernelVariant variant) { return variant == KernelVariant::kBaseline; }
#endif

void checkAvailable(KernelVariant variant, const char* api) {
  TORCH_CHECK_VALUE(kernelVariantAvailable(variant), api, ": kernel variant '",
                    kernelVariantName(variant), "' is not available on this CPU or build");
}

KernelVariant chooseVariant() {
  const char* named = std::getenv("SHARDEMA_KERNEL");
  if (named != nullptr && *named != '\0') {
    for (KernelVariant v :
         {KernelVariant::kBaseline, KernelVariant::kAvx2, KernelVariant::kAvx512}) {
      if (std::string(named) == kernelVariantName(v)) {
        checkAvailable(v, "SHARDEMA_KERNEL");
        return v;
      }
    }
    TORCH_CHECK_VALUE(false, "SHARDEMA_KERNEL='", named,
                      "' is not a kernel variant (baseline, avx2, avx512)");
  }
  // AVX2 where the CPU has it, even beside AVX-512: on the 2-vCPU Xeon VM
  // the AVX-512 loops moved no more for 16-bit sources and 5-10% less for
  // fp32 (update_bench's kernel rows); SHARDEMA_KERNEL=avx512 opts in.
  return kernelVariantAvailable(KernelVariant::kAvx2) ? KernelVariant::kAvx2
                                                      : KernelVariant::kBaseline;
}

}  // namespace

const char* kernelVariantName(KernelVariant variant) {
  switch (variant) {
    case KernelVariant::kBaseline:
      return "baseline";
    case KernelVariant::kAvx2:
      return "avx2";
    case KernelVariant::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool kernelVariantAvailable(KernelVariant variant) { return cpuSupports(variant); }

std::vector<KernelVariant> availableKernelVariants() {
  std::vector<KernelVariant> out;
  for (KernelVariant v : {KernelVariant::kBaseline, KernelVariant::kAvx2, KernelVariant::kAvx512}) {
    if (kernelVariantAvailable(v)) out.push_back(v);
  }
  return out;
}

KernelVariant activeKernelVariant() {
  static const KernelVariant active = chooseVariant();
  return active;
}

void lerpRangeWith(KernelVariant variant, float* ema, const void* src, SourceType type,
                   int64_t count, float weight) {
  checkAvailable(variant, "lerpRangeWith");
  if (variant == KernelVariant::kBaseline) return lerpBaseline(ema, src, type, count, weight);
  lerpVector(variant, ema, src, type, count, weight);
}

void copyRangeWith(KernelVariant variant, float* ema, const void* src, SourceType type,
                   int64_t count) {
  checkAvailable(variant, "copyRangeWith");
  if (variant == KernelVariant::kBaseline) return copyBaseline(ema, src, type, count);
  copyVector(variant, ema, src, type, count);
}

// The hot entry points skip the availability check: the active variant was
// checked when it was chosen.
void lerpRange(float* ema, const void* src, SourceType type, int64_t count, float weight) {
  const KernelVariant variant = activeKernelVariant();
  if (variant == KernelVariant::kBaseline) return lerpBaseline(ema, src, type, count, weight);
  lerpVector(variant, ema, src, type, count, weight);
}

void copyRange(float* ema, const void* src, SourceType type, int64_t count) {
  const KernelVariant variant = activeKernelVariant();
  if (variant == KernelVariant::kBaseline) return copyBaseline(ema, src, type, count);
  copyVector(variant, ema, src, type, count);
}

}  // namespace shardema
