// AVX-512 and AVX2 paths of the Adam update (see adam_kernel.h for the formula and rounding order).
//
// Each path is a function with a target attribute, not a translation unit built with -mavx512f: one
// binary then runs on any x86-64 and simd::active() decides at run time. Helpers carry the same target
// and are always_inline; their names differ per width because GCC treats same-signature functions with
// different targets as multiversioned.
//
// Memory traffic is the whole cost (28 bytes per fp32 element: read p, g, m, v, write p, m, v), so the
// loop is a single pass at full vector width; the low-precision copy is written in that same pass.
#pragma once

#if defined(__x86_64__)

#include <immintrin.h>

#include "pyparallel/adam_kernel.h"

// GCC 12's intrinsic headers start some vectors from _mm*_undefined_*(), which -Wall at -O3 reports as
// "may be used uninitialized" once inlined here; the values are fully written before use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define PP_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define PP_AVX512_INL __attribute__((target("avx512f,avx2,fma,f16c"), always_inline)) inline
#define PP_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PP_AVX2_INL __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace pyparallel {
namespace adam {

// ---------------------------------------------------------------- AVX-512: 16 floats per vector

PP_AVX512_INL __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
PP_AVX512_INL __m512 load16(const c10::BFloat16* p) {  // bf16 is the high half of an fp32: widen, shift
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PP_AVX512_INL __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Round to nearest even exactly as c10::BFloat16(float): add 0x7FFF + lsb, keep the high half; NaN -> 0x7FC0.
PP_AVX512_INL void store16(c10::BFloat16* out, __m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}
PP_AVX512_INL void store16(c10::Half* out, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

PP_AVX512_INL __m512 neg16(__m512 x) {  // flip the sign bit: -g, also for zeros (0 - g would give +0)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

template <typename G, typename O>
PP_AVX512 void range_avx512(const Consts& c, const Piece& pc, int64_t lo, int64_t hi) {
  // Locals, not reads through `c` / `pc` in the loop: the stores through float* could alias them, which
  // would make the compiler reload every flag and pointer per vector.
  const G* __restrict gp = static_cast<const G*>(pc.g);
  float* __restrict pp = pc.p;
  float* __restrict mp = pc.m;
  float* __restrict vp = pc.v;
  float* __restrict vmaxp = pc.vmax;
  O* __restrict outp = static_cast<O*>(pc.out);
  const bool maximize = c.maximize, l2_on = c.l2_on, amsgrad = c.amsgrad, from_end = c.lerp_from_end;
  const __m512 neg_step = _mm512_set1_ps(c.neg_step_size), coeff = _mm512_set1_ps(c.lerp_coeff);
  const __m512 beta2 = _mm512_set1_ps(c.beta2), w2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 bc2 = _mm512_set1_ps(c.bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 decay = _mm512_set1_ps(c.decay), l2 = _mm512_set1_ps(c.l2), neg_zero = _mm512_set1_ps(-0.0f);
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m512 g = load16(gp + i);
    __m512 p = _mm512_loadu_ps(pp + i);
    if (maximize) g = neg16(g);
    if (l2_on) g = _mm512_fmadd_ps(l2, p, g);
    p = _mm512_fmadd_ps(p, decay, neg_zero);
    const __m512 m_old = _mm512_loadu_ps(mp + i);
    const __m512 m = _mm512_fmadd_ps(coeff, _mm512_sub_ps(g, m_old), from_end ? g : m_old);
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(w2, g), g, _mm512_mul_ps(_mm512_loadu_ps(vp + i), beta2));
    __m512 vv = v;
    if (amsgrad) {
      vv = _mm512_max_ps(_mm512_loadu_ps(vmaxp + i), v);
      _mm512_storeu_ps(vmaxp + i, vv);
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), bc2), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step, m), denom));
    _mm512_storeu_ps(pp + i, p);
    _mm512_storeu_ps(mp + i, m);
    _mm512_storeu_ps(vp + i, v);
    if constexpr (kHasOut<O>) store16(outp + i, p);
  }
  scalar_range<G, O>(c, pc, i, hi);
}

// ---------------------------------------------------------------- AVX2 + FMA + F16C: 8 floats per vector

PP_AVX2_INL __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
PP_AVX2_INL __m256 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
PP_AVX2_INL __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

PP_AVX2_INL void store8(c10::BFloat16* out, __m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  // packus works per 128-bit lane: [r0..3, r0..3, r4..7, r4..7] -> gather the two useful quarters.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}
PP_AVX2_INL void store8(c10::Half* out, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

PP_AVX2_INL __m256 neg8(__m256 x) {
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(x), _mm256_set1_epi32(INT32_MIN)));
}

template <typename G, typename O>
PP_AVX2 void range_avx2(const Consts& c, const Piece& pc, int64_t lo, int64_t hi) {
  // Locals, not reads through `c` / `pc` in the loop: the stores through float* could alias them, which
  // would make the compiler reload every flag and pointer per vector.
  const G* __restrict gp = static_cast<const G*>(pc.g);
  float* __restrict pp = pc.p;
  float* __restrict mp = pc.m;
  float* __restrict vp = pc.v;
  float* __restrict vmaxp = pc.vmax;
  O* __restrict outp = static_cast<O*>(pc.out);
  const bool maximize = c.maximize, l2_on = c.l2_on, amsgrad = c.amsgrad, from_end = c.lerp_from_end;
  const __m256 neg_step = _mm256_set1_ps(c.neg_step_size), coeff = _mm256_set1_ps(c.lerp_coeff);
  const __m256 beta2 = _mm256_set1_ps(c.beta2), w2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 bc2 = _mm256_set1_ps(c.bc2_sqrt), eps = _mm256_set1_ps(c.eps);
  const __m256 decay = _mm256_set1_ps(c.decay), l2 = _mm256_set1_ps(c.l2), neg_zero = _mm256_set1_ps(-0.0f);
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 g = load8(gp + i);
    __m256 p = _mm256_loadu_ps(pp + i);
    if (maximize) g = neg8(g);
    if (l2_on) g = _mm256_fmadd_ps(l2, p, g);
    p = _mm256_fmadd_ps(p, decay, neg_zero);
    const __m256 m_old = _mm256_loadu_ps(mp + i);
    const __m256 m = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m_old), from_end ? g : m_old);
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(w2, g), g, _mm256_mul_ps(_mm256_loadu_ps(vp + i), beta2));
    __m256 vv = v;
    if (amsgrad) {
      vv = _mm256_max_ps(_mm256_loadu_ps(vmaxp + i), v);
      _mm256_storeu_ps(vmaxp + i, vv);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), bc2), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step, m), denom));
    _mm256_storeu_ps(pp + i, p);
    _mm256_storeu_ps(mp + i, m);
    _mm256_storeu_ps(vp + i, v);
    if constexpr (kHasOut<O>) store8(outp + i, p);
  }
  scalar_range<G, O>(c, pc, i, hi);
}

}  // namespace adam
}  // namespace pyparallel

#pragma GCC diagnostic pop

#endif  // __x86_64__
