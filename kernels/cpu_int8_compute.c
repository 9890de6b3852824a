/* The two passes around int8 compute's GEMM (engine/int8_compute.py), for many rows at once (a
 * prefill chunk, a large decode batch), split by row across the OpenMP threads torch uses.
 *
 * In torch each pass is 6-9 aten calls over the whole [M, K] or [M, N] block (abs, amax, div,
 * round, the int8 cast, the residual's multiply and subtract; the int32 cast, two multiplies, an
 * add): on a 500-token prefill they took about three times the GEMMs' own time. Here each row
 * is read once while it sits in L1, and both int8 terms of an activation row come out of one
 * call, stacked [term 1 rows; term 2 rows] so that a single GEMM multiplies both.
 *
 * Same float32 operations in the same order as the torch expressions in engine/int8_compute.py
 * (quantize_rows, int8_linear's reference), with no fused multiply-add, so the results are
 * bit-identical to them (tests/kernels/test_cpu_int8_compute.py).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* max |x[i]| over k floats, 8 lanes at a time (a plain loop with fmaxf does not vectorise) */
static float absmax(const float *x, int64_t k) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        m0 = _mm256_max_ps(m0, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
        m1 = _mm256_max_ps(m1, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 8)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    float amax = 0.f;
    for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
    for (; i < k; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return amax;
}

/* One row rounded to int8 with its own symmetric scale: s = max(max|x| / 127, 1e-12),
 * q = round-half-even(x * (1 / s)). Returns s. */
__attribute__((optimize("fp-contract=off"))) static float quantize_row(const float *x, int8_t *q,
                                                                     int64_t k) {
    float s = absmax(x, k) / 127.f;
    if (!(s >= 1e-12f)) s = 1e-12f;
    const float inv = 1.f / s;
    for (int64_t i = 0; i < k; i++) q[i] = (int8_t)(int32_t)rintf(x[i] * inv);
    return s;
}

/* x [m, k] (row stride x_stride floats) -> q [terms * m, k] int8 and s [terms * m] float32:
 * rows 0..m-1 are each row rounded once; with terms == 2, rows m..2m-1 are what that rounding
 * left (x - q1 * s1), rounded again with a scale of their own. */
__attribute__((optimize("fp-contract=off"))) void tokenmill_i8c_quantize(
    const float *x, int64_t x_stride, int8_t *q, float *s, int64_t m, int64_t k, int terms,
    int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        float rest[terms > 1 ? k : 1];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * x_stride;
            int8_t *q1 = q + r * k;
            const float s1 = quantize_row(xr, q1, k);
            s[r] = s1;
            if (terms > 1) {
                for (int64_t i = 0; i < k; i++) rest[i] = xr[i] - (float)q1[i] * s1;
                s[m + r] = quantize_row(rest, q + (m + r) * k, k);
            }
        }
    }
}

/* acc [terms * m, n], the GEMM of tokenmill_i8c_quantize's rows (int32 sums, or the same sums
 * as float32 from oneDNN's prepacked GEMM) -> out [m, n] float32:
 * out[r] = (acc[r] * s[r] (+ acc[m + r] * s[m + r])) * col_scale (+ bias). bias may be NULL. */
#define DEQUANT_BODY(T)                                                                        \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                         \
    for (int64_t r = 0; r < m; r++) {                                                          \
        const T *a1 = acc + r * n;                                                             \
        const float s1 = s[r];                                                                 \
        float *o = out + r * n;                                                                \
        if (terms > 1) {                                                                       \
            const T *a2 = acc + (m + r) * n;                                                   \
            const float s2 = s[m + r];                                                         \
            for (int64_t j = 0; j < n; j++)                                                    \
                o[j] = ((float)a1[j] * s1 + (float)a2[j] * s2) * col_scale[j];                 \
        } else {                                                                               \
            for (int64_t j = 0; j < n; j++) o[j] = (float)a1[j] * s1 * col_scale[j];           \
        }                                                                                      \
        if (bias)                                                                              \
            for (int64_t j = 0; j < n; j++) o[j] += bias[j];                                   \
    }

__attribute__((optimize("fp-contract=off"))) void tokenmill_i8c_dequant(
    const int32_t *acc, const float *s, const float *col_scale, const float *bias, float *out,
    int64_t m, int64_t n, int terms, int nthreads) {
    DEQUANT_BODY(int32_t)
}

__attribute__((optimize("fp-contract=off"))) void tokenmill_i8c_dequant_f32(
    const float *acc, const float *s, const float *col_scale, const float *bias, float *out,
    int64_t m, int64_t n, int terms, int nthreads) {
    DEQUANT_BODY(float)
}
