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

#define GEMV_MAX_ROWS 4
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

/* Returns 0, or -1 when m is out of range (nothing written). */
int tokenmill_gemv_f32(const float *w, const float *x, const float *bias, float *y, int64_t n,
                       int64_t k, int64_t m, int nthreads) {
    if (m < 1 || m > GEMV_MAX_ROWS) return -1;
    const int64_t k8 = k & ~(int64_t)7;
    const int64_t chunks = (n + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * ROWS_PER_CHUNK < n ? (c + 1) * ROWS_PER_CHUNK : n;
        for (int64_t r = c * ROWS_PER_CHUNK; r < end; r++) {
            const float *wr = w + r * k;
            __m256 acc[GEMV_MAX_ROWS];
            for (int64_t j = 0; j < m; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < k8; i += 8) {
                const __m256 wv = _mm256_loadu_ps(wr + i);
                for (int64_t j = 0; j < m; j++)
                    acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * k + i), acc[j]);
            }
            for (int64_t j = 0; j < m; j++) {
                float s = hsum(acc[j]);
                for (int64_t i = k8; i < k; i++) s += wr[i] * x[j * k + i];
                y[j * n + r] = bias ? s + bias[r] : s;
            }
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
        for (int64_t r = c * ROWS_PER_CHUNK; r < end; r++) {
            const int8_t *qr = q + r * k;
            __m256 acc[GEMV_MAX_ROWS];
            for (int64_t j = 0; j < m; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < k8; i += 8) {
                const __m128i b = _mm_loadl_epi64((const __m128i *)(qr + i));
                const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                for (int64_t j = 0; j < m; j++)
                    acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * k + i), acc[j]);
            }
            for (int64_t j = 0; j < m; j++) {
                float s = hsum(acc[j]);
                for (int64_t i = k8; i < k; i++) s += (float)qr[i] * x[j * k + i];
                s *= scale[r];
                y[j * n + r] = bias ? s + bias[r] : s;
            }
        }
    }
    return 0;
}
