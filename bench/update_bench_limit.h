#pragma once
// update_bench's limit loops: in-place a[i] += s*b[i] over an fp32 stream, or
// over a 2-byte stream widened as bf16, the access patterns of an fp32 and
// of a bf16/fp16 update. Split from update_bench.cpp to keep files small.
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace shardema::bench {

// The limit's loops are explicit AVX2, unrolled like the kernels (a
// compiler-vectorised loop ran at the mercy of its alignment, and a limit
// slower than the memory system reads as "ours exceeds the limit"). AVX2,
// not AVX-512: on this VM the AVX-512 loop moved 5-10% less (update_bench's
// kernel/avx512 rows), and the limit must be the fastest way to move the
// bytes. The 16-bit limit reads a 2-byte stream widened as bf16: the
// access pattern of a bf16/fp16 update (10 B per element), so those rows
// are held to their own bytes, not the fp32 pattern's.
#if defined(__x86_64__)
__attribute__((target("avx2"))) void addInPlaceAvx2(float* a, const float* b, int64_t n,
                                                    float sign) {
  const __m256 s = _mm256_set1_ps(sign);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 32; k += 8) {
      _mm256_storeu_ps(a + i + k, _mm256_add_ps(_mm256_loadu_ps(a + i + k),
                                                _mm256_mul_ps(s, _mm256_loadu_ps(b + i + k))));
    }
  }
  for (; i < n; ++i) a[i] += sign * b[i];
}

__attribute__((target("avx2"))) void addInPlace16Avx2(float* a, const uint16_t* b, int64_t n,
                                                      float sign) {
  const __m256 s = _mm256_set1_ps(sign);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 32; k += 8) {
      const __m256i wide =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i + k)));
      const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
      _mm256_storeu_ps(a + i + k, _mm256_add_ps(_mm256_loadu_ps(a + i + k), _mm256_mul_ps(s, x)));
    }
  }
  for (; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(b[i]) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    a[i] += sign * x;
  }
}
#endif

bool haveAvx2() {
#if defined(__x86_64__)
  static const bool have = __builtin_cpu_supports("avx2") != 0;
  return have;
#else
  return false;
#endif
}

void addInPlace(float* __restrict a, const float* __restrict b, int64_t n, float sign) {
#if defined(__x86_64__)
  if (haveAvx2()) return addInPlaceAvx2(a, b, n, sign);
#endif
  for (int64_t i = 0; i < n; ++i) a[i] += sign * b[i];
}

void addInPlace16(float* __restrict a, const uint16_t* __restrict b, int64_t n, float sign) {
#if defined(__x86_64__)
  if (haveAvx2()) return addInPlace16Avx2(a, b, n, sign);
#endif
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(b[i]) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    a[i] += sign * x;
  }
}

}  // namespace shardema::bench
