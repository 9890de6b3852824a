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
#include <string.h>

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

/* out[j] = sum_i w(i) * x[j * k + i] for the NR rows of x at x: one function per block size,
 * so the compiler unrolls the loops and keeps the accumulators in registers. An FMA waits ~4
 * cycles for its accumulator and two issue per cycle, so ~8 independent sums keep a core busy:
 * with fewer rows than that, U accumulators per row each take every U-th group of 8 along k
 * (one row alone was bound by that chain, not by memory: int8 ran no faster than float32).
 * LOAD_W(wr, sr, i) turns the 8 weights at wr + i into a __m256 and LOAD_S(wr, sr, t) the one
 * at wr + t into a float (the tail), sr being the row's group scales (int8) or unused (float32);
 * WT is the weight element type. */
#define DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, LOAD_S, NR, U)                                       \
    static inline void NAME##_##NR(const WT *wr, const float *sr, const float *x, int64_t k,   \
                                   int64_t k8, float *out) {                                    \
        __m256 acc[NR][U];                                                                     \
        for (int j = 0; j < NR; j++)                                                           \
            for (int u = 0; u < U; u++) acc[j][u] = _mm256_setzero_ps();                        \
        const int64_t ku = k8 - k8 % (8 * U);                                                  \
        int64_t i = 0;                                                                         \
        for (; i < ku; i += 8 * U) {                                                           \
            for (int u = 0; u < U; u++) {                                                      \
                const __m256 wv = LOAD_W(wr, sr, i + 8 * u);                                   \
                for (int j = 0; j < NR; j++)                                                   \
                    acc[j][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * k + i + 8 * u),    \
                                                acc[j][u]);                                    \
            }                                                                                  \
        }                                                                                      \
        for (; i < k8; i += 8) {                                                               \
            const __m256 wv = LOAD_W(wr, sr, i);                                               \
            for (int j = 0; j < NR; j++)                                                       \
                acc[j][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * k + i), acc[j][0]);    \
        }                                                                                      \
        for (int j = 0; j < NR; j++) {                                                         \
            __m256 sum = acc[j][0];                                                            \
            for (int u = 1; u < U; u++) sum = _mm256_add_ps(sum, acc[j][u]);                   \
            float s = hsum(sum);                                                               \
            for (int64_t t = k8; t < k; t++) s += LOAD_S(wr, sr, t) * x[j * k + t];            \
            out[j] = s;                                                                        \
        }                                                                                      \
    }

/* NAME: all m rows of x against one row of W, ROW_BLOCK rows at a time, through the blocks
 * NAME_1 .. NAME_8; ATTR: the function's target attribute (empty: the build's flags); kt: the
 * end of the vector part of k the blocks take (k8 or k16). */
#define DEFINE_DOT_ROWS(ATTR, NAME, WT)                                                         \
    ATTR static inline void NAME(const WT *wr, const float *sr, const float *x, int64_t k,     \
                                 int64_t kt, int64_t m, float *out) {                          \
        for (int64_t j0 = 0; j0 < m; j0 += ROW_BLOCK) {                                        \
            const float *xb = x + j0 * k;                                                      \
            float *ob = out + j0;                                                              \
            switch (m - j0 < ROW_BLOCK ? m - j0 : ROW_BLOCK) {                                 \
            case 1: NAME##_1(wr, sr, xb, k, kt, ob); break;                                        \
            case 2: NAME##_2(wr, sr, xb, k, kt, ob); break;                                        \
            case 3: NAME##_3(wr, sr, xb, k, kt, ob); break;                                        \
            case 4: NAME##_4(wr, sr, xb, k, kt, ob); break;                                        \
            case 5: NAME##_5(wr, sr, xb, k, kt, ob); break;                                        \
            case 6: NAME##_6(wr, sr, xb, k, kt, ob); break;                                        \
            case 7: NAME##_7(wr, sr, xb, k, kt, ob); break;                                        \
            default: NAME##_8(wr, sr, xb, k, kt, ob); break;                                       \
            }                                                                                  \
        }                                                                                      \
    }

/* accumulators per row by block size: NR x U >= ~8, within AVX2's 16 registers */
#define DEFINE_DOT_BLOCKS(NAME, WT, LOAD_W, LOAD_S)                                             \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, LOAD_S, 1, 8)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, LOAD_S, 2, 4)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, LOAD_S, 3, 3)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, LOAD_S, 4, 2)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, LOAD_S, 5, 2)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, LOAD_S, 6, 2)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, LOAD_S, 7, 1)                                                   \
    DEFINE_DOT_BLOCK(NAME, WT, LOAD_W, LOAD_S, 8, 1)                                                   \
    DEFINE_DOT_ROWS(, NAME, WT)

/* int8 weights share one float32 scale per INT8_GROUP along k (engine/quantization.py:
 * quantize_int8), as llama.cpp's Q8_0 blocks of 32 do: a weight widens to q * s before its
 * FMAs, one multiply per vector for all NR rows of x. One scale per output row kept float32's
 * greedy tokens on 3 of 5 prompts of benchmarks/quantization_accuracy.py, groups of 32 on 4. */
#define INT8_GROUP 32
int tokenmill_gemv_int8_group(void) { return INT8_GROUP; }

static inline __m256 load_f32(const float *w, const float *sr, int64_t i) {
    (void)sr;
    return _mm256_loadu_ps(w + i);
}
static inline float load_s_f32(const float *w, const float *sr, int64_t t) {
    (void)sr;
    return w[t];
}
static inline __m256 load_i8(const int8_t *w, const float *sr, int64_t i) {
    const __m256 q =
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i))));
    return _mm256_mul_ps(q, _mm256_broadcast_ss(sr + i / INT8_GROUP));
}
static inline float load_s_i8(const int8_t *w, const float *sr, int64_t t) {
    return (float)w[t] * sr[t / INT8_GROUP];
}
DEFINE_DOT_BLOCKS(dot_f32, float, load_f32, load_s_f32)
DEFINE_DOT_BLOCKS(dot_i8, int8_t, load_i8, load_s_i8)

/* The int8 blocks again in AVX-512: 16 weights a vector, NR x U accumulators of 32 registers. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))
#define DEFINE_DOT512_BLOCK(NR, U)                                                              \
    AVX512 static inline void dot512_i8_##NR(const int8_t *wr, const float *sr, const float *x, \
                                             int64_t k, int64_t k16, float *out) {             \
        __m512 acc[NR][U];                                                                     \
        for (int j = 0; j < NR; j++)                                                           \
            for (int u = 0; u < U; u++) acc[j][u] = _mm512_setzero_ps();                        \
        const int64_t ku = k16 - k16 % (16 * U);                                               \
        int64_t i = 0;                                                                         \
        for (; i < ku; i += 16 * U) {                                                          \
            for (int u = 0; u < U; u++) {                                                      \
                const __m512 wv = _mm512_mul_ps(                                               \
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                   \
                        _mm_loadu_si128((const __m128i *)(wr + i + 16 * u)))),                 \
                    _mm512_set1_ps(sr[(i + 16 * u) / INT8_GROUP]));                            \
                for (int j = 0; j < NR; j++)                                                   \
                    acc[j][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * k + i + 16 * u),   \
                                                acc[j][u]);                                    \
            }                                                                                  \
        }                                                                                      \
        for (; i < k16; i += 16) {                                                             \
            const __m512 wv = _mm512_mul_ps(                                                   \
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + i)))), \
                _mm512_set1_ps(sr[i / INT8_GROUP]));                                           \
            for (int j = 0; j < NR; j++)                                                       \
                acc[j][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * k + i), acc[j][0]);    \
        }                                                                                      \
        for (int j = 0; j < NR; j++) {                                                         \
            __m512 sum = acc[j][0];                                                            \
            for (int u = 1; u < U; u++) sum = _mm512_add_ps(sum, acc[j][u]);                   \
            float s = _mm512_reduce_add_ps(sum);                                               \
            for (int64_t t = k16; t < k; t++) s += load_s_i8(wr, sr, t) * x[j * k + t];        \
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

/* Two rows of W against NR rows of x, 16 weights a step: each x vector loaded feeds two FMAs.
 * With many rows of x the one-row blocks above are bound by an x load per FMA, not by memory:
 * one pass over SmolLM2-135M's int8 layers at 32 rows took 87.5 ms against 67.4 for torch's
 * float32 GEMM of the same shapes (oneDNN tiles both ways). In pairs (2026-12-02, same VM,
 * best of 4): 8 rows 20.1 -> 12.3 ms, 16 rows 37.9 -> 21.5, 32 rows 87.5 -> 46.2 (float32
 * 59.5); at 48 and 64 rows still above float32 (96 vs 77, 125 vs 90 ms). */
#define DEFINE_DOT512_PAIR(NR)                                                                  \
    AVX512 static inline void pair512_i8_##NR(const int8_t *w0, const int8_t *w1,              \
                                              const float *s0, const float *s1,                \
                                              const float *x, int64_t k, float *out0,          \
                                              float *out1) {                                   \
        __m512 a0[NR], a1[NR];                                                                 \
        for (int j = 0; j < NR; j++) a0[j] = a1[j] = _mm512_setzero_ps();                      \
        for (int64_t i = 0; i < k; i += 16) {                                                  \
            const __m512 v0 = _mm512_mul_ps(                                                   \
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w0 + i)))), \
                _mm512_set1_ps(s0[i / INT8_GROUP]));                                           \
            const __m512 v1 = _mm512_mul_ps(                                                   \
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w1 + i)))), \
                _mm512_set1_ps(s1[i / INT8_GROUP]));                                           \
            for (int j = 0; j < NR; j++) {                                                     \
                const __m512 xv = _mm512_loadu_ps(x + j * k + i);                              \
                a0[j] = _mm512_fmadd_ps(v0, xv, a0[j]);                                        \
                a1[j] = _mm512_fmadd_ps(v1, xv, a1[j]);                                        \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < NR; j++) {                                                         \
            out0[j] = _mm512_reduce_add_ps(a0[j]);                                             \
            out1[j] = _mm512_reduce_add_ps(a1[j]);                                             \
        }                                                                                      \
    }
DEFINE_DOT512_PAIR(4)
DEFINE_DOT512_PAIR(5)
DEFINE_DOT512_PAIR(6)
DEFINE_DOT512_PAIR(7)
DEFINE_DOT512_PAIR(8)

/* rows of x from which a pair of W rows runs together: below it the pair has too few
 * accumulators to hide the FMA latency, and one row is bound by memory anyway */
#define PAIR_MIN_ROWS 4

/* rows r and r + 1 of W against all m >= PAIR_MIN_ROWS rows of x, 8 at a time; a remainder
 * under PAIR_MIN_ROWS rows runs each W row alone */
AVX512 static void pair512_i8(const int8_t *w0, const int8_t *w1, const float *s0,
                              const float *s1, const float *x, int64_t k, int64_t m, float *out0,
                              float *out1) {
    for (int64_t j0 = 0; j0 < m; j0 += ROW_BLOCK) {
        const float *xb = x + j0 * k;
        const int64_t nr = m - j0 < ROW_BLOCK ? m - j0 : ROW_BLOCK;
        switch (nr) {
        case 4: pair512_i8_4(w0, w1, s0, s1, xb, k, out0 + j0, out1 + j0); break;
        case 5: pair512_i8_5(w0, w1, s0, s1, xb, k, out0 + j0, out1 + j0); break;
        case 6: pair512_i8_6(w0, w1, s0, s1, xb, k, out0 + j0, out1 + j0); break;
        case 7: pair512_i8_7(w0, w1, s0, s1, xb, k, out0 + j0, out1 + j0); break;
        case 8: pair512_i8_8(w0, w1, s0, s1, xb, k, out0 + j0, out1 + j0); break;
        default:
            dot512_i8(w0, s0, xb, k, k, nr, out0 + j0);
            dot512_i8(w1, s1, xb, k, k, nr, out1 + j0);
        }
    }
}

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

/* rows [r0, r1) of an int8 layer: y[j, r] = (q[r] * scale[r]) . x[j] + bias[r] */
AVX512 static void rows512_i8(const int8_t *q, const float *scale, const float *x,
                              const float *bias, float *y, int64_t n, int64_t k, int64_t m,
                              int64_t r0, int64_t r1) {
    const int64_t k16 = k & ~(int64_t)15;
    const int64_t g = k / INT8_GROUP;
    float out[GEMV_MAX_ROWS], out1[GEMV_MAX_ROWS];
    int64_t r = r0;
    if (m >= PAIR_MIN_ROWS)
        for (; r + 1 < r1; r += 2) {
            prefetch_row(q + r * k, 2 * k);
            pair512_i8(q + r * k, q + (r + 1) * k, scale + r * g, scale + (r + 1) * g, x, k, m,
                       out, out1);
            const float b0 = bias ? bias[r] : 0.0f, b1 = bias ? bias[r + 1] : 0.0f;
            for (int64_t j = 0; j < m; j++) {
                y[j * n + r] = out[j] + b0;
                y[j * n + r + 1] = out1[j] + b1;
            }
        }
    for (; r < r1; r++) {
        prefetch_row(q + r * k, k);
        dot512_i8(q + r * k, scale + r * (k / INT8_GROUP), x, k, k16, m, out);
        const float b = bias ? bias[r] : 0.0f;
        for (int64_t j = 0; j < m; j++) y[j * n + r] = out[j] + b;
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
            dot_f32(w + r * k, NULL, x, k, k8, m, out);
            const float b = bias ? bias[r] : 0.0f;
            for (int64_t j = 0; j < m; j++) y[j * n + r] = out[j] + b;
        }
    }
    return 0;
}

/* Weight-only int8 (symmetric, one scale per INT8_GROUP weights along k): y[m, n] = sum_k
 * x[m, k] * q[n, k] * scale[n, k / INT8_GROUP] (+ bias[n]), scale [N, K / INT8_GROUP]. A row of
 * q is read once (a quarter of the float32 bytes, plus an eighth for the scales), widened to
 * float 16 at a time (AVX-512) or 8 (AVX2). Returns 0, or -1 when m or k is out of range. */
int tokenmill_gemv_i8(const int8_t *q, const float *scale, const float *x, const float *bias,
                      float *y, int64_t n, int64_t k, int64_t m, int nthreads) {
    if (m < 1 || m > GEMV_MAX_ROWS || k < INT8_GROUP || k % INT8_GROUP) return -1;
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
            dot_i8(q + r * k, scale + r * (k / INT8_GROUP), x, k, k8, m, out);
            const float b = bias ? bias[r] : 0.0f;
            for (int64_t j = 0; j < m; j++) y[j * n + r] = out[j] + b;
        }
    }
    return 0;
}

/* ---- Weight-only int4 (kernels/cpu.py: gemv_int4, dequantize_int4, pack_int4) ----
 *
 * Asymmetric groups of INT4_GROUP weights along k (engine/quantization.py: quantize_int4):
 * w = q * s + z8, q in [0, 15], z8 = z - 8 s. The layout runs across output rows: rows go in
 * blocks of NB = 16, and for each block and group 16 "pair" lines of 16 bytes follow, line p's
 * byte i holding q[16 b + i, 32 g + p] in its low nibble and q[16 b + i, 32 g + 16 + p] in its
 * high one. One 16-byte load widens to the 16 rows' weights at two k, which multiply a
 * broadcast x[k] into accumulators that are the 16 outputs themselves: no per-row horizontal
 * sum, and the group's scale multiplies once per 512 weights. A row-major layout (a row's 16
 * bytes a group, a lookup table per group) ran one pass over SmolLM2-135M's int4 layers in
 * 8.4 ms against 6.4 for this one (32 rows: 100 against 62), and 4.2 ms loads the same bytes.
 * AVX-512 turns a code into its float with vpermps over 0..15 (it reads an index's low 4 bits,
 * so the low nibble needs no mask): one instruction for the mask and the convert, ~5% a pass.
 * sz: [N/NB, K/G, NB] 32-bit words, z8's bf16 bits in the high half, s's in the low. */
#define INT4_GROUP 32
#define NB 16

static inline float bf16_to_f32(uint16_t v) {
    union {
        uint32_t u;
        float f;
    } c = {.u = (uint32_t)v << 16};
    return c.f;
}

/* rows of x per register block: per row two accumulators and a total (AVX-512: 32 registers) */
#define I4_ROW_BLOCK 8

/* AVX-512: one block of 16 output rows for NR rows of x. wb: the block's K/2 * 16 bytes; szb: its
 * K/G * 16 words; xsum: [NR][groups] sums of x over each group; out: NR x 16 floats. */
#define DEFINE_I4_512_BLOCK(NR)                                                                 \
    AVX512 static inline void i4_512_##NR(const uint8_t *wb, const uint32_t *szb,              \
                                          const float *x, const float *xsum, int64_t k,        \
                                          int64_t groups, __m512 *out) {                       \
        const __m512i hi16 = _mm512_set1_epi32(-65536);                                         \
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); \
        __m512 tot[NR];                                                                        \
        for (int j = 0; j < NR; j++) tot[j] = _mm512_setzero_ps();                             \
        for (int64_t g = 0; g < groups; g++) {                                                 \
            const uint8_t *wg = wb + g * NB * 16;                                              \
            prefetch_row(wg, NB * 16);                                                         \
            __m512 a[NR], c[NR];                                                               \
            for (int j = 0; j < NR; j++) a[j] = c[j] = _mm512_setzero_ps();                    \
            for (int p = 0; p < 16; p++) {                                                     \
                const __m512i wi =                                                             \
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wg + p * 16)));    \
                const __m512 lo = _mm512_permutexvar_ps(wi, iota);                             \
                const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(wi, 4), iota);       \
                const float *xk = x + g * INT4_GROUP + p;                                      \
                for (int j = 0; j < NR; j++) {                                                 \
                    a[j] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xk[j * k]), a[j]);               \
                    c[j] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xk[j * k + 16]), c[j]);          \
                }                                                                              \
            }                                                                                  \
            const __m512i szv = _mm512_loadu_si512(szb + g * NB);                              \
            const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(szv, 16));                 \
            const __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(szv, hi16));                \
            for (int j = 0; j < NR; j++) {                                                     \
                tot[j] = _mm512_fmadd_ps(_mm512_add_ps(a[j], c[j]), sv, tot[j]);               \
                tot[j] = _mm512_fmadd_ps(zv, _mm512_set1_ps(xsum[j * groups + g]), tot[j]);    \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < NR; j++) out[j] = tot[j];                                          \
    }

/* AVX2: the same block as two halves of 8 rows (16 registers hold fewer rows of x). */
#define I4_256_ROW_BLOCK 4
#define DEFINE_I4_256_BLOCK(NR)                                                                 \
    static inline void i4_256_##NR(const uint8_t *wb, const uint32_t *szb, const float *x,      \
                                   const float *xsum, int64_t k, int64_t groups, float *out) { \
        const __m256i nib = _mm256_set1_epi32(15), hi16 = _mm256_set1_epi32(-65536);            \
        for (int h = 0; h < 2; h++) {                                                          \
            __m256 tot[NR];                                                                    \
            for (int j = 0; j < NR; j++) tot[j] = _mm256_setzero_ps();                         \
            for (int64_t g = 0; g < groups; g++) {                                             \
                const uint8_t *wg = wb + g * NB * 16 + 8 * h;                                  \
                if (h == 0) prefetch_row(wg, NB * 16);                                         \
                __m256 a[NR], c[NR];                                                           \
                for (int j = 0; j < NR; j++) a[j] = c[j] = _mm256_setzero_ps();                \
                for (int p = 0; p < 16; p++) {                                                 \
                    const __m256i wi =                                                         \
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wg + p * 16))); \
                    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(wi, nib));           \
                    const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(wi, 4));            \
                    const float *xk = x + g * INT4_GROUP + p;                                  \
                    for (int j = 0; j < NR; j++) {                                             \
                        a[j] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xk + j * k), a[j]);     \
                        c[j] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(xk + j * k + 16), c[j]); \
                    }                                                                          \
                }                                                                              \
                const __m256i szv = _mm256_loadu_si256((const __m256i *)(szb + g * NB + 8 * h)); \
                const __m256 sv = _mm256_castsi256_ps(_mm256_slli_epi32(szv, 16));             \
                const __m256 zv = _mm256_castsi256_ps(_mm256_and_si256(szv, hi16));            \
                for (int j = 0; j < NR; j++) {                                                 \
                    tot[j] = _mm256_fmadd_ps(_mm256_add_ps(a[j], c[j]), sv, tot[j]);           \
                    tot[j] = _mm256_fmadd_ps(zv, _mm256_broadcast_ss(xsum + j * groups + g),   \
                                             tot[j]);                                          \
                }                                                                              \
            }                                                                                  \
            for (int j = 0; j < NR; j++) _mm256_storeu_ps(out + j * NB + 8 * h, tot[j]);       \
        }                                                                                      \
    }

DEFINE_I4_512_BLOCK(1)
DEFINE_I4_512_BLOCK(2)
DEFINE_I4_512_BLOCK(3)
DEFINE_I4_512_BLOCK(4)
DEFINE_I4_512_BLOCK(5)
DEFINE_I4_512_BLOCK(6)
DEFINE_I4_512_BLOCK(7)
DEFINE_I4_512_BLOCK(8)
DEFINE_I4_256_BLOCK(1)
DEFINE_I4_256_BLOCK(2)
DEFINE_I4_256_BLOCK(3)
DEFINE_I4_256_BLOCK(4)

/* one block of 16 output rows for all m rows of x, I4_ROW_BLOCK rows at a time: out [m, 16] */
AVX512 static void i4_512_rows(const uint8_t *wb, const uint32_t *szb, const float *x,
                               const float *xsum, int64_t k, int64_t groups, int64_t m,
                               float *out) {
    for (int64_t j0 = 0; j0 < m; j0 += I4_ROW_BLOCK) {
        const int64_t nr = m - j0 < I4_ROW_BLOCK ? m - j0 : I4_ROW_BLOCK;
        const float *xb = x + j0 * k, *sb = xsum + j0 * groups;
        __m512 o[I4_ROW_BLOCK];
        switch (nr) {
        case 1: i4_512_1(wb, szb, xb, sb, k, groups, o); break;
        case 2: i4_512_2(wb, szb, xb, sb, k, groups, o); break;
        case 3: i4_512_3(wb, szb, xb, sb, k, groups, o); break;
        case 4: i4_512_4(wb, szb, xb, sb, k, groups, o); break;
        case 5: i4_512_5(wb, szb, xb, sb, k, groups, o); break;
        case 6: i4_512_6(wb, szb, xb, sb, k, groups, o); break;
        case 7: i4_512_7(wb, szb, xb, sb, k, groups, o); break;
        default: i4_512_8(wb, szb, xb, sb, k, groups, o); break;
        }
        for (int64_t j = 0; j < nr; j++) _mm512_storeu_ps(out + (j0 + j) * NB, o[j]);
    }
}

static void i4_256_rows(const uint8_t *wb, const uint32_t *szb, const float *x,
                        const float *xsum, int64_t k, int64_t groups, int64_t m, float *out) {
    for (int64_t j0 = 0; j0 < m; j0 += I4_256_ROW_BLOCK) {
        const int64_t nr = m - j0 < I4_256_ROW_BLOCK ? m - j0 : I4_256_ROW_BLOCK;
        const float *xb = x + j0 * k, *sb = xsum + j0 * groups;
        float *ob = out + j0 * NB;
        switch (nr) {
        case 1: i4_256_1(wb, szb, xb, sb, k, groups, ob); break;
        case 2: i4_256_2(wb, szb, xb, sb, k, groups, ob); break;
        case 3: i4_256_3(wb, szb, xb, sb, k, groups, ob); break;
        default: i4_256_4(wb, szb, xb, sb, k, groups, ob); break;
        }
    }
}

/* ---- int4 weights x int8 activations (AVX-512 VNNI + VBMI) ----
 *
 * Each row of x is quantized per group of INT4_GROUP to int8 (symmetric: dx = max|x| / 127,
 * xq = round-to-even(x * 127 / max|x|), llama.cpp's Q8_0 grouping), so a group's dot product
 * with a row's codes is exact in int32 (vpdpbusd: unsigned codes x signed activations, four
 * products a lane). The layout is the one above: one vpermb turns four pair lines (16 rows at
 * four k) into 16 lanes of one row's four k, one mask and one shift-and-mask give the low and
 * high nibbles, two vpdpbusd take them; per 128 weights that is 5 vector uops against the float
 * loop's 24, so the pass is bound by reading the weights, not by widening them. Then per group
 * y += s * dx * (q . xq) + z8 * sum(x): the zero term uses the exact float sum of x. */
#define I4_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma")))

/* vpermb indices: out byte 4 i + j (row i, k offset j) <- in byte 16 j + i (pair line j) */
static uint8_t i4_lane_perm[64];

#define DEFINE_I4_VNNI_BLOCK(NR)                                                                \
    I4_VNNI static inline void i4v_##NR(const uint8_t *wb, const uint32_t *szb,                 \
                                        const int8_t *xq, const float *dx, const float *xsum,   \
                                        int64_t k, int64_t groups, __m512 *out) {               \
        const __m512i perm = _mm512_loadu_si512(i4_lane_perm);                                  \
        const __m512i m4 = _mm512_set1_epi8(15), hi16 = _mm512_set1_epi32(-65536);              \
        __m512 tot[NR];                                                                        \
        for (int j = 0; j < NR; j++) tot[j] = _mm512_setzero_ps();                             \
        for (int64_t g = 0; g < groups; g++) {                                                 \
            const uint8_t *wg = wb + g * NB * 16;                                              \
            prefetch_row(wg, NB * 16);                                                         \
            __m512i acc[NR];                                                                   \
            for (int j = 0; j < NR; j++) acc[j] = _mm512_setzero_si512();                      \
            for (int p = 0; p < 16; p += 4) {                                                  \
                const __m512i w =                                                              \
                    _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(wg + p * 16));            \
                const __m512i lo = _mm512_and_si512(w, m4);                                    \
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);              \
                for (int j = 0; j < NR; j++) {                                                 \
                    int32_t a, c;                                                              \
                    memcpy(&a, xq + j * k + g * INT4_GROUP + p, 4);                            \
                    memcpy(&c, xq + j * k + g * INT4_GROUP + 16 + p, 4);                       \
                    acc[j] = _mm512_dpbusd_epi32(acc[j], lo, _mm512_set1_epi32(a));            \
                    acc[j] = _mm512_dpbusd_epi32(acc[j], hi, _mm512_set1_epi32(c));            \
                }                                                                              \
            }                                                                                  \
            const __m512i szv = _mm512_loadu_si512(szb + g * NB);                              \
            const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(szv, 16));                 \
            const __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(szv, hi16));                \
            for (int j = 0; j < NR; j++) {                                                     \
                const __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[j]), sv);                \
                tot[j] = _mm512_fmadd_ps(d, _mm512_set1_ps(dx[j * groups + g]), tot[j]);       \
                tot[j] = _mm512_fmadd_ps(zv, _mm512_set1_ps(xsum[j * groups + g]), tot[j]);    \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < NR; j++) out[j] = tot[j];                                          \
    }

DEFINE_I4_VNNI_BLOCK(1)
DEFINE_I4_VNNI_BLOCK(2)
DEFINE_I4_VNNI_BLOCK(3)
DEFINE_I4_VNNI_BLOCK(4)
DEFINE_I4_VNNI_BLOCK(5)
DEFINE_I4_VNNI_BLOCK(6)
DEFINE_I4_VNNI_BLOCK(7)
DEFINE_I4_VNNI_BLOCK(8)

I4_VNNI static void i4v_rows(const uint8_t *wb, const uint32_t *szb, const int8_t *xq,
                             const float *dx, const float *xsum, int64_t k, int64_t groups,
                             int64_t m, float *out) {
    for (int64_t j0 = 0; j0 < m; j0 += I4_ROW_BLOCK) {
        const int64_t nr = m - j0 < I4_ROW_BLOCK ? m - j0 : I4_ROW_BLOCK;
        const int8_t *xb = xq + j0 * k;
        const float *db = dx + j0 * groups, *sb = xsum + j0 * groups;
        __m512 o[I4_ROW_BLOCK];
        switch (nr) {
        case 1: i4v_1(wb, szb, xb, db, sb, k, groups, o); break;
        case 2: i4v_2(wb, szb, xb, db, sb, k, groups, o); break;
        case 3: i4v_3(wb, szb, xb, db, sb, k, groups, o); break;
        case 4: i4v_4(wb, szb, xb, db, sb, k, groups, o); break;
        case 5: i4v_5(wb, szb, xb, db, sb, k, groups, o); break;
        case 6: i4v_6(wb, szb, xb, db, sb, k, groups, o); break;
        case 7: i4v_7(wb, szb, xb, db, sb, k, groups, o); break;
        default: i4v_8(wb, szb, xb, db, sb, k, groups, o); break;
        }
        for (int64_t j = 0; j < nr; j++) _mm512_storeu_ps(out + (j0 + j) * NB, o[j]);
    }
}

/* x [m, k] -> xq [m, k] int8 and dx [m, groups]: per group of INT4_GROUP, dx = max|x| / 127
 * and xq = round-to-even(x * (127 / max|x|)) in float32 (kernels/cpu.py's reference does the
 * same arithmetic); an all-zero group gives dx = 0 and zero codes. */
void tokenmill_quantize_act_i8(const float *x, int8_t *xq, float *dx, int64_t m, int64_t k) {
    const int64_t groups = k / INT4_GROUP;
    for (int64_t j = 0; j < m; j++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + j * k + g * INT4_GROUP;
            int8_t *qg = xq + j * k + g * INT4_GROUP;
            float amax = 0.0f;
            for (int t = 0; t < INT4_GROUP; t++) {
                const float a = xg[t] < 0.0f ? -xg[t] : xg[t];
                amax = a > amax ? a : amax;
            }
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            dx[j * groups + g] = amax / 127.0f;
            for (int t = 0; t < INT4_GROUP; t++)  /* cvtss2si: the MXCSR's round-to-even */
                qg[t] = (int8_t)_mm_cvtss_si32(_mm_set_ss(xg[t] * inv));
        }
}

/* int4's activations: 1 = int8 (the VNNI loop), 0 = float32; -1 = not chosen yet */
static int i4_act = -1;

/* Sets int4's activations: 1 int8 (where the CPU has AVX-512 VNNI and VBMI), 0 float32, -1 the
 * CPU's best. Returns the mode now in use. */
int tokenmill_gemv_i4_act(int want) {
    __builtin_cpu_init();
    const int vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 4; j++) i4_lane_perm[4 * i + j] = (uint8_t)(16 * j + i);
    i4_act = want < 0 ? vnni : (want == 1 && vnni);
    return i4_act;
}

int tokenmill_gemv_int4_group(void) { return INT4_GROUP; }
int tokenmill_gemv_int4_rows(void) { return NB; }

/* Weight-only int4: q [N/16, K/G, 16, 16] bytes and sz [N/16, K/G, 16] words (the layout
 * above), x [M, K] float32, y [M, N] float32 (+ bias [N]). N % 16 == 0, K % INT4_GROUP == 0.
 * Returns 0, -1 when m, n or k is out of range, -2 when out of memory (nothing written). */
int tokenmill_gemv_i4(const uint8_t *q, const uint32_t *sz, const float *x, const float *bias,
                      float *y, int64_t n, int64_t k, int64_t m, int nthreads) {
    if (m < 1 || m > GEMV_MAX_ROWS || n % NB || k < INT4_GROUP || k % INT4_GROUP) return -1;
    if (i8_isa < 0) tokenmill_gemv_i8_isa(-1);
    if (i4_act < 0) tokenmill_gemv_i4_act(-1);
    const int wide = i8_isa, act8 = i4_act;
    const int64_t groups = k / INT4_GROUP, blocks = n / NB;
    float *xsum = malloc(sizeof(float) * m * groups * 2);
    int8_t *xq = act8 ? malloc((size_t)(m * k)) : NULL;
    if (!xsum || (act8 && !xq)) {
        free(xsum);
        free(xq);
        return -2;
    }
    float *dx = xsum + m * groups;
    for (int64_t j = 0; j < m; j++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int t = 0; t < INT4_GROUP; t++) s += x[j * k + g * INT4_GROUP + t];
            xsum[j * groups + g] = s;
        }
    if (act8) tokenmill_quantize_act_i8(x, xq, dx, m, k);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float out[GEMV_MAX_ROWS * NB];
        const uint8_t *wb = q + b * groups * NB * 16;
        const uint32_t *szb = sz + b * groups * NB;
        if (act8)
            i4v_rows(wb, szb, xq, dx, xsum, k, groups, m, out);
        else if (wide)
            i4_512_rows(wb, szb, x, xsum, k, groups, m, out);
        else
            i4_256_rows(wb, szb, x, xsum, k, groups, m, out);
        for (int64_t j = 0; j < m; j++)
            for (int i = 0; i < NB; i++)
                y[j * n + b * NB + i] = out[j * NB + i] + (bias ? bias[b * NB + i] : 0.0f);
    }
    free(xsum);
    free(xq);
    return 0;
}

/* The float32 weight [N, K] an int4 layer computes with, w = q * s + z8 (the dense GEMM path of
 * prefill). Returns 0, or -1 when n or k is out of range. */
int tokenmill_dequant_i4(const uint8_t *q, const uint32_t *sz, float *w, int64_t n, int64_t k,
                         int nthreads) {
    if (n % NB || k < INT4_GROUP || k % INT4_GROUP) return -1;
    const int64_t groups = k / INT4_GROUP;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < n / NB; b++)
        for (int64_t g = 0; g < groups; g++)
            for (int i = 0; i < NB; i++) {
                const uint32_t v = sz[(b * groups + g) * NB + i];
                const float sv = bf16_to_f32((uint16_t)v), zv = bf16_to_f32((uint16_t)(v >> 16));
                float *row = w + (b * NB + i) * k + g * INT4_GROUP;
                for (int p = 0; p < 16; p++) {
                    const uint8_t byte = q[((b * groups + g) * 16 + p) * NB + i];
                    row[p] = (float)(byte & 15) * sv + zv;
                    row[16 + p] = (float)(byte >> 4) * sv + zv;
                }
            }
    return 0;
}
