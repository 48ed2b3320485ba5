/* Vectorised exp shared by the native kernels: exp_ps (AVX512: block_lse.c, attention_bf16.c) and
 * exp256_ps (AVX2 + FMA: block_fp32.c), and the float64 block-mass exp_pd_reduced / exp256_pd_reduced
 * (block_lse.c / block_fp32.c), each pair the same operations lane for lane, so the same bits. */
#ifndef DNCE_SIMD_EXP_H
#define DNCE_SIMD_EXP_H
#include <immintrin.h>

/* exp(r) for |r| <= ln2/2: degree-12 Taylor coefficients, truncation < 1e-15 relative. */
static const double dnce_exp_taylor[13] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                           1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800,
                                           1.0 / 479001600};

#ifdef __AVX512F__

/* exp(x) for float32 lanes x <= 0 (scores minus their block maximum), ~1-2 ulp; x below -87.3
 * (also -inf, a masked row) gives ~1e-38 instead of 0: below 2^-120 of a block's sum, which
 * always holds a term exp(0) = 1. Cephes' expf polynomial on the Cody-Waite reduced argument. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* exp(m - i ln2) for float64 lanes with i = round(m / ln2), so |m - i ln2| <= ln2/2: the mantissa
 * of exp(m) = exp(m - i ln2) 2^i (ln2 split in two for an exact reduction). */
static inline __m512d exp_pd_reduced(__m512d m, __m512d i) {
    __m512d r = _mm512_fnmadd_pd(i, _mm512_set1_pd(6.93147180369123816490e-01), m);
    r = _mm512_fnmadd_pd(i, _mm512_set1_pd(1.90821492927058770002e-10), r);
    __m512d p = _mm512_set1_pd(dnce_exp_taylor[12]);
    for (int j = 11; j >= 0; j--) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(dnce_exp_taylor[j]));
    return p;
}

#endif /* __AVX512F__ */

#if defined(__AVX2__) && defined(__FMA__)
/* exp_ps on 8 lanes: the same clamp, reduction and polynomial; scalef(p, n) becomes a multiply by
 * 2^n built from its exponent bits (n in [-126, 0] for the x <= 0 used here: a normal power of
 * two, so the product rounds as scalef does). */
static inline __m256 exp256_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* exp_pd_reduced on 4 lanes: the same FMAs. */
static inline __m256d exp256_pd_reduced(__m256d m, __m256d i) {
    __m256d r = _mm256_fnmadd_pd(i, _mm256_set1_pd(6.93147180369123816490e-01), m);
    r = _mm256_fnmadd_pd(i, _mm256_set1_pd(1.90821492927058770002e-10), r);
    __m256d p = _mm256_set1_pd(dnce_exp_taylor[12]);
    for (int j = 11; j >= 0; j--) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(dnce_exp_taylor[j]));
    return p;
}
#endif

#endif
