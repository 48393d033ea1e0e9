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

/* Weights stored as float32, or as bfloat16 (the upper half of a float32: widened exactly, so a
 * float32 weight that is a bfloat16 value gives the same products from either copy at half the
 * bytes read -- a distilled draft shipped in bf16 is, and its weights are re-read from memory after
 * every target pass has flushed the caches). */
static inline __m512 load_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Two accumulators per input row (even and odd 16-float pieces) keep two FMA chains in flight. */
#define KERNEL(N, NAME, TYPE, LOAD)                                                               \
static void NAME##_##N(const TYPE *w, const float *x, float *y, int64_t out, int64_t in,          \
                       int64_t begin, int64_t end) {                                              \
    for (int64_t o = begin; o < end; o++) {                                                       \
        const TYPE *wr = w + o * in;                                                              \
        __m512 acc[2][N];                                                                         \
        for (int u = 0; u < 2; u++)                                                               \
            for (int j = 0; j < N; j++) acc[u][j] = _mm512_setzero_ps();                          \
        int64_t i = 0;                                                                            \
        for (; i + 32 <= in; i += 32) {                                                           \
            _mm_prefetch((const char *)(wr + i) + PREFETCH_BYTES, _MM_HINT_T0);                   \
            _mm_prefetch((const char *)(wr + i) + PREFETCH_BYTES + 64, _MM_HINT_T0);              \
            __m512 w0 = LOAD(wr + i), w1 = LOAD(wr + i + 16);                                     \
            for (int j = 0; j < N; j++) {                                                         \
                acc[0][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * in + i), acc[0][j]);      \
                acc[1][j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + j * in + i + 16), acc[1][j]); \
            }                                                                                     \
        }                                                                                         \
        for (; i < in; i += 16) {                                                                 \
            __m512 w0 = LOAD(wr + i);                                                             \
            for (int j = 0; j < N; j++)                                                           \
                acc[0][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * in + i), acc[0][j]);      \
        }                                                                                         \
        for (int j = 0; j < N; j++)                                                               \
            y[j * out + o] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][j], acc[1][j]));           \
    }                                                                                             \
}
#define KERNELS(NAME, TYPE, LOAD) \
    KERNEL(1, NAME, TYPE, LOAD) KERNEL(2, NAME, TYPE, LOAD) KERNEL(3, NAME, TYPE, LOAD) KERNEL(4, NAME, TYPE, LOAD)
KERNELS(rows, float, load_f32)
KERNELS(rows_bf16, uint16_t, load_bf16)

/* y = x @ w^T with w [out, in] as float32 (bf16 = 0) or bfloat16 (bf16 = 1). 0 on success; -1 when
 * the shape is not covered (n outside 1..4, in not a multiple of 16). */
static int product(const void *w, int bf16, const float *x, float *y, int64_t out, int64_t in, int64_t n,
                   int threads) {
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
            /* one kernel per (weight type, row count) */
#define ROWS_CALL(NAME, TYPE) switch (n) {                                                          \
                case 1: NAME##_1((const TYPE *)w, x, y, out, in, begin, end); break;                \
                case 2: NAME##_2((const TYPE *)w, x, y, out, in, begin, end); break;                \
                case 3: NAME##_3((const TYPE *)w, x, y, out, in, begin, end); break;                \
                default: NAME##_4((const TYPE *)w, x, y, out, in, begin, end); break;               \
            }
            if (bf16) ROWS_CALL(rows_bf16, uint16_t) else ROWS_CALL(rows, float)
#undef ROWS_CALL
        }
    }
    return 0;
}

int fewrow_mm(const float *w, const float *x, float *y, int64_t out, int64_t in, int64_t n, int threads) {
    return product(w, 0, x, y, out, in, n, threads);
}

int fewrow_mm_bf16(const uint16_t *w, const float *x, float *y, int64_t out, int64_t in, int64_t n, int threads) {
    return product(w, 1, x, y, out, in, n, threads);
}

/* ---------------------------------------------------------------------------------------------
 * The decoder layers of a Llama pass over n = 1..4 new positions, in one call.
 *
 * Why: with the products in fewrow_mm, what is left of a SmolLM2 pass of one row is ~20 small
 * torch operations per layer (norms, rotary, cache writes, attention, residual adds, SiLU), each
 * paying ~10-40 us of dispatch on this CPU: ~5 ms of a ~20 ms pass, ~7.5 ms of a 3-row one
 * (scaled_dot_product_attention alone 40 / 86 us per call). Here they are plain loops around the
 * same products. Every row is computed on its own (its norm, its attention over the cache and the
 * rows before it, the products' per-row sums), so a position's values do not depend on how many
 * rows share the pass: a verify of k proposals gives bit for bit the logits k + 1 one-row passes
 * would. Semantics are Llama's (transformers' LlamaDecoderLayer, float32): RMSNorm
 * x * 1/sqrt(mean(x^2) + eps) * w; rotary q * cos + rotate_half(q) * sin; causal softmax attention
 * with grouped KV heads (query head h reads KV head h / (hq / hkv)); SiLU(gate) * up.
 * --------------------------------------------------------------------------------------------- */
#include <math.h>

typedef struct {
    const float *norm1;
    const void *wqkv, *wo;  /* float32, or bfloat16 where bf16 is 1 (all four matrices alike) */
    const float *norm2;
    const void *wgu, *wdown;
    int32_t bf16;
} layer_weights;

/* e^x for 16 lanes: x = m ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative
 * error below 1e-7, about float rounding), times 2^m. Inputs below -87 give 0-ish, as expf would. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 m = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(m, _mm512_set1_ps(0.693359375f), x);  /* ln2 in two parts: exact m * hi */
    r = _mm512_fnmadd_ps(m, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, m);
}

/* sum a[c] * b[c] over c < width (a multiple of 16) */
static inline float dot(const float *a, const float *b, int64_t width) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < width; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
    return _mm512_reduce_add_ps(acc);
}

static void rms_norm_rows(const float *x, const float *w, float *y, int64_t n, int64_t width, float eps) {
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * width;
        float *yr = y + i * width;
        __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(dot(xr, xr, width) / (float)width + eps));
        for (int64_t c = 0; c < width; c += 16)
            _mm512_storeu_ps(yr + c, _mm512_mul_ps(_mm512_loadu_ps(w + c), _mm512_mul_ps(_mm512_loadu_ps(xr + c), inverse)));
    }
}

/* v (one head, d values) rotated in place: v * cos + rotate_half(v) * sin. */
static void rotate(float *v, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t c = 0; c < half; c++) {
        float a = v[c], b = v[c + half];
        v[c] = a * cos[c] - b * sin[c];
        v[c + half] = b * cos[c + half] + a * sin[c + half];
    }
}

/* One query row of one head over the first `length` cached positions of its KV head (d a multiple
 * of 16): a softmax of the scaled scores, then their mix of the values. */
static void attend(const float *q, const float *keys, const float *values, float *out, float *scores,
                   int64_t length, int64_t d, float scale) {
    float top = -INFINITY;
    for (int64_t t = 0; t < length; t++) {
        float s = dot(q, keys + t * d, d) * scale;
        scores[t] = s;
        if (s > top) top = s;
    }
    __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
    for (int64_t t = 0; t < length; t += 16) {
        __mmask16 lanes = length - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (length - t)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + t), shift));
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(lanes, e));
        _mm512_mask_storeu_ps(scores + t, lanes, e);
    }
    float inverse = 1.0f / _mm512_reduce_add_ps(total);
    for (int64_t c = 0; c < d; c += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t t = 0; t < length; t++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[t]), _mm512_loadu_ps(values + t * d + c), acc);
        _mm512_storeu_ps(out + c, _mm512_mul_ps(acc, _mm512_set1_ps(inverse)));
    }
}

/* act[c] = SiLU(gate[c]) * up[c] = gate / (1 + e^-gate) * up, width a multiple of 16 */
static void silu_mul(const float *gate, const float *up, float *act, int64_t width) {
    for (int64_t c = 0; c < width; c += 16) {
        __m512 g = _mm512_loadu_ps(gate + c);
        __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
        _mm512_storeu_ps(act + c, _mm512_mul_ps(_mm512_div_ps(g, denominator), _mm512_loadu_ps(up + c)));
    }
}

/* x [n, hidden] (the residual stream, updated in place) through `layers` decoder layers; the new
 * positions' keys/values are written at [start, start + n) of the caches ([layers, hkv, capacity,
 * d] each). cos/sin: [n, d], the rotary rows of those positions. scratch: at least
 * fewrow_layers_scratch(...) floats. 0 on success; -1 (nothing touched) where a shape is not
 * covered. */
int64_t fewrow_layers_scratch(int64_t n, int64_t hidden, int64_t start, int64_t hq, int64_t hkv, int64_t d,
                              int64_t inter) {
    return n * hidden + n * (hq + 2 * hkv) * d + n * hq * d + n * 2 * inter + n * inter + hq * n * (start + n);
}

int fewrow_layers(float *x, int64_t n, int64_t hidden, const layer_weights *layers, int64_t num_layers,
                  float *keys, float *values, int64_t capacity, int64_t start, const float *cos,
                  const float *sin, int64_t hq, int64_t hkv, int64_t d, int64_t inter, float eps, float scale,
                  float *scratch, int threads) {
    if (n < 1 || n > 4 || threads < 1 || hkv < 1 || hq % hkv != 0 || d % 2 != 0 || start + n > capacity ||
        hidden % 16 != 0 || d % 16 != 0 || inter % 16 != 0)
        return -1;
    const int64_t width = (hq + 2 * hkv) * d, group = hq / hkv, end = start + n;
    float *h = scratch, *qkv = h + n * hidden, *attn = qkv + n * width, *gu = attn + n * hq * d;
    float *act = gu + n * 2 * inter, *scores = act + n * inter;
    for (int64_t l = 0; l < num_layers; l++) {
        const layer_weights *w = layers + l;
        float *layer_keys = keys + l * hkv * capacity * d, *layer_values = values + l * hkv * capacity * d;
        rms_norm_rows(x, w->norm1, h, n, hidden, eps);
        product(w->wqkv, w->bf16, h, qkv, width, hidden, n, threads);
        for (int64_t i = 0; i < n; i++) {
            float *row = qkv + i * width;
            for (int64_t j = 0; j < hq + hkv; j++) rotate(row + j * d, cos + i * d, sin + i * d, d);
            for (int64_t j = 0; j < hkv; j++) {
                float *k = layer_keys + (j * capacity + start + i) * d, *v = layer_values + (j * capacity + start + i) * d;
                for (int64_t c = 0; c < d; c++) {
                    k[c] = row[(hq + j) * d + c];
                    v[c] = row[(hq + hkv + j) * d + c];
                }
            }
        }
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t job = 0; job < hq * n; job++) {
            int64_t head = job / n, i = job % n, kv = head / group;
            attend(qkv + i * width + head * d, layer_keys + kv * capacity * d, layer_values + kv * capacity * d,
                   attn + i * hq * d + head * d, scores + job * end, start + i + 1, d, scale);
        }
        product(w->wo, w->bf16, attn, h, hidden, hq * d, n, threads);
        for (int64_t c = 0; c < n * hidden; c++) x[c] += h[c];
        rms_norm_rows(x, w->norm2, h, n, hidden, eps);
        product(w->wgu, w->bf16, h, gu, 2 * inter, hidden, n, threads);
        for (int64_t i = 0; i < n; i++) silu_mul(gu + i * 2 * inter, gu + i * 2 * inter + inter, act + i * inter, inter);
        product(w->wdown, w->bf16, act, h, hidden, inter, n, threads);
        for (int64_t c = 0; c < n * hidden; c++) x[c] += h[c];
    }
    return 0;
}
