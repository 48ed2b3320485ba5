/* Fused fp32 scoring + block log-sum-exp + best-block selection for the exact block sampler
 * and the exact top-k, on AVX2 + FMA (no AVX512): the CPUs without AVX512-BF16, where
 * block_lse.c cannot run. Python side: dist_nce/sampling/block_native.py.
 *
 * Why a kernel: torch's path writes every [B, chunk] score chunk out and reads it back in
 * half a dozen passes (block max, exp, sum, masks, thresholds), which cost more than its GEMM
 * (docs/design.md section 5). Here the scores of one block and one tile of queries stay in
 * L1: block max, sum of exp, and the block kept only if it can enter the top k.
 *
 * Score of (query q, row r), for fp32 or bf16 rows (bf16 widened exactly to fp32):
 *   acc = 0; for p in 0 .. d/2-1: acc = fma(q[2p+1], e[2p+1], acc); acc = fma(q[2p], e[2p], acc)
 *   (odd d: then acc = fma(q[d-1], e[d-1], acc))
 * each FMA rounding once. For bf16 queries and rows every product is exact in fp32, so this is
 * VDPBF16PS's sequence and the scores are block_lse.c's bit for bit (normal numbers: VDPBF16PS
 * flushes denormals); the block max, the sum of exp, the mass and the keys below repeat
 * block_lse.c's operations lane for lane, so both kernels draw the same sample. The order is
 * fixed per (query, row): a score has the same bits whichever tile, block, call or thread
 * computes it, hence sharded == flat bit for bit.
 *
 * Layout: rows are row-major fp32 or bf16 [n, d]; queries are packed by the caller as fp32
 * [tiles][d][QT] (QT = 16 queries per tile, lanes = queries). One row value is broadcast and
 * multiplied into the query lanes, so a block's reduction over rows is lane-wise.
 *
 * Top-k (noise == NULL): a block's key is its max, not L_B + G_B; the k best blocks by
 * (max desc, block asc) hold the k best rows by (score desc, row asc) (block_fused.py).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_exp.h"

#define QV 2              /* ymm vectors of queries per tile */
#define QT (8 * QV)       /* queries per tile (the candidate mask below is 32 bits) */
#ifndef ER
#define ER 6              /* rows per micro-tile: 12 accumulators, 2 query vectors, 1 broadcast */
#endif

int dnce_fp32_abi(void) { return 1; }
int dnce_fp32_qt(void) { return QT; }

/* x 2^e for an integer-valued e <= 0 (or -inf): AVX512's scalef (exact scaling, one rounding). */
static inline double scale2(double x, double e) {
    return ldexp(x, e >= 0.0 ? 0 : e > -4000.0 ? (int)e : -4000);
}

/* scale2 on 4 lanes, for the lanes in need (others: any value). 2^e is built from its exponent bits
 * where e >= -1022 (t = e + 2^52 + 1023 holds e + 1023 in its low bits); a lane further down (a
 * block 2^1022 below the running maximum, or the first block of a query) goes through ldexp. */
static inline __m256d scale2_pd(__m256d x, __m256d e, __m256d need) {
    const __m256d low = _mm256_andnot_pd(_mm256_cmp_pd(e, _mm256_set1_pd(-1022.0), _CMP_GE_OQ), need);
    if (_mm256_movemask_pd(low)) {
        double xs[4], es[4];
        _mm256_storeu_pd(xs, x);
        _mm256_storeu_pd(es, e);
        for (int h = 0; h < 4; h++) xs[h] = scale2(xs[h], es[h]);
        return _mm256_loadu_pd(xs);
    }
    const __m256d t = _mm256_add_pd(e, _mm256_set1_pd(4503599627371519.0));
    const __m256i bits = _mm256_slli_epi64(
        _mm256_sub_epi64(_mm256_castpd_si256(t), _mm256_set1_epi64x(0x4330000000000000LL)), 52);
    return _mm256_mul_pd(x, _mm256_castsi256_pd(bits));
}

/* Rows [first, first + b) of bf16 ent as fp32 into rows (b x d), row lo standing in for rows
 * outside [lo, hi) (their scores are masked by the caller). */
static void widen_block(const uint16_t *ent, int64_t base, int64_t d, int64_t first, int64_t lo, int64_t hi,
                        int64_t b, float *rows) {
    for (int64_t r = 0; r < b; r++) {
        int64_t g = first + r;
        if (g < lo || g >= hi) g = lo;
        const uint16_t *src = ent + (g - base) * d;
        float *dst = rows + r * d;
        int64_t c = 0;
        for (; c + 8 <= d; c += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + c)));
            _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        for (; c < d; c++) {
            uint32_t w = (uint32_t)src[c] << 16;
            memcpy(dst + c, &w, 4);
        }
    }
}

/* Scores of the b rows rp[0..b) for one query tile into buf[r * QT + lane], and their lane-wise
 * maximum into mx[v] (the caller points rows outside the piece at a valid row and masks them;
 * mx then counts them: it is used only for unmasked blocks). Issues prefetches for the pf_lines
 * cache lines at pf, spread over the micro-tiles. */
static void score_block(const float *const *rp_all, int64_t d, int64_t b, const float *qp, float *buf, __m256 *mx,
                        const char *pf, int64_t pf_lines) {
    for (int v = 0; v < QV; v++) mx[v] = _mm256_set1_ps(-INFINITY);
    const int64_t dp = d / 2, per = (pf_lines + (b + ER - 1) / ER - 1) / ((b + ER - 1) / ER);
    int64_t fetched = 0;
    for (int64_t r0 = 0; r0 < b; r0 += ER) {
        for (int64_t x = 0; x < per && fetched < pf_lines; x++, fetched++) _mm_prefetch(pf + 64 * fetched, _MM_HINT_T0);
        /* row i of the micro-tile at row + off[i]: one running pointer (rows past b repeat row r0) */
        const float *row = rp_all[r0];
        int64_t off[ER];
        for (int i = 0; i < ER; i++) off[i] = rp_all[r0 + i < b ? r0 + i : r0] - row;
        __m256 acc[ER][QV];
        for (int i = 0; i < ER; i++)
            for (int v = 0; v < QV; v++) acc[i][v] = _mm256_setzero_ps();
        const float *q2 = qp;
        for (int64_t p = 0; p < dp; p++, row += 2, q2 += 2 * QT) {
            __m256 q[QV];  /* dimension 2p+1, then 2p: VDPBF16PS's order */
            for (int v = 0; v < QV; v++) q[v] = _mm256_loadu_ps(q2 + QT + 8 * v);
            for (int i = 0; i < ER; i++) {
                const __m256 e = _mm256_broadcast_ss(row + off[i] + 1);
                for (int v = 0; v < QV; v++) acc[i][v] = _mm256_fmadd_ps(q[v], e, acc[i][v]);
            }
            for (int v = 0; v < QV; v++) q[v] = _mm256_loadu_ps(q2 + 8 * v);
            for (int i = 0; i < ER; i++) {
                const __m256 e = _mm256_broadcast_ss(row + off[i]);
                for (int v = 0; v < QV; v++) acc[i][v] = _mm256_fmadd_ps(q[v], e, acc[i][v]);
            }
        }
        if (d % 2) {
            __m256 q[QV];
            for (int v = 0; v < QV; v++) q[v] = _mm256_loadu_ps(q2 + 8 * v);
            for (int i = 0; i < ER; i++) {
                const __m256 e = _mm256_broadcast_ss(row + off[i]);
                for (int v = 0; v < QV; v++) acc[i][v] = _mm256_fmadd_ps(q[v], e, acc[i][v]);
            }
        }
        for (int i = 0; i < ER && r0 + i < b; i++)
            for (int v = 0; v < QV; v++) {
                _mm256_store_ps(buf + (r0 + i) * QT + 8 * v, acc[i][v]);
                mx[v] = _mm256_max_ps(mx[v], acc[i][v]);
            }
    }
}

static inline int better(double ta, int64_t ja, double tb, int64_t jb) {
    return ta > tb || (ta == tb && ja < jb);
}

/* A query's k slots are a binary heap whose root (slot 0) is its worst kept block: lowest T, then
 * highest block, empty slots (T = -inf, block -1) first; thr is the root's T. A block that beats
 * the root takes its place and sinks (O(log k), where block_lse.c scans all k); the scores stay
 * where they were written, slot_id says where. The set kept is the k best by (T desc, block asc)
 * either way, so the blocks handed back equal block_lse.c's once sorted by counter. */
static void heap_insert(double *st, int64_t *sj, int64_t *sc, int64_t *sid, int64_t k, double t, int64_t j,
                        int64_t c) {
    const int64_t id = sid[0];
    int64_t i = 0;
    for (;;) {
        int64_t w = i, l = 2 * i + 1;  /* w: the worst of i and its children (the new block at i) */
        double tw = t;
        int64_t jw = j;
        if (l < k && better(tw, jw, st[l], sj[l])) { w = l; tw = st[l]; jw = sj[l]; }
        if (l + 1 < k && better(tw, jw, st[l + 1], sj[l + 1])) w = l + 1;
        if (w == i) break;
        st[i] = st[w]; sj[i] = sj[w]; sc[i] = sc[w]; sid[i] = sid[w];
        i = w;
    }
    st[i] = t; sj[i] = j; sc[i] = c; sid[i] = id;
}

/* One call: block_lse.c's dnce_block_topk (read its comment for the state arrays), with
 *   ent:      rows, fp32 (ent_bf16 = 0) or bf16 (ent_bf16 = 1);
 *   qp:       packed queries [nqp / QT][d][QT] fp32, zero-padded;
 *   noise:    [j1 - j0][nqp] float64 G_B, or NULL for the exact top-k (key = block max);
 *   slot_*:   the k best blocks of each query as a heap (see heap_insert) whose slot i holds the
 *             scores slot_scores[q][slot_id[q][i]] (slot_id starts as 0 .. k-1); no wslot;
 *   buf:      scratch of b * QT floats, 32-byte aligned;
 *   rows:     scratch of b * d floats (bf16 rows are widened into it a block at a time);
 *   rp:       scratch of b pointers.
 * Any b >= 1 (the last micro-tile of a block may be partial). Returns 0, or -1 for arguments
 * the kernel does not handle. */
int dnce_fp32_block_topk(const void *ent, int64_t ent_bf16, int64_t base, int64_t d, int64_t lo, int64_t hi,
                         int64_t b, int64_t j0, int64_t j1, const float *qp, int64_t nq, const double *noise,
                         const int64_t *counter, const int64_t *gold, int64_t ne, const int64_t *dead, int64_t nd,
                         int64_t k, double *slot_t, int64_t *slot_j, int64_t *slot_c, int64_t *slot_id,
                         float *slot_scores, double *thr, double *lz_ref, double *lz_sum, float *out_m, float *out_s,
                         float *buf, float *rows, const float **rp) {
    if (d <= 0 || b <= 0 || k <= 0 || j1 < j0 || nq <= 0) return -1;
    const int64_t nb = j1 - j0, ntiles = (nq + QT - 1) / QT, nqp = ntiles * QT;
    const float ninf = -INFINITY;
    const __m256 vninf = _mm256_set1_ps(ninf);
    for (int64_t j = j0; j < j1; j++) {
        const int64_t first = j * b, jj = j - j0;
        const int64_t rlo = first > lo ? first : lo, rhi = first + b < hi ? first + b : hi;
        if (rhi <= rlo) continue;
        int64_t da, db;  /* dead rows of this block: [da, db) of the sorted list */
        { int64_t a = 0, z = nd; while (a < z) { int64_t m = (a + z) / 2; if (dead[m] < rlo) a = m + 1; else z = m; }
          da = a; z = nd; while (a < z) { int64_t m = (a + z) / 2; if (dead[m] < rhi) a = m + 1; else z = m; } db = a; }
        const int64_t live = (rhi - rlo) - (db - da);
        if (live <= 0) continue;  /* no eligible row: L_B = -inf for every query */
        const double log_live = log((double)live) + 1e-9;
        if (ent_bf16) {
            widen_block((const uint16_t *)ent, base, d, first, rlo, rhi, b, rows);
            for (int64_t r = 0; r < b; r++) rp[r] = rows + r * d;
        } else {
            for (int64_t r = 0; r < b; r++) {
                const int64_t g = first + r < rlo || first + r >= rhi ? rlo : first + r;
                rp[r] = (const float *)ent + (g - base) * d;
            }
        }
        /* the next block's rows, a share per tile: from DRAM they would stall its first tile */
        const int64_t next = first + b, next_hi = next + b < hi ? next + b : hi, esz = ent_bf16 ? 2 : 4;
        const char *pf = (const char *)ent + (next - base) * d * esz;
        const int64_t lines = next_hi > next ? ((next_hi - next) * d * esz + 63) / 64 : 0;
        const int64_t share = (lines + ntiles - 1) / ntiles;
        for (int64_t t = 0; t < ntiles; t++) {
            __m256 mx[QV];
            const int64_t from = t * share < lines ? t * share : lines;
            score_block(rp, d, b, qp + t * d * QT, buf, mx, pf + 64 * from,
                        from + share < lines ? share : lines - from);
            /* a block with no masked row for any lane of the tile takes its max from the micro-tiles */
            int clean = rlo == first && rhi == first + b && db == da;
            for (int64_t r = 0; r < rlo - first; r++)
                for (int v = 0; v < QV; v++) _mm256_store_ps(buf + r * QT + 8 * v, vninf);
            for (int64_t r = rhi - first; r < b; r++)
                for (int v = 0; v < QV; v++) _mm256_store_ps(buf + r * QT + 8 * v, vninf);
            for (int64_t x = da; x < db; x++)
                for (int v = 0; v < QV; v++) _mm256_store_ps(buf + (dead[x] - first) * QT + 8 * v, vninf);
            const int64_t q0 = t * QT, qn = nq - q0 < QT ? nq - q0 : QT;
            for (int64_t l = 0; l < qn; l++)
                for (int64_t e = 0; e < ne; e++) {
                    const int64_t g = gold[(q0 + l) * ne + e];
                    if (g >= rlo && g < rhi) { buf[(g - first) * QT + l] = ninf; clean = 0; }
                }
            float mv[QT] __attribute__((aligned(32))), sv[QT] __attribute__((aligned(32)));
            /* L_B per lane = m + log(s): the block's max, then the sum of exp(s - max), rows in order */
            __m256 m[QV], ms[QV], sum[QV];
            for (int v = 0; v < QV; v++) {
                m[v] = mx[v];
                if (!clean) {
                    m[v] = vninf;
                    for (int64_t r = 0; r < b; r++) m[v] = _mm256_max_ps(m[v], _mm256_load_ps(buf + r * QT + 8 * v));
                }
                ms[v] = _mm256_and_ps(m[v], _mm256_cmp_ps(m[v], vninf, _CMP_NEQ_OQ));  /* dead lanes: 0 */
                sum[v] = _mm256_setzero_ps();
            }
            for (int64_t r = 0; r < b; r++)
                for (int v = 0; v < QV; v++)
                    sum[v] = _mm256_add_ps(sum[v],
                                           exp256_ps(_mm256_sub_ps(_mm256_load_ps(buf + r * QT + 8 * v), ms[v])));
            for (int v = 0; v < QV; v++) {
                _mm256_store_ps(mv + 8 * v, m[v]);
                _mm256_store_ps(sv + 8 * v, sum[v]);
            }
            /* mass: sum_B exp(L_B) = lz_sum * 2^lz_ref, lz_ref an integer (block_lse.c, lane for lane): a
             * block adds s exp(m - i ln2) 2^(i - lz_ref), i = round(m / ln2), and a new maximum rescales */
            for (int h = 0; h < QT / 4; h++) {
                const __m256d md = _mm256_cvtps_pd(_mm_load_ps(mv + 4 * h)), ninf_pd = _mm256_set1_pd(-INFINITY);
                const __m256d alive = _mm256_cmp_pd(md, ninf_pd, _CMP_NEQ_OQ);
                const __m256d i = _mm256_round_pd(_mm256_mul_pd(md, _mm256_set1_pd(1.4426950408889634)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                double *rf = lz_ref + q0 + 4 * h, *sm = lz_sum + q0 + 4 * h;
                __m256d ref = _mm256_loadu_pd(rf), acc = _mm256_loadu_pd(sm);
                const __m256d up = _mm256_and_pd(alive, _mm256_cmp_pd(i, ref, _CMP_GT_OQ));
                const __m256d fresh = _mm256_cmp_pd(ref, ninf_pd, _CMP_EQ_OQ);  /* a first live block: 0 */
                const __m256d moved =
                    _mm256_andnot_pd(fresh, scale2_pd(acc, _mm256_sub_pd(ref, i), _mm256_andnot_pd(fresh, up)));
                acc = _mm256_blendv_pd(acc, moved, up);
                ref = _mm256_blendv_pd(ref, i, up);
                const __m256d w = _mm256_mul_pd(_mm256_cvtps_pd(_mm_load_ps(sv + 4 * h)), exp256_pd_reduced(md, i));
                acc = _mm256_blendv_pd(acc, _mm256_add_pd(acc, scale2_pd(w, _mm256_sub_pd(i, ref), alive)), alive);
                _mm256_storeu_pd(rf, ref);
                _mm256_storeu_pd(sm, acc);
            }
            /* candidates: T_B <= m + log(live) + G, so lanes whose bound is below their worst kept
             * block cannot enter and skip the log (block_lse.c's test, 4 lanes at a time) */
            uint32_t cand = 0;
            for (int h = 0; h < QT / 4; h++) {
                const __m256d md = _mm256_cvtps_pd(_mm_load_ps(mv + 4 * h));
                const __m256d ub = noise ? _mm256_add_pd(_mm256_add_pd(md, _mm256_set1_pd(log_live)),
                                                         _mm256_loadu_pd(noise + jj * nqp + q0 + 4 * h)) : md;
                cand |= (uint32_t)_mm256_movemask_pd(_mm256_cmp_pd(ub, _mm256_loadu_pd(thr + q0 + 4 * h), _CMP_GE_OQ))
                        << (4 * h);
            }
            while (cand) {
                const int l = __builtin_ctz(cand);
                cand &= cand - 1;
                if (l >= qn || mv[l] == ninf) continue;
                const int64_t q = q0 + l;
                const double tb = noise ? (double)mv[l] + log((double)sv[l]) + noise[jj * nqp + q] : (double)mv[l];
                double *st = slot_t + q * k;
                int64_t *sj = slot_j + q * k;
                if (!better(tb, j, st[0], sj[0])) continue;
                float *dst = slot_scores + (q * k + slot_id[q * k]) * b;
                for (int64_t r = 0; r < b; r++) dst[r] = buf[r * QT + l];
                heap_insert(st, sj, slot_c + q * k, slot_id + q * k, k, tb, j, counter[jj]);
                thr[q] = st[0];
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
