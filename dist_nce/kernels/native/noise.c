/* The integer half of the counter-based Gumbel noise (dist_nce/sampling/noise.py): for each
 * (query hash q, row) the uniform u = ((h >> 11) + 1/2) 2^-53 with h the splitmix64 hash of the
 * row and q, as float64, bit for bit what noise.py's torch passes compute before their two logs
 * (which stay torch's, so G = -log(-log u) has the same bits on either path).
 *
 * Why C: the block sampler draws N/b + (K-1) b noise values per query (every block, then the
 * kept blocks' rows: 2M values for 128 queries over 1M rows), and torch spends a dozen passes of
 * int64 arithmetic on them, as long as the logs; here it is one pass. Plain C, no vector
 * extension: it builds and runs on any CPU with a C compiler.
 */
#include <stdint.h>

int dnce_noise_abi(void) { return 1; }

#define ROW_SALT 0x5851F42D4C957F2DULL

/* splitmix64's finaliser (noise.py's _mix): a bijection on 64-bit words, wrapping arithmetic */
static inline uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* (h >> 11 + 1/2) 2^-53: h >> 11 < 2^53 converts exactly, then one rounding per operation, as torch's
 * copy_, add_(0.5) and mul_(2^-53) (build flags keep the compiler from fusing them) */
static inline double uniform(uint64_t h) {
    return ((double)(h >> 11) + 0.5) * 0x1p-53;
}

/* out = uniforms of queries qh [nq] (noise.py's q, already mixed with the seed) against rows.
 * shared = 1: rows [n] are mix(row ^ salt) (the caller mixes the n shared rows once);
 *   rows_first = 0: out [nq][n]; 1: out [n][nq].
 * shared = 0: rows [nq][n] global rows of each query, out [nq][n]. */
void dnce_uniforms(const int64_t *qh, int64_t nq, const int64_t *rows, int64_t n, int64_t shared, int64_t rows_first,
                   double *out) {
    if (shared && rows_first) {
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < nq; i++) out[j * nq + i] = uniform(mix((uint64_t)qh[i] ^ (uint64_t)rows[j]));
    } else if (shared) {
        for (int64_t i = 0; i < nq; i++)
            for (int64_t j = 0; j < n; j++) out[i * n + j] = uniform(mix((uint64_t)qh[i] ^ (uint64_t)rows[j]));
    } else {
        for (int64_t i = 0; i < nq; i++)
            for (int64_t j = 0; j < n; j++)
                out[i * n + j] = uniform(mix(mix((uint64_t)rows[i * n + j] ^ ROW_SALT) ^ (uint64_t)qh[i]));
    }
}
