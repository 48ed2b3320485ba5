/* Fused bf16 scoring + block log-sum-exp + best-block selection for the exact block
 * Gumbel sampler (dist_nce/sampling/block_gumbel.py; Python wrapper dist_nce/sampling/block_native.py).
 *
 * Why a kernel: the sampler needs, per (query, block of b rows), L_B = logsumexp of the
 * block's scores and the b scores of the K-1 blocks with the best T_B = L_B + G_B. torch's
 * CPU bf16 GEMM rounds its output to bf16 and its fp32 GEMM runs at a quarter of the bf16
 * rate, and the scores it writes out cost more memory traffic than the GEMM. Here each
 * score is an fp32 sum of exact bf16 products (AVX512-BF16 VDPBF16PS), consumed in
 * registers/L1: block max, sum of exp, and the block kept only if it can enter the top k.
 *
 * Score of (query q, row r): acc = 0; for p in 0 .. d/2-1:
 *   acc += q[2p+1] * e[2p+1]; acc += q[2p] * e[2p]       (fp32, round to nearest each step)
 * which is VDPBF16PS's definition (each bf16 x bf16 product is exact in fp32). The order is
 * fixed per (query, row): a score has the same bits whichever tile, block, call or thread
 * computes it, hence sharded == flat bit for bit.
 *
 * Layout: rows are row-major bf16 [n, d]; queries are packed by the caller as uint32 pairs
 * [tiles][d/2][QT] (QT = 32 queries per tile, lanes = queries). One entity pair is broadcast
 * and multiplied into the query lanes, so rows need no repacking and a block's reduction
 * over rows is lane-wise (no horizontal sums).
 *
 * Top-k (noise == NULL): a block's key is its max, not L_B + G_B; the k best blocks by
 * (max desc, block asc) hold the k best rows by (score desc, row asc) (block_fused.py).
 * block_fp32.c is this kernel for AVX2 + FMA, the same function of the same inputs.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_exp.h"

#ifndef QV
#define QV 2              /* zmm vectors of queries per tile */
#endif
#define QT (16 * QV)      /* queries per tile */
#if QT > 32
#error "the candidate mask is 32 bits: QV <= 2"
#endif
#ifndef ER
#define ER 8              /* rows per micro-tile */
#endif

int dnce_block_abi(void) { return 4; }
int dnce_block_qt(void) { return QT; }
int dnce_block_er(void) { return ER; }

/* Scores of rows [first, first + b) for one query tile into buf[r * QT + lane], and their
 * lane-wise maximum into mx[v]; rows outside [lo, hi) are computed on row lo (valid memory)
 * and masked by the caller (mx then counts them: the caller uses mx only for unmasked blocks). */
static void score_block(const uint16_t *ent, int64_t base, int64_t d, int64_t first, int64_t lo, int64_t hi,
                        int64_t b, const uint32_t *qp, float *buf, __m512 *mx) {
    for (int v = 0; v < QV; v++) mx[v] = _mm512_set1_ps(-INFINITY);
    const int64_t dp = d / 2;
    for (int64_t r0 = 0; r0 < b; r0 += ER) {
        const uint32_t *rp[ER];
        for (int i = 0; i < ER; i++) {
            int64_t g = first + r0 + i;
            if (g < lo || g >= hi) g = lo;
            rp[i] = (const uint32_t *)(ent + (g - base) * d);
        }
        __m512 acc[ER][QV];
        for (int i = 0; i < ER; i++)
            for (int v = 0; v < QV; v++) acc[i][v] = _mm512_setzero_ps();
        for (int64_t p = 0; p < dp; p++) {
            __m512bh q[QV];
            for (int v = 0; v < QV; v++) q[v] = (__m512bh)_mm512_loadu_si512((const void *)(qp + p * QT + 16 * v));
            for (int i = 0; i < ER; i++) {
                __m512bh e = (__m512bh)_mm512_set1_epi32((int)rp[i][p]);
                for (int v = 0; v < QV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], q[v], e);
            }
        }
        for (int i = 0; i < ER; i++)
            for (int v = 0; v < QV; v++) {
                _mm512_store_ps(buf + (r0 + i) * QT + 16 * v, acc[i][v]);
                mx[v] = _mm512_max_ps(mx[v], acc[i][v]);
            }
    }
}

static inline int better(double ta, int64_t ja, double tb, int64_t jb) {
    return ta > tb || (ta == tb && ja < jb);
}

static int64_t worst_slot(const double *st, const int64_t *sj, int64_t k) {
    int64_t w = 0;  /* lowest T, then highest block; empty slots have T = -inf, block -1 */
    for (int64_t i = 1; i < k; i++)
        if (better(st[w], sj[w], st[i], sj[i])) w = i;
    return w;
}

/* One call: the whole blocks [j0, j1) of the global grid (block j = rows [j*b, (j+1)*b)),
 * restricted to rows [lo, hi) that ent holds (row g at ent + (g - base) * d). Updates the
 * running state of nq queries:
 *   the k best blocks by (T desc, block asc): slot_t, slot_j (-1 empty), slot_c (the block's
 *   counter) [nq][k], slot_scores [nq][k][b] (the block's scores, -inf for masked rows);
 *   thr [nqp] the T of each query's worst slot (-inf while a slot is empty), wslot [nqp] its slot;
 *   the mass sum_B exp(L_B) = lz_sum * 2^lz_ref, lz_ref [nqp] (integers, -inf before any block),
 *   lz_sum [nqp].
 * nqp = ceil(nq / QT) * QT. Optionally writes each block's fp32 max and sum of exp(s - max) to
 * out_m / out_s [nq][j1 - j0] (tests; NULL otherwise).
 *
 * qp:      packed queries [nqp / QT][d/2][QT] uint32 (bf16 pairs).
 * noise:   [j1 - j0][nqp] float64 G_B of each block (drawn by the caller), or NULL for top-k.
 * counter: [j1 - j0] int64, the first row of each block's piece.
 * gold:    [nq][ne] int64 global rows (-1 none); dead: [nd] sorted int64 global rows.
 * buf:     scratch of b * QT floats, 64-byte aligned.
 * Returns 0, or -1 for arguments the kernel does not handle. */
int dnce_block_topk(const uint16_t *ent, int64_t base, int64_t d, int64_t lo, int64_t hi, int64_t b,
                    int64_t j0, int64_t j1, const uint32_t *qp, int64_t nq, const double *noise,
                    const int64_t *counter, const int64_t *gold, int64_t ne, const int64_t *dead, int64_t nd,
                    int64_t k, double *slot_t, int64_t *slot_j, int64_t *slot_c, float *slot_scores,
                    double *thr, int64_t *wslot, double *lz_ref, double *lz_sum, float *out_m, float *out_s,
                    float *buf) {
    if (d <= 0 || d % 2 || b % ER || b <= 0 || k <= 0 || j1 < j0 || nq <= 0) return -1;
    const int64_t nb = j1 - j0, dp = d / 2, ntiles = (nq + QT - 1) / QT, nqp = ntiles * QT;
    const float ninf = -INFINITY;
    const __m512 vninf = _mm512_set1_ps(ninf);
    for (int64_t j = j0; j < j1; j++) {
        const int64_t first = j * b, jj = j - j0;
        const int64_t rlo = first > lo ? first : lo, rhi = first + b < hi ? first + b : hi;
        if (rhi <= rlo) continue;
        int64_t da, db;  /* dead rows of this block: [da, db) of the sorted list */
        { int64_t a = 0, z = nd; while (a < z) { int64_t m = (a + z) / 2; if (dead[m] < rlo) a = m + 1; else z = m; }
          da = a; z = nd; while (a < z) { int64_t m = (a + z) / 2; if (dead[m] < rhi) a = m + 1; else z = m; } db = a; }
        const int64_t live = (rhi - rlo) - (db - da);
        if (live <= 0) continue;  /* no eligible row: L_B = -inf for every query */
        const __m512d log_live = _mm512_set1_pd(log((double)live) + 1e-9);
        for (int64_t t = 0; t < ntiles; t++) {
            __m512 mx[QV];
            score_block(ent, base, d, first, rlo, rhi, b, qp + t * dp * QT, buf, mx);
            /* a block with no masked row for any lane of the tile takes its max from the micro-tiles */
            int clean = rlo == first && rhi == first + b && db == da;
            for (int64_t r = 0; r < b; r++)
                if (first + r < rlo || first + r >= rhi)
                    for (int v = 0; v < QV; v++) _mm512_store_ps(buf + r * QT + 16 * v, vninf);
            for (int64_t x = da; x < db; x++)
                for (int v = 0; v < QV; v++) _mm512_store_ps(buf + (dead[x] - first) * QT + 16 * v, vninf);
            const int64_t q0 = t * QT, qn = nq - q0 < QT ? nq - q0 : QT;
            for (int64_t l = 0; l < qn; l++)
                for (int64_t e = 0; e < ne; e++) {
                    const int64_t g = gold[(q0 + l) * ne + e];
                    if (g >= rlo && g < rhi) { buf[(g - first) * QT + l] = ninf; clean = 0; }
                }
            float mv[QT] __attribute__((aligned(64))), sv[QT] __attribute__((aligned(64)));
            uint32_t cand = 0;
            for (int v = 0; v < QV; v++) {
                /* L_B per lane = m + log(s): the block's max, then the sum of exp(s - max) */
                __m512 m = mx[v];
                if (!clean) {
                    m = vninf;
                    for (int64_t r = 0; r < b; r++) m = _mm512_max_ps(m, _mm512_load_ps(buf + r * QT + 16 * v));
                }
                const __mmask16 alive = _mm512_cmp_ps_mask(m, vninf, _CMP_NEQ_OQ);
                const __m512 ms = _mm512_maskz_mov_ps(alive, m);
                __m512 s = _mm512_setzero_ps();
                for (int64_t r = 0; r < b; r++)
                    s = _mm512_add_ps(s, exp_ps(_mm512_sub_ps(_mm512_load_ps(buf + r * QT + 16 * v), ms)));
                _mm512_store_ps(mv + 16 * v, m);
                _mm512_store_ps(sv + 16 * v, s);
                /* mass: sum_B exp(L_B) = lz_sum * 2^lz_ref, lz_ref an integer. Each block adds
                 * s * exp(m - i ln2) * 2^(i - lz_ref), i = round(m / ln2): the factor s * exp(m - i ln2)
                 * depends on the block alone and the scaling by a power of 2 is exact, so the total
                 * depends on the order of the float64 additions only (sharded == flat to ~1e-15). */
                for (int h = 0; h < 2; h++) {
                    const __m256 m8 = h ? _mm512_extractf32x8_ps(m, 1) : _mm512_castps512_ps256(m);
                    const __m256 s8 = h ? _mm512_extractf32x8_ps(s, 1) : _mm512_castps512_ps256(s);
                    const __mmask8 al = (__mmask8)(alive >> (8 * h));
                    const __m512d md = _mm512_maskz_cvtps_pd(al, m8);
                    const __m512d i = _mm512_roundscale_pd(_mm512_mul_pd(md, _mm512_set1_pd(1.4426950408889634)),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    double *rf = lz_ref + q0 + 16 * v + 8 * h, *sm = lz_sum + q0 + 16 * v + 8 * h;
                    __m512d ref = _mm512_loadu_pd(rf), acc = _mm512_loadu_pd(sm);
                    /* lanes with a new maximum (or a first live block: ref = -inf) move ref up */
                    const __mmask8 up = _mm512_mask_cmp_pd_mask(al, i, ref, _CMP_GT_OQ);
                    acc = _mm512_mask_scalef_pd(acc, up, acc, _mm512_sub_pd(ref, i));
                    acc = _mm512_mask_mov_pd(acc, up & _mm512_cmp_pd_mask(ref, _mm512_set1_pd(-INFINITY), _CMP_EQ_OQ),
                                             _mm512_setzero_pd());
                    ref = _mm512_mask_mov_pd(ref, up, i);
                    const __m512d w = _mm512_mul_pd(_mm512_maskz_cvtps_pd(al, s8), exp_pd_reduced(md, i));
                    acc = _mm512_mask_add_pd(acc, al, acc, _mm512_scalef_pd(w, _mm512_sub_pd(i, ref)));
                    _mm512_storeu_pd(rf, ref);
                    _mm512_storeu_pd(sm, acc);
                }
                /* candidates: T_B <= m + log(live) + G, so lanes whose bound is below their worst kept
                 * block cannot enter and skip the log */
                const double *g = noise ? noise + jj * nqp + q0 + 16 * v : NULL;
                const double *th = thr + q0 + 16 * v;
                for (int h = 0; h < 2; h++) {
                    const __m512d md = _mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(m, 1) : _mm512_castps512_ps256(m));
                    const __m512d ub = g ? _mm512_add_pd(_mm512_add_pd(md, log_live), _mm512_loadu_pd(g + 8 * h)) : md;
                    __mmask8 c = _mm512_cmp_pd_mask(ub, _mm512_loadu_pd(th + 8 * h), _CMP_GE_OQ);
                    cand |= (uint32_t)c << (16 * v + 8 * h);
                }
            }
            while (cand) {
                const int l = __builtin_ctz(cand);
                cand &= cand - 1;
                if (l >= qn || mv[l] == ninf) continue;
                const int64_t q = q0 + l;
                const double tb = noise ? (double)mv[l] + log((double)sv[l]) + noise[jj * nqp + q] : (double)mv[l];
                double *st = slot_t + q * k;
                int64_t *sj = slot_j + q * k;
                const int64_t w = wslot[q];
                if (!better(tb, j, st[w], sj[w])) continue;
                st[w] = tb; sj[w] = j; slot_c[q * k + w] = counter[jj];
                float *dst = slot_scores + (q * k + w) * b;
                for (int64_t r = 0; r < b; r++) dst[r] = buf[r * QT + l];
                wslot[q] = worst_slot(st, sj, k);
                thr[q] = st[wslot[q]];
            }
            if (out_m)
                for (int64_t l = 0; l < qn; l++) {
                    out_m[(q0 + l) * nb + jj] = mv[l];
                    out_s[(q0 + l) * nb + jj] = sv[l];
                }
        }
    }
    return 0;
}
