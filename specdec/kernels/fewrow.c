/* y[n, out] = x[n, in] @ w[out, in]^T for n = 1..4 rows (float32), streaming w once.
 *
 * Why: a verify pass of k = 2 or 3 proposals multiplies every weight matrix by 3 or 4 rows. MKL's
 * product of that shape on this project's CPU (AMD EPYC) took ~40% longer than its 2-row product,
 * although both read the same weights from memory and the arithmetic is tiny. Here each thread
 * walks its share of w row by row as one sequential stream (the hardware prefetcher's best case,
 * helped by a software prefetch 4 KB ahead), and each 64-byte piece of a weight row, once loaded,
 * meets all n input rows (held in L1). For 1-2 rows it matches MKL on the target's wide matrices and
 * is 2-3x faster on a draft's small ones. Figures in specdec/fewrow.py, which compiles this on first use.
 */
#include <immintrin.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PREFETCH_BYTES 4096 /* how far ahead of the loads the stream is prefetched */

/* Two accumulators per input row (even and odd 16-float pieces) keep two FMA chains in flight. */
#define KERNEL(N)                                                                                 \
static void rows_##N(const float *w, const float *x, float *y, int64_t out, int64_t in,           \
                     int64_t begin, int64_t end) {                                                \
    for (int64_t o = begin; o < end; o++) {                                                       \
        const float *wr = w + o * in;                                                             \
        __m512 acc[2][N];                                                                         \
        for (int u = 0; u < 2; u++)                                                               \
            for (int j = 0; j < N; j++) acc[u][j] = _mm512_setzero_ps();                          \
        int64_t i = 0;                                                                            \
        for (; i + 32 <= in; i += 32) {                                                           \
            _mm_prefetch((const char *)(wr + i) + PREFETCH_BYTES, _MM_HINT_T0);                   \
            _mm_prefetch((const char *)(wr + i) + PREFETCH_BYTES + 64, _MM_HINT_T0);              \
            __m512 w0 = _mm512_loadu_ps(wr + i), w1 = _mm512_loadu_ps(wr + i + 16);               \
            for (int j = 0; j < N; j++) {                                                         \
                acc[0][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * in + i), acc[0][j]);      \
                acc[1][j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + j * in + i + 16), acc[1][j]); \
            }                                                                                     \
        }                                                                                         \
        for (; i < in; i += 16) {                                                                 \
            __m512 w0 = _mm512_loadu_ps(wr + i);                                                  \
            for (int j = 0; j < N; j++)                                                           \
                acc[0][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * in + i), acc[0][j]);      \
        }                                                                                         \
        for (int j = 0; j < N; j++)                                                               \
            y[j * out + o] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][j], acc[1][j]));           \
    }                                                                                             \
}
KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)

/* 0 on success; -1 when the shape is not covered (n outside 1..4, in not a multiple of 16). */
int fewrow_mm(const float *w, const float *x, float *y, int64_t out, int64_t in, int64_t n, int threads) {
    if (n < 1 || n > 4 || in % 16 != 0 || threads < 1) return -1;
    #pragma omp parallel num_threads(threads)
    {
        int t = 0, team = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        int64_t share = (out + team - 1) / team; /* one contiguous run of output rows per thread */
        int64_t begin = t * share, end = begin + share < out ? begin + share : out;
        if (begin < end) {
            switch (n) {
                case 1: rows_1(w, x, y, out, in, begin, end); break;
                case 2: rows_2(w, x, y, out, in, begin, end); break;
                case 3: rows_3(w, x, y, out, in, begin, end); break;
                default: rows_4(w, x, y, out, in, begin, end); break;
            }
        }
    }
    return 0;
}
