/* Small-row float32 matrix-vector products for CPU decode steps (kernels/cpu_gemv.py).
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for M <= GEMV_MAX_ROWS rows, W row-major
 * [N, K]. A decode step streams every weight once: this loop reads each row of W once for all
 * M rows of x (x stays in L1/L2), 8 floats at a time with AVX2 FMA, and splits the rows of W
 * across OpenMP threads (the same libgomp runtime torch uses, so one thread pool).
 *
 * Built at run time with -O3 -mavx2 -mfma -fopenmp; the Python side checks the CPU first.
 */
#include <immintrin.h>
#include <stdint.h>

/* rows of x per register block: 8 accumulators + a weight vector + an x load fit AVX2's 16 ymm
 * registers. More rows than that run in blocks over the same row of W, which stays in L1, so
 * DRAM still sees each weight once per call. */
#define ROW_BLOCK 8
#define GEMV_MAX_ROWS 64
/* rows of W per OpenMP chunk: 64 rows x K=576 floats = 147 KB, enough work per chunk to
 * amortise the scheduling and few enough that both threads finish together */
#define ROWS_PER_CHUNK 64

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
    /* all m rows of x against one row of W, ROW_BLOCK rows at a time */                        \
    static inline void NAME(const WT *wr, const float *x, int64_t k, int64_t k8, int64_t m,     \
                            float *out) {                                                      \
        for (int64_t j0 = 0; j0 < m; j0 += ROW_BLOCK) {                                        \
            const float *xb = x + j0 * k;                                                      \
            float *ob = out + j0;                                                              \
            switch (m - j0 < ROW_BLOCK ? m - j0 : ROW_BLOCK) {                                 \
            case 1: NAME##_1(wr, xb, k, k8, ob); break;                                        \
            case 2: NAME##_2(wr, xb, k, k8, ob); break;                                        \
            case 3: NAME##_3(wr, xb, k, k8, ob); break;                                        \
            case 4: NAME##_4(wr, xb, k, k8, ob); break;                                        \
            case 5: NAME##_5(wr, xb, k, k8, ob); break;                                        \
            case 6: NAME##_6(wr, xb, k, k8, ob); break;                                        \
            case 7: NAME##_7(wr, xb, k, k8, ob); break;                                        \
            default: NAME##_8(wr, xb, k, k8, ob); break;                                       \
            }                                                                                  \
        }                                                                                      \
    }

static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
DEFINE_DOT_BLOCKS(dot_f32, float, load_f32)
DEFINE_DOT_BLOCKS(dot_i8, int8_t, load_i8)

/* Returns 0, or -1 when m is out of range (nothing written). */
int tokenmill_gemv_f32(const float *w, const float *x, const float *bias, float *y, int64_t n,
                       int64_t k, int64_t m, int nthreads) {
    if (m < 1 || m > GEMV_MAX_ROWS) return -1;
    const int64_t k8 = k & ~(int64_t)7;
    const int64_t chunks = (n + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * ROWS_PER_CHUNK < n ? (c + 1) * ROWS_PER_CHUNK : n;
        float out[GEMV_MAX_ROWS];
        for (int64_t r = c * ROWS_PER_CHUNK; r < end; r++) {
            dot_f32(w + r * k, x, k, k8, m, out);
            const float b = bias ? bias[r] : 0.0f;
            for (int64_t j = 0; j < m; j++) y[j * n + r] = out[j] + b;
        }
    }
    return 0;
}

/* Weight-only int8 (symmetric, one scale per output row): y[m, n] = scale[n] * sum_k x[m, k] *
 * q[n, k] (+ bias[n]). A row of q is read once (a quarter of the float32 bytes), widened to
 * float 8 at a time. Returns 0, or -1 when m is out of range. */
int tokenmill_gemv_i8(const int8_t *q, const float *scale, const float *x, const float *bias,
                      float *y, int64_t n, int64_t k, int64_t m, int nthreads) {
    if (m < 1 || m > GEMV_MAX_ROWS) return -1;
    const int64_t k8 = k & ~(int64_t)7;
    const int64_t chunks = (n + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * ROWS_PER_CHUNK < n ? (c + 1) * ROWS_PER_CHUNK : n;
        float out[GEMV_MAX_ROWS];
        for (int64_t r = c * ROWS_PER_CHUNK; r < end; r++) {
            dot_i8(q + r * k, x, k, k8, m, out);
            const float b = bias ? bias[r] : 0.0f;
            for (int64_t j = 0; j < m; j++) y[j * n + r] = out[j] * scale[r] + b;
        }
    }
    return 0;
}
