/* Small-row float32 matrix-vector products for CPU decode steps (kernels/cpu_gemv.py).
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for M <= GEMV_MAX_ROWS rows, W row-major
 * [N, K]. A decode step streams every weight once: this loop reads each row of W once for all
 * M rows of x (x stays in L1/L2), 8 floats at a time with AVX2 FMA, and splits the rows of W
 * across OpenMP threads (the same libgomp runtime torch uses, so one thread pool).
 *
 * Built at run time with -O3 -mavx2 -mfma -fopenmp; the Python side checks the CPU first. The
 * int8 product also has an AVX-512 loop (function-level target, chosen at run time where the
 * CPU has AVX512F+BW): widening int8 to float takes one shuffle and one convert per 16 weights
 * there instead of per 8, and that widening, not the memory, bounded the AVX2 loop.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* rows of x per register block: 8 accumulators + a weight vector + an x load fit AVX2's 16 ymm
 * registers. More rows than that run in blocks over the same row of W, which stays in L1, so
 * DRAM still sees each weight once per call. */
#define ROW_BLOCK 8
#define GEMV_MAX_ROWS 64
/* rows of W per work item. The items are split into one contiguous range per thread
 * (schedule(static)), so the threads' shares differ by at most one item. With 64-row items a
 * 576-row layer (9 items) gave one of two threads 5/9 of it: SmolLM2-135M's qkv, o and down
 * projections, half of each block's weights, ran ~10% longer than an even split. */
#define ROWS_PER_ITEM 8

/* bytes ahead of the row being read that a row's weights are prefetched: each row asks for
 * the cache lines PREFETCH_AHEAD bytes past its own. The hardware prefetcher alone kept too
 * few lines in flight while the core widened and multiplied: one pass over SmolLM2-135M's int8
 * layers (134 MB, 2 threads) read 9-12 GB/s against 19-22 GB/s for a loop that only loads the
 * same rows; with 2 KB ahead it read 15-17 GB/s (1 KB 16, 256 B no gain). */
#define PREFETCH_AHEAD 2048
static int64_t prefetch_ahead = PREFETCH_AHEAD;

/* Sets how far ahead rows are prefetched (bytes; 0 = off, the hardware prefetcher alone), for
 * A/B benchmarks (TOKENMILL_GEMV_PREFETCH); returns the distance now in use. */
int64_t tokenmill_gemv_prefetch(int64_t bytes) {
    if (bytes >= 0) prefetch_ahead = bytes;
    return prefetch_ahead;
}

static inline void prefetch_row(const void *row, int64_t bytes) {
    if (!prefetch_ahead) return;
    const char *p = (const char *)row + prefetch_ahead;
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 shuf = _mm_movehdup_ps(lo);
    __m128 sums = _mm_add_ps(lo, shuf);
    shuf = _mm_movehl_ps(shuf, sums);
    sums = _mm_add_ss(sums, shuf);
    return _mm_cvtss_f32(sums);
}

int tokenmill_gemv_max_rows(void) { return GEMV_MAX_ROWS; }

/* out[j] = sum_i w8(i) * x[j * k + i] for the NR rows of x at x: one function per block size,
 * so the compiler unrolls the loops and keeps the accumulators in registers. An FMA waits ~4
 * cycles for its accumulator and two issue per cycle, so ~8 independent sums keep a core busy:
 * with fewer rows than that, U accumulators per row each take every U-th group of 8 along k
 * (one row alone was bound by that chain, not by memory: int8 ran no faster than float32).
 * LOAD_W turns 8 weights at wr + i into a __m256; WT is the weight element type (tail loop). */
#define DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, NR, U)                                               \
    static inline void NAME##_##NR(const WT *wr, const float *x, int64_t k, int64_t k8,         \
                                   float *out) {                                                \
        __m256 acc[NR][U];                                                                     \
        for (int j = 0; j < NR; j++)                                                           \
            for (int u = 0; u < U; u++) acc[j][u] = _mm256_setzero_ps();                        \
        const int64_t ku = k8 - k8 % (8 * U);                                                  \
        int64_t i = 0;                                                                         \
        for (; i < ku; i += 8 * U) {                                                           \
            for (int u = 0; u < U; u++) {                                                      \
                const __m256 wv = LOAD_W(wr + i + 8 * u);                                      \
                for (int j = 0; j < NR; j++)                                                   \
                    acc[j][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * k + i + 8 * u),    \
                                                acc[j][u]);                                    \
            }                                                                                  \
        }                                                                                      \
        for (; i < k8; i += 8) {                                                               \
            const __m256 wv = LOAD_W(wr + i);                                                  \
            for (int j = 0; j < NR; j++)                                                       \
                acc[j][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * k + i), acc[j][0]);    \
        }                                                                                      \
        for (int j = 0; j < NR; j++) {                                                         \
            __m256 sum = acc[j][0];                                                            \
            for (int u = 1; u < U; u++) sum = _mm256_add_ps(sum, acc[j][u]);                   \
            float s = hsum(sum);                                                               \
            for (int64_t t = k8; t < k; t++) s += (float)wr[t] * x[j * k + t];                 \
            out[j] = s;                                                                        \
        }                                                                                      \
    }

/* NAME: all m rows of x against one row of W, ROW_BLOCK rows at a time, through the blocks
 * NAME_1 .. NAME_8; ATTR: the function's target attribute (empty: the build's flags); kt: the
 * end of the vector part of k the blocks take (k8 or k16). */
#define DEFINE_DOT_ROWS(ATTR, NAME, WT)                                                         \
    ATTR static inline void NAME(const WT *wr, const float *x, int64_t k, int64_t kt,          \
                                 int64_t m, float *out) {                                      \
        for (int64_t j0 = 0; j0 < m; j0 += ROW_BLOCK) {                                        \
            const float *xb = x + j0 * k;                                                      \
            float *ob = out + j0;                                                              \
            switch (m - j0 < ROW_BLOCK ? m - j0 : ROW_BLOCK) {                                 \
            case 1: NAME##_1(wr, xb, k, kt, ob); break;                                        \
            case 2: NAME##_2(wr, xb, k, kt, ob); break;                                        \
            case 3: NAME##_3(wr, xb, k, kt, ob); break;                                        \
            case 4: NAME##_4(wr, xb, k, kt, ob); break;                                        \
            case 5: NAME##_5(wr, xb, k, kt, ob); break;                                        \
            case 6: NAME##_6(wr, xb, k, kt, ob); break;                                        \
            case 7: NAME##_7(wr, xb, k, kt, ob); break;                                        \
            default: NAME##_8(wr, xb, k, kt, ob); break;                                       \
            }                                                                                  \
        }                                                                                      \
    }

/* accumulators per row by block size: NR x U >= ~8, within AVX2's 16 registers */
#define DEFINE_DOT_BLOCKS(NAME, WT, LOAD_W)                                                     \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, 1, 8)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, 2, 4)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, 3, 3)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, 4, 2)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, 5, 2)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, 6, 2)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, 7, 1)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, 8, 1)                                                   \
    DEFINE_DOT_ROWS(, NAME, WT)

static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
DEFINE_DOT_BLOCKS(dot_f32, float, load_f32)
DEFINE_DOT_BLOCKS(dot_i8, int8_t, load_i8)

/* The int8 blocks again in AVX-512: 16 weights a group, NR x U accumulators of 32 registers. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))
#define DEFINE_DOT512_BLOCK(NR, U)                                                              \
    AVX512 static inline void dot512_i8_##NR(const int8_t *wr, const float *x, int64_t k,      \
                                             int64_t k16, float *out) {                        \
        __m512 acc[NR][U];                                                                     \
        for (int j = 0; j < NR; j++)                                                           \
            for (int u = 0; u < U; u++) acc[j][u] = _mm512_setzero_ps();                        \
        const int64_t ku = k16 - k16 % (16 * U);                                               \
        int64_t i = 0;                                                                         \
        for (; i < ku; i += 16 * U) {                                                          \
            for (int u = 0; u < U; u++) {                                                      \
                const __m512 wv = _mm512_cvtepi32_ps(                                          \
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + i + 16 * u)))); \
                for (int j = 0; j < NR; j++)                                                   \
                    acc[j][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * k + i + 16 * u),   \
                                                acc[j][u]);                                    \
            }                                                                                  \
        }                                                                                      \
        for (; i < k16; i += 16) {                                                             \
            const __m512 wv = _mm512_cvtepi32_ps(                                              \
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + i))));             \
            for (int j = 0; j < NR; j++)                                                       \
                acc[j][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * k + i), acc[j][0]);    \
        }                                                                                      \
        for (int j = 0; j < NR; j++) {                                                         \
            __m512 sum = acc[j][0];                                                            \
            for (int u = 1; u < U; u++) sum = _mm512_add_ps(sum, acc[j][u]);                   \
            float s = _mm512_reduce_add_ps(sum);                                               \
            for (int64_t t = k16; t < k; t++) s += (float)wr[t] * x[j * k + t];                \
            out[j] = s;                                                                        \
        }                                                                                      \
    }
DEFINE_DOT512_BLOCK(1, 8)
DEFINE_DOT512_BLOCK(2, 4)
DEFINE_DOT512_BLOCK(3, 3)
DEFINE_DOT512_BLOCK(4, 2)
DEFINE_DOT512_BLOCK(5, 2)
DEFINE_DOT512_BLOCK(6, 2)
DEFINE_DOT512_BLOCK(7, 2)
DEFINE_DOT512_BLOCK(8, 2)

DEFINE_DOT_ROWS(AVX512, dot512_i8, int8_t)

/* the int8 loop in use: 1 = AVX-512, 0 = AVX2; -1 = not chosen yet (the CPU decides) */
static int i8_isa = -1;

/* Sets the int8 loop: 1 AVX-512, 0 AVX2, -1 the CPU's best. Returns the loop now in use (0 or
 * 1); asking for AVX-512 on a CPU without it gives 0. */
int tokenmill_gemv_i8_isa(int want) {
    __builtin_cpu_init();
    const int has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    i8_isa = want < 0 ? has512 : (want == 1 && has512);
    return i8_isa;
}

/* rows [r0, r1) of an int8 layer: y[j, r] = scale[r] * q[r] . x[j] + bias[r] */
AVX512 static void rows512_i8(const int8_t *q, const float *scale, const float *x,
                              const float *bias, float *y, int64_t n, int64_t k, int64_t m,
                              int64_t r0, int64_t r1) {
    const int64_t k16 = k & ~(int64_t)15;
    float out[GEMV_MAX_ROWS];
    for (int64_t r = r0; r < r1; r++) {
        prefetch_row(q + r * k, k);
        dot512_i8(q + r * k, x, k, k16, m, out);
        const float b = bias ? bias[r] : 0.0f;
        for (int64_t j = 0; j < m; j++) y[j * n + r] = out[j] * scale[r] + b;
    }
}

/* Returns 0, or -1 when m is out of range (nothing written). */
int tokenmill_gemv_f32(const float *w, const float *x, const float *bias, float *y, int64_t n,
                       int64_t k, int64_t m, int nthreads) {
    if (m < 1 || m > GEMV_MAX_ROWS) return -1;
    const int64_t k8 = k & ~(int64_t)7;
    const int64_t items = (n + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < items; c++) {
        const int64_t end = (c + 1) * ROWS_PER_ITEM < n ? (c + 1) * ROWS_PER_ITEM : n;
        float out[GEMV_MAX_ROWS];
        for (int64_t r = c * ROWS_PER_ITEM; r < end; r++) {
            prefetch_row(w + r * k, k * (int64_t)sizeof(float));
            dot_f32(w + r * k, x, k, k8, m, out);
            const float b = bias ? bias[r] : 0.0f;
            for (int64_t j = 0; j < m; j++) y[j * n + r] = out[j] + b;
        }
    }
    return 0;
}

/* Weight-only int8 (symmetric, one scale per output row): y[m, n] = scale[n] * sum_k x[m, k] *
 * q[n, k] (+ bias[n]). A row of q is read once (a quarter of the float32 bytes), widened to
 * float 16 at a time (AVX-512) or 8 (AVX2). Returns 0, or -1 when m is out of range. */
int tokenmill_gemv_i8(const int8_t *q, const float *scale, const float *x, const float *bias,
                      float *y, int64_t n, int64_t k, int64_t m, int nthreads) {
    if (m < 1 || m > GEMV_MAX_ROWS) return -1;
    if (i8_isa < 0) tokenmill_gemv_i8_isa(-1);
    const int wide = i8_isa;
    const int64_t k8 = k & ~(int64_t)7;
    const int64_t items = (n + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < items; c++) {
        const int64_t end = (c + 1) * ROWS_PER_ITEM < n ? (c + 1) * ROWS_PER_ITEM : n;
        if (wide) {
            rows512_i8(q, scale, x, bias, y, n, k, m, c * ROWS_PER_ITEM, end);
            continue;
        }
        float out[GEMV_MAX_ROWS];
        for (int64_t r = c * ROWS_PER_ITEM; r < end; r++) {
            prefetch_row(q + r * k, k);
            dot_i8(q + r * k, x, k, k8, m, out);
            const float b = bias ? bias[r] : 0.0f;
            for (int64_t j = 0; j < m; j++) y[j * n + r] = out[j] * scale[r] + b;
        }
    }
    return 0;
}

/* ---- Weight-only int4 (kernels/cpu.py: gemv_int4, dequantize_int4) ----
 *
 * Asymmetric groups of INT4_GROUP weights along k (engine/quantization.py: quantize_int4):
 * w = q * s + z8, q in [0, 15], z8 = z - 8 s. A row of q is K/2 bytes; in each group's 16
 * bytes, byte i holds q[i] in its low nibble and q[16 + i] in its high one, so one 16-byte load
 * widens to two vectors of 16 consecutive weights with a shift (and a mask). sz: [N, K/G]
 * 32-bit words, one per group: z8's bf16 bits in the high half, s's in the low. */
#define INT4_GROUP 32

static inline float bf16_to_f32(uint16_t v) {
    union {
        uint32_t u;
        float f;
    } c = {.u = (uint32_t)v << 16};
    return c.f;
}

/* A group's (s, z8) pair as one 32-bit word: z8's bf16 bits high, s's low, so a broadcast and
 * one shift or mask give each as float32 in every lane. */
#define SZ_S(v512) _mm512_castsi512_ps(_mm512_slli_epi32(v512, 16))
#define SZ_Z(v512) _mm512_castsi512_ps(_mm512_and_si512(v512, _mm512_set1_epi32(-65536)))

/* AVX-512: a group's 16 dequantized values q * s + z8 (q = 0..15) fill one register, and
 * vpermps looks each weight up by its nibble (it reads only an index's low 4 bits, so the low
 * nibbles need no mask): per 16 weights one lookup instead of a convert and an FMA. */
/* group G of an int4 row into accumulator column U of ACC, for NR rows of x (AVX-512) */
#define DOT512_I4_GROUP(NR, G, ACC, U)                                                          \
    do {                                                                                       \
        const __m512i szv = _mm512_set1_epi32((int)sz[G]);                                     \
        const __m512 table = _mm512_fmadd_ps(iota, SZ_S(szv), SZ_Z(szv));                      \
        const __m512i wi =                                                                     \
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wr + (G) * 16)));          \
        const __m512 lo = _mm512_permutexvar_ps(wi, table);                                    \
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(wi, 4), table);              \
        const float *xg = x + (G) * INT4_GROUP;                                                \
        for (int j = 0; j < NR; j++) {                                                         \
            ACC[j][U] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + j * k), ACC[j][U]);           \
            ACC[j][U] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + j * k + 16), ACC[j][U]);      \
        }                                                                                      \
    } while (0)

#define DEFINE_DOT512_I4_BLOCK(NR, U)                                                           \
    AVX512 static inline void dot512_i4_##NR(const uint8_t *wr, const uint32_t *sz,            \
                                             const float *x, int64_t k, float *out) {          \
        const int64_t groups = k / INT4_GROUP;                                                 \
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,  \
                                           15);                                                \
        __m512 acc[NR][U];                                                                     \
        for (int j = 0; j < NR; j++)                                                           \
            for (int u = 0; u < U; u++) acc[j][u] = _mm512_setzero_ps();                        \
        int64_t g = 0;                                                                         \
        for (; g + U <= groups; g += U)                                                        \
            for (int u = 0; u < U; u++) DOT512_I4_GROUP(NR, g + u, acc, u);                    \
        for (; g < groups; g++) DOT512_I4_GROUP(NR, g, acc, 0);                                \
        for (int j = 0; j < NR; j++) {                                                         \
            __m512 sum = acc[j][0];                                                            \
            for (int u = 1; u < U; u++) sum = _mm512_add_ps(sum, acc[j][u]);                   \
            out[j] = _mm512_reduce_add_ps(sum);                                                \
        }                                                                                      \
    }

/* AVX2: one group = 2 x 8 bytes -> 4 x 8 floats, each q * s + z8 by one FMA. */
/* group G of an int4 row into accumulator column U of ACC, for NR rows of x (AVX2) */
#define DOT256_I4_GROUP(NR, G, ACC, U)                                                          \
    do {                                                                                       \
        const __m256i szv = _mm256_set1_epi32((int)sz[G]);                                     \
        const __m256 sv = _mm256_castsi256_ps(_mm256_slli_epi32(szv, 16));                     \
        const __m256 zv = _mm256_castsi256_ps(_mm256_and_si256(szv, himask));                  \
        const float *xg = x + (G) * INT4_GROUP;                                                \
        __m256 w[4];                                                                           \
        for (int h = 0; h < 2; h++) {                                                          \
            const __m256i wi = _mm256_cvtepu8_epi32(                                           \
                _mm_loadl_epi64((const __m128i *)(wr + (G) * 16 + 8 * h)));                    \
            w[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(wi, nib)), sv, zv);     \
            w[2 + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(wi, 4)), sv, zv);  \
        }                                                                                      \
        for (int j = 0; j < NR; j++)                                                           \
            for (int t = 0; t < 4; t++)                                                        \
                ACC[j][U] = _mm256_fmadd_ps(w[t], _mm256_loadu_ps(xg + j * k + 8 * t),         \
                                            ACC[j][U]);                                        \
    } while (0)

#define DEFINE_DOT256_I4_BLOCK(NR, U)                                                           \
    static inline void dot256_i4_##NR(const uint8_t *wr, const uint32_t *sz, const float *x,    \
                                      int64_t k, float *out) {                                 \
        const int64_t groups = k / INT4_GROUP;                                                 \
        const __m256i nib = _mm256_set1_epi32(15), himask = _mm256_set1_epi32(-65536);          \
        __m256 acc[NR][U];                                                                     \
        for (int j = 0; j < NR; j++)                                                           \
            for (int u = 0; u < U; u++) acc[j][u] = _mm256_setzero_ps();                        \
        int64_t g = 0;                                                                         \
        for (; g + U <= groups; g += U)                                                        \
            for (int u = 0; u < U; u++) DOT256_I4_GROUP(NR, g + u, acc, u);                    \
        for (; g < groups; g++) DOT256_I4_GROUP(NR, g, acc, 0);                                \
        for (int j = 0; j < NR; j++) {                                                         \
            __m256 sum = acc[j][0];                                                            \
            for (int u = 1; u < U; u++) sum = _mm256_add_ps(sum, acc[j][u]);                   \
            out[j] = hsum(sum);                                                                \
        }                                                                                      \
    }

/* scale-FMA chains per row by block size: one row alone waits on its chain, so it takes 4 */
#define DEFINE_DOT_I4_BLOCKS(DEF)                                                               \
    DEF(1, 4) DEF(2, 2) DEF(3, 2) DEF(4, 1) DEF(5, 1) DEF(6, 1) DEF(7, 1) DEF(8, 1)
DEFINE_DOT_I4_BLOCKS(DEFINE_DOT512_I4_BLOCK)
DEFINE_DOT_I4_BLOCKS(DEFINE_DOT256_I4_BLOCK)

/* NAME: all m rows of x against one int4 row (the int4 twin of DEFINE_DOT_ROWS) */
#define DEFINE_DOT_I4_ROWS(ATTR, NAME)                                                          \
    ATTR static inline void NAME(const uint8_t *wr, const uint32_t *s, const float *x,         \
                                 int64_t k, int64_t m, float *out) {                           \
        for (int64_t j0 = 0; j0 < m; j0 += ROW_BLOCK) {                                        \
            const float *xb = x + j0 * k;                                                      \
            float *ob = out + j0;                                                              \
            switch (m - j0 < ROW_BLOCK ? m - j0 : ROW_BLOCK) {                                 \
            case 1: NAME##_1(wr, s, xb, k, ob); break;                                         \
            case 2: NAME##_2(wr, s, xb, k, ob); break;                                         \
            case 3: NAME##_3(wr, s, xb, k, ob); break;                                         \
            case 4: NAME##_4(wr, s, xb, k, ob); break;                                         \
            case 5: NAME##_5(wr, s, xb, k, ob); break;                                         \
            case 6: NAME##_6(wr, s, xb, k, ob); break;                                         \
            case 7: NAME##_7(wr, s, xb, k, ob); break;                                         \
            default: NAME##_8(wr, s, xb, k, ob); break;                                        \
            }                                                                                  \
        }                                                                                      \
    }
DEFINE_DOT_I4_ROWS(AVX512, dot512_i4)
DEFINE_DOT_I4_ROWS(, dot256_i4)

int tokenmill_gemv_int4_group(void) { return INT4_GROUP; }

/* Weight-only int4: q [N, K/2] bytes and sz [N, K/G] words (the layout above), x [M, K]
 * float32, y [M, N] float32 (+ bias [N]); K % INT4_GROUP == 0. Returns 0, or -1 when m or k is
 * out of range (nothing written). */
int tokenmill_gemv_i4(const uint8_t *q, const uint32_t *sz, const float *x, const float *bias,
                      float *y, int64_t n, int64_t k, int64_t m, int nthreads) {
    if (m < 1 || m > GEMV_MAX_ROWS || k < INT4_GROUP || k % INT4_GROUP) return -1;
    if (i8_isa < 0) tokenmill_gemv_i8_isa(-1);
    const int wide = i8_isa;
    const int64_t groups = k / INT4_GROUP;
    const int64_t items = (n + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < items; c++) {
        const int64_t end = (c + 1) * ROWS_PER_ITEM < n ? (c + 1) * ROWS_PER_ITEM : n;
        float out[GEMV_MAX_ROWS];
        for (int64_t r = c * ROWS_PER_ITEM; r < end; r++) {
            const uint8_t *wr = q + r * (k / 2);
            prefetch_row(wr, k / 2);
            if (wide)
                dot512_i4(wr, sz + r * groups, x, k, m, out);
            else
                dot256_i4(wr, sz + r * groups, x, k, m, out);
            const float b = bias ? bias[r] : 0.0f;
            for (int64_t j = 0; j < m; j++) y[j * n + r] = out[j] + b;
        }
    }
    return 0;
}

/* The float32 weight [N, K] an int4 layer computes with, w = q * s + z8 (the dense GEMM path of
 * prefill). Returns 0, or -1 when k is out of range. */
int tokenmill_dequant_i4(const uint8_t *q, const uint32_t *sz, float *w, int64_t n, int64_t k,
                         int nthreads) {
    if (k < INT4_GROUP || k % INT4_GROUP) return -1;
    const int64_t groups = k / INT4_GROUP;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *wr = q + r * (k / 2);
        float *out = w + r * k;
        for (int64_t g = 0; g < groups; g++) {
            const uint32_t v = sz[r * groups + g];
            const float sv = bf16_to_f32((uint16_t)v), zv = bf16_to_f32((uint16_t)(v >> 16));
            for (int i = 0; i < 16; i++) {
                const uint8_t b = wr[g * 16 + i];
                out[g * INT4_GROUP + i] = (float)(b & 15) * sv + zv;
                out[g * INT4_GROUP + 16 + i] = (float)(b >> 4) * sv + zv;
            }
        }
    }
    return 0;
}
