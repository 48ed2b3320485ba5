/* bf16 softmax attention for encoder inference on CPUs with AVX512-BF16
 * (Python side: dist_nce/index/attention.py).
 *
 * Why a kernel: a KB refresh encodes millions of short sequences (entity descriptions of
 * <= 128 tokens) with encoders whose heads are narrow (MiniLM: 32, BERT: 64). torch's CPU
 * flash attention splits such heads into GEMM calls too small to run well: on MiniLM it
 * took 30% of an encode for 5% of the FLOPs. Here one (sequence, head) is done in one pass
 * from L1: K and V are repacked once into VDPBF16PS pair layouts, each query tile's scores
 * stay in a small fp32 buffer, and the softmax is fused between the two products.
 *
 * For query row i of sequence b, head h:
 *   s_j = scale * sum_d q_i[d] k_j[d]          fp32 sums of exact bf16 products
 *   p_j = exp(s_j - max_j s_j) for allowed j, 0 for masked ones (fp32), rounded to bf16
 *   o_i = (sum_j p_j v_j) / (sum_j p_j)        fp32, rounded to bf16 once
 * which is what torch's bf16 flash attention computes, up to the order of the fp32 sums.
 * A row whose keys are all masked gets o_i = 0.
 *
 * Layouts (elements, bf16 as uint16): q, k, v are [B, H, W, D] with any strides for b, h
 * and the position, and unit stride over D; out is written as [B, W, H, D] contiguous, the
 * layout the output projection reads. mask (optional) is uint8 [B, W_q, W_k] with strides
 * (mb, mi, 1): 0 = key not attended; mi = 0 for a key-padding mask.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_exp.h"

#define QR 8   /* query rows per micro-tile */
#define KC 2   /* 16-key chunks per micro-tile: QR * KC = 16 independent accumulators */

int dnce_attn_abi(void) { return 1; }

static inline __mmask16 key_mask(const uint8_t *row, int64_t j, int64_t w) {
    /* allowed keys among [j, j + 16): the mask row's nonzero bytes, none at or past w */
    const int64_t n = w - j;
    const __mmask16 tail = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n > 0 ? n : 0)) - 1u);
    if (row == NULL) return tail;
    const __m128i bytes = _mm_maskz_loadu_epi8(tail, row + j);
    return _mm_test_epi8_mask(bytes, bytes) & tail;
}

/* Scores of the QR query rows qr against key chunks [c0, c0 + kc) into s [QR][W16], scaled,
 * masked keys -inf. kc is a constant at each call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void scores(const uint32_t *kp, int64_t dp, const uint32_t *const *qr,
                                                         const uint8_t *const *mr, int64_t c0, const int kc,
                                                         int64_t W, int64_t W16, __m512 vscale, float *s) {
    __m512 acc[QR][KC];
    for (int r = 0; r < QR; r++)
        for (int c = 0; c < kc; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < dp; p++) {
        __m512bh kz[KC];
        for (int c = 0; c < kc; c++) kz[c] = (__m512bh)_mm512_loadu_si512(kp + ((c0 + c) * dp + p) * 16);
        for (int r = 0; r < QR; r++) {
            const __m512bh qz = (__m512bh)_mm512_set1_epi32((int)qr[r][p]);
            for (int c = 0; c < kc; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qz, kz[c]);
        }
    }
    const __m512 vninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < QR; r++)
        for (int c = 0; c < kc; c++) {
            const int64_t j = (c0 + c) * 16;
            _mm512_storeu_ps(s + r * W16 + j, _mm512_mask_mul_ps(vninf, key_mask(mr[r], j, W), acc[r][c], vscale));
        }
}

/* o[r][d0 .. d0 + 16 dv) = inv[r] * sum_t pr[r][t] . vp[t][...] for the first `rows` rows of the tile,
 * stored as bf16; dv (1 or 2 vectors of 16 dims) is a constant at each call site. */
static inline __attribute__((always_inline)) void values(const uint32_t *vp, const uint32_t *pr, int64_t nt,
                                                         int64_t prs, int64_t D, int64_t d0, const int dv, int rows,
                                                         const float *inv, uint16_t *out, int64_t osw) {
    __m512 acc[QR][2];
    for (int r = 0; r < QR; r++)
        for (int x = 0; x < dv; x++) acc[r][x] = _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; t++) {
        __m512bh vz[2];
        for (int x = 0; x < dv; x++) vz[x] = (__m512bh)_mm512_loadu_si512(vp + t * D + d0 + 16 * x);
        for (int r = 0; r < QR; r++) {
            const __m512bh pz = (__m512bh)_mm512_set1_epi32((int)pr[r * prs + t]);
            for (int x = 0; x < dv; x++) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], pz, vz[x]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int x = 0; x < dv; x++) {
            const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][x], _mm512_set1_ps(inv[r])));
            _mm256_storeu_si256((__m256i *)(out + r * osw + d0 + 16 * x), (__m256i)o);
        }
}

/* One (b, h): kp [W16 / 16][D / 2][16] uint32 key pairs; vp [W2 / 2][D] uint32 pairs of
 * consecutive keys; s [QR][W16] fp32 and pr [QR][W16 / 2] uint32 scratch. */
static void head(const uint16_t *q, int64_t qsw, const uint16_t *k, int64_t ksw, const uint16_t *v, int64_t vsw,
                 uint16_t *out, int64_t osw, const uint8_t *mask, int64_t mi, int64_t W, int64_t D, float scale,
                 uint32_t *kp, uint32_t *vp, float *s, uint32_t *pr) {
    const int64_t dp = D / 2, nc = (W + 15) / 16, W16 = nc * 16, W2 = (W + 1) / 2 * 2;
    /* repack: keys into 16-lane pair vectors, values into pairs of consecutive keys */
    for (int64_t c = 0; c < nc; c++)
        for (int64_t p = 0; p < dp; p++)
            for (int l = 0; l < 16; l++) {
                const int64_t j = c * 16 + l;
                kp[(c * dp + p) * 16 + l] = j < W ? ((const uint32_t *)(k + j * ksw))[p] : 0u;
            }
    for (int64_t t = 0; t < W2 / 2; t++)
        for (int64_t d = 0; d < D; d++) {
            const uint32_t lo = v[(2 * t) * vsw + d];
            const uint32_t hi = 2 * t + 1 < W ? v[(2 * t + 1) * vsw + d] : 0u;
            vp[t * D + d] = lo | (hi << 16);
        }
    const __m512 vscale = _mm512_set1_ps(scale), vninf = _mm512_set1_ps(-INFINITY);
    for (int64_t i0 = 0; i0 < W; i0 += QR) {
        const uint32_t *qr[QR];
        const uint8_t *mr[QR];
        for (int r = 0; r < QR; r++) {
            const int64_t i = i0 + r < W ? i0 + r : W - 1;  /* rows past W: computed on row W-1, not stored */
            qr[r] = (const uint32_t *)(q + i * qsw);
            mr[r] = mask ? mask + i * mi : NULL;
        }
        /* scores, masked to -inf */
        int64_t c0 = 0;
        for (; c0 + KC <= nc; c0 += KC) scores(kp, dp, qr, mr, c0, KC, W, W16, vscale, s);
        if (c0 < nc) scores(kp, dp, qr, mr, c0, 1, W, W16, vscale, s);
        /* softmax numerators as bf16 pairs, and 1 / their fp32 sum */
        float inv[QR];
        for (int r = 0; r < QR; r++) {
            float *sr = s + r * W16;
            __m512 mx = vninf;
            for (int64_t j = 0; j < W16; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
            const float m = _mm512_reduce_max_ps(mx);
            const __m512 vm = _mm512_set1_ps(m == -INFINITY ? 0.0f : m);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < W16; j += 16) {
                const __m512 x = _mm512_loadu_ps(sr + j);
                const __mmask16 live = _mm512_cmp_ps_mask(x, vninf, _CMP_NEQ_OQ);
                const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(x, vm)));
                _mm512_storeu_ps(sr + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            const float total = _mm512_reduce_add_ps(sum);
            inv[r] = total > 0.0f ? 1.0f / total : 0.0f;
            /* pairs (p_2t, p_2t+1); W16 is a multiple of 16, so 32 keys per conversion but the last */
            uint32_t *pp = pr + r * (W16 / 2);
            for (int64_t j = 0; j < W16; j += 32) {
                if (j + 16 < W16) {
                    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + j + 16), _mm512_loadu_ps(sr + j));
                    _mm512_storeu_si512(pp + j / 2, (__m512i)b);
                } else {
                    const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(sr + j));
                    _mm256_storeu_si256((__m256i *)(pp + j / 2), (__m256i)b);
                }
            }
        }
        /* o = P V, 16 output dims per vector, two vectors at a time */
        const int rows = W - i0 < QR ? (int)(W - i0) : QR;
        int64_t d0 = 0;
        for (; d0 + 32 <= D; d0 += 32) values(vp, pr, W2 / 2, W16 / 2, D, d0, 2, rows, inv, out + i0 * osw, osw);
        if (d0 < D) values(vp, pr, W2 / 2, W16 / 2, D, d0, 1, rows, inv, out + i0 * osw, osw);
    }
}

/* Attention of sequences [b0, b1) (every head). Strides are in elements: qs/ks/vs = (b, h, position),
 * ms = (b, query position) of the mask (its key stride is 1). Returns 0; -1 for shapes the kernel
 * does not handle (D not a multiple of 16, W < 1); -2 when scratch memory cannot be had. */
int dnce_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t B, int64_t H,
                   int64_t W, int64_t D, const int64_t *qs, const int64_t *ks, const int64_t *vs, const uint8_t *mask,
                   const int64_t *ms, float scale, int64_t b0, int64_t b1) {
    if (D <= 0 || D % 16 || W < 1 || H < 1 || b0 < 0 || b1 > B || b0 > b1) return -1;
    const int64_t nc = (W + 15) / 16, W16 = nc * 16, W2 = (W + 1) / 2 * 2;
    const size_t kb = (size_t)W16 * D * 2, vb = (size_t)W2 * D * 2, sb = (size_t)QR * W16 * 4,
                 pb = (size_t)QR * W16 * 2;
    char *scratch = aligned_alloc(64, (kb + vb + sb + pb + 63) / 64 * 64)  /* a multiple of the alignment */;
    if (scratch == NULL) return -2;
    uint32_t *kp = (uint32_t *)scratch, *vp = (uint32_t *)(scratch + kb);
    float *s = (float *)(scratch + kb + vb);
    uint32_t *pr = (uint32_t *)(scratch + kb + vb + sb);
    for (int64_t b = b0; b < b1; b++)
        for (int64_t h = 0; h < H; h++)
            head(q + b * qs[0] + h * qs[1], qs[2], k + b * ks[0] + h * ks[1], ks[2], v + b * vs[0] + h * vs[1], vs[2],
                 out + (b * W * H + h) * D, H * D, mask ? mask + b * ms[0] : NULL, mask ? ms[1] : 0, W, D, scale,
                 kp, vp, s, pr);
    free(scratch);
    return 0;
}
