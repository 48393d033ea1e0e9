/* y[n, out] = x[n, in] @ w[out, in]^T for any n rows (float32), streaming w once.
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

/* One weight row wr against N input rows (x, row stride `in`): y[j * out] = wr . x_j. Two
 * accumulators per input row (even and odd 16-float pieces) keep two FMA chains in flight. Every
 * row is reduced by the same instructions in the same order whatever N is, so a row's product
 * does not depend on how many rows share the call (batch invariance: see product()). */
#define KERNEL(N, NAME, TYPE, LOAD)                                                               \
static inline void NAME##_##N(const TYPE *wr, const float *x, float *y, int64_t out, int64_t in) { \
    __m512 acc[2][N];                                                                             \
    for (int u = 0; u < 2; u++)                                                                   \
        for (int j = 0; j < N; j++) acc[u][j] = _mm512_setzero_ps();                              \
    int64_t i = 0;                                                                                \
    for (; i + 32 <= in; i += 32) {                                                               \
        _mm_prefetch((const char *)(wr + i) + PREFETCH_BYTES, _MM_HINT_T0);                       \
        _mm_prefetch((const char *)(wr + i) + PREFETCH_BYTES + 64, _MM_HINT_T0);                  \
        __m512 w0 = LOAD(wr + i), w1 = LOAD(wr + i + 16);                                         \
        for (int j = 0; j < N; j++) {                                                             \
            acc[0][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * in + i), acc[0][j]);          \
            acc[1][j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + j * in + i + 16), acc[1][j]);     \
        }                                                                                         \
    }                                                                                             \
    for (; i < in; i += 16) {                                                                     \
        __m512 w0 = LOAD(wr + i);                                                                 \
        for (int j = 0; j < N; j++)                                                               \
            acc[0][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * in + i), acc[0][j]);          \
    }                                                                                             \
    for (int j = 0; j < N; j++)                                                                   \
        y[j * out] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][j], acc[1][j]));                   \
}
#define KERNELS(NAME, TYPE, LOAD)                                                                  \
    KERNEL(1, NAME, TYPE, LOAD) KERNEL(2, NAME, TYPE, LOAD) KERNEL(3, NAME, TYPE, LOAD)              \
    KERNEL(4, NAME, TYPE, LOAD) KERNEL(5, NAME, TYPE, LOAD) KERNEL(6, NAME, TYPE, LOAD)              \
    KERNEL(7, NAME, TYPE, LOAD) KERNEL(8, NAME, TYPE, LOAD)                                          \
static inline void NAME##_tile(const TYPE *wr, const float *x, float *y, int64_t out, int64_t in, int64_t n) { \
    switch (n) {                                                                                  \
    case 1: NAME##_1(wr, x, y, out, in); break;                                                   \
    case 2: NAME##_2(wr, x, y, out, in); break;                                                   \
    case 3: NAME##_3(wr, x, y, out, in); break;                                                   \
    case 4: NAME##_4(wr, x, y, out, in); break;                                                   \
    case 5: NAME##_5(wr, x, y, out, in); break;                                                   \
    case 6: NAME##_6(wr, x, y, out, in); break;                                                   \
    case 7: NAME##_7(wr, x, y, out, in); break;                                                   \
    default: NAME##_8(wr, x, y, out, in); break;                                                  \
    }                                                                                             \
}
KERNELS(rows, float, load_f32)
KERNELS(rows_bf16, uint16_t, load_bf16)

#define TILE_ROWS 8              /* input rows one pass of a weight row meets (16 accumulators, 2 weights) */
#define WEIGHT_BLOCK_BYTES 131072 /* weight rows swept per tile of inputs: they stay in L2 meanwhile */

/* y = x @ w^T with w [out, in] as float32 (bf16 = 0) or bfloat16 (bf16 = 1), for any n >= 1 rows.
 * Each thread takes one contiguous run of weight rows, in blocks that fit L2; each block is swept
 * once per tile of up to 8 input rows (which stay in L1), so the weights are read from memory
 * once whatever n is, and up to 8 rows as one stream. A row's value is computed the same way in
 * every tile size, so y's row j depends on x's row j and w alone: the property batched serving
 * rests on (a session's logits are the same whatever shares its pass). 0 on success; -1 when the
 * shape is not covered (n < 1, in not a multiple of 16). */
static int product(const void *w, int bf16, const float *x, float *y, int64_t out, int64_t in, int64_t n,
                   int threads) {
    if (n < 1 || in % 16 != 0 || threads < 1) return -1;
    #pragma omp parallel num_threads(threads)
    {
        int t = 0, team = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        int64_t share = (out + team - 1) / team;
        int64_t begin = t * share, end = begin + share < out ? begin + share : out;
        int64_t block = n <= TILE_ROWS ? end - begin : WEIGHT_BLOCK_BYTES / (in * (bf16 ? 2 : 4));
        if (block < 1) block = 1;
        for (int64_t b = begin; b < end; b += block) {
            int64_t block_end = b + block < end ? b + block : end;
            for (int64_t r = 0; r < n; r += TILE_ROWS) {
                int64_t rows = n - r < TILE_ROWS ? n - r : TILE_ROWS;
                for (int64_t o = b; o < block_end; o++) {
                    if (bf16)
                        rows_bf16_tile((const uint16_t *)w + o * in, x + r * in, y + r * out + o, out, in, rows);
                    else
                        rows_tile((const float *)w + o * in, x + r * in, y + r * out + o, out, in, rows);
                }
            }
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
 * The decoder layers of a Llama pass over the new positions of one or several sequences, in one call.
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
#include <stdlib.h>

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
/* Attention of one query row over positions [0, length) of its sequence, whose keys and values
 * live in a paged pool (see specdec/modeling/paged.py): `keys` / `values` point at this (layer,
 * kv head)'s slice of block 0, `blocks` is the sequence's table and `stride` the floats from one
 * block to the next. Positions are taken in order, block by block (no division per position), so
 * the sums -- and the bits -- do not depend on which blocks hold them. */
static void attend(const float *q, const float *keys, const float *values, const int64_t *blocks, int64_t block,
                   int64_t stride, float *out, float *scores, int64_t length, int64_t d, float scale) {
    float top = -INFINITY;
    for (int64_t first = 0, b = 0; first < length; first += block, b++) {
        const float *k = keys + blocks[b] * stride;
        int64_t n = length - first < block ? length - first : block;
        for (int64_t j = 0; j < n; j++) {
            float s = dot(q, k + j * d, d) * scale;
            scores[first + j] = s;
            if (s > top) top = s;
        }
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
        for (int64_t first = 0, b = 0; first < length; first += block, b++) {
            const float *v = values + blocks[b] * stride + c;
            int64_t n = length - first < block ? length - first : block;
            for (int64_t j = 0; j < n; j++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[first + j]), _mm512_loadu_ps(v + j * d), acc);
        }
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

/* One sequence of a batched pass: its KV in a paged pool shared by every sequence, keys and
 * values [layers, pool_blocks, hkv, block, d] each; `blocks` its table (block ids, `num_blocks` of
 * them, covering positions [0, num_blocks * block)); its new rows' positions [start, start + rows). */
typedef struct {
    float *keys, *values;
    const int64_t *blocks;
    int64_t num_blocks, block, pool_blocks, start, rows;
} segment;

/* Floats of scratch fewrow_batch needs: the pass's activations for every row, and each row's
 * attention scores over its own sequence, for every head. */
int64_t fewrow_batch_scratch(const segment *segments, int64_t num_segments, int64_t hidden, int64_t hq, int64_t hkv,
                             int64_t d, int64_t inter) {
    int64_t n = 0, scores = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        n += segments[s].rows;
        scores += hq * segments[s].rows * (segments[s].start + segments[s].rows);
    }
    return n * hidden + n * (hq + 2 * hkv) * d + n * hq * d + n * 2 * inter + n * inter + scores;
}

/* x [n, hidden] (the residual stream of every segment's rows, one segment after another; updated
 * in place) through `layers` decoder layers. Each segment's new keys/values are written at
 * [start, start + rows) of its own blocks, and each row attends to its own segment's positions only.
 * cos/sin: [n, d], the rotary rows of each row's position. scratch: fewrow_batch_scratch(...)
 * floats. 0 on success; -1 (nothing touched) where a shape is not covered.
 *
 * A row's values depend on its own segment alone: the products are batch-invariant (product()),
 * the norms, rotary and SiLU are per row, and attention is per (row, head) over that row's
 * sequence in a fixed order. So a sequence's logits are the same bits whatever other sequences
 * share the pass, however many rows it brings, and however its positions were split into passes. */
int fewrow_batch(float *x, int64_t hidden, const layer_weights *layers, int64_t num_layers, const segment *segments,
                 int64_t num_segments, const float *cos, const float *sin, int64_t hq, int64_t hkv, int64_t d,
                 int64_t inter, float eps, float scale, float *scratch, int threads) {
    if (num_segments < 1 || threads < 1 || hkv < 1 || hq % hkv != 0 || d % 2 != 0 || hidden % 16 != 0 ||
        d % 16 != 0 || inter % 16 != 0)
        return -1;
    int64_t n = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const segment *g = segments + s;
        if (g->rows < 1 || g->start < 0 || g->block < 1 || g->start + g->rows > g->num_blocks * g->block) return -1;
        n += g->rows;
    }
    /* per row: its segment, its position, where its scores start in scratch */
    int64_t *row_segment = malloc(sizeof(int64_t) * 3 * n);
    if (row_segment == NULL) return -1;
    int64_t *row_position = row_segment + n, *row_scores = row_position + n;
    int64_t scores_total = 0;
    for (int64_t s = 0, r = 0; s < num_segments; s++)
        for (int64_t i = 0; i < segments[s].rows; i++, r++) {
            row_segment[r] = s;
            row_position[r] = segments[s].start + i;
            row_scores[r] = scores_total;
            scores_total += hq * (row_position[r] + 1);
        }
    const int64_t width = (hq + 2 * hkv) * d, group = hq / hkv;
    float *h = scratch, *qkv = h + n * hidden, *attn = qkv + n * width, *gu = attn + n * hq * d;
    float *act = gu + n * 2 * inter, *scores = act + n * inter;
    for (int64_t l = 0; l < num_layers; l++) {
        const layer_weights *w = layers + l;
        rms_norm_rows(x, w->norm1, h, n, hidden, eps);
        product(w->wqkv, w->bf16, h, qkv, width, hidden, n, threads);
        for (int64_t r = 0; r < n; r++) {
            const segment *g = segments + row_segment[r];
            float *row = qkv + r * width;
            for (int64_t j = 0; j < hq + hkv; j++) rotate(row + j * d, cos + r * d, sin + r * d, d);
            int64_t p = row_position[r], id = g->blocks[p / g->block];
            for (int64_t j = 0; j < hkv; j++) {
                int64_t at = (((l * g->pool_blocks + id) * hkv + j) * g->block + p % g->block) * d;
                for (int64_t c = 0; c < d; c++) {
                    g->keys[at + c] = row[(hq + j) * d + c];
                    g->values[at + c] = row[(hq + hkv + j) * d + c];
                }
            }
        }
        #pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
        for (int64_t job = 0; job < hq * n; job++) {
            int64_t r = job / hq, head = job % hq, kv = head / group;
            const segment *g = segments + row_segment[r];
            int64_t base = ((l * g->pool_blocks) * hkv + kv) * g->block * d, stride = hkv * g->block * d;
            attend(qkv + r * width + head * d, g->keys + base, g->values + base, g->blocks, g->block, stride,
                   attn + r * hq * d + head * d, scores + row_scores[r] + head * (row_position[r] + 1),
                   row_position[r] + 1, d, scale);
        }
        product(w->wo, w->bf16, attn, h, hidden, hq * d, n, threads);
        for (int64_t c = 0; c < n * hidden; c++) x[c] += h[c];
        rms_norm_rows(x, w->norm2, h, n, hidden, eps);
        product(w->wgu, w->bf16, h, gu, 2 * inter, hidden, n, threads);
        for (int64_t r = 0; r < n; r++) silu_mul(gu + r * 2 * inter, gu + r * 2 * inter + inter, act + r * inter, inter);
        product(w->wdown, w->bf16, act, h, hidden, inter, n, threads);
        for (int64_t c = 0; c < n * hidden; c++) x[c] += h[c];
    }
    free(row_segment);
    return 0;
}
