/* The decoder's element-wise ops in float32 for small CPU steps (kernels/cpu.py, CpuOps).
 *
 * A decode step on a CPU runs each of these on a few rows of 576-3072 floats, where torch's
 * composite versions cost 4-10 aten calls each (~3 µs of dispatch per call on the 2-core VM,
 * more than the arithmetic). Each function here is one pass over the rows, single-threaded
 * (the rows are too short to split), vectorised by the compiler (-O3 -mavx2 -mfma). Same
 * formulas as kernels/reference.py, in float32 throughout.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps); x, out: [t, h] with row strides (floats). A
 * prefill's many rows split across nthreads OpenMP threads (_mt); a decode step's few stay on
 * the calling thread. */
static inline void rms_norm_row(const float *xr, const float *w, float *o, int64_t h, float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < h; i++) ss += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) o[i] = w[i] * (xr[i] * inv);
}

/* the row loops below: across nthreads OpenMP threads for a prefill's many rows, else on the
 * calling thread with no OpenMP call at all (a decode step's few rows, the compiled step) */
#define FOR_ROWS(t, nthreads, body)                                                           \
    if ((t) >= 32 && (nthreads) > 1) {                                                        \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                    \
        for (int64_t r = 0; r < (t); r++) body                                                \
    } else {                                                                                  \
        for (int64_t r = 0; r < (t); r++) body                                                \
    }

void tokenmill_rms_norm_mt(const float *x, int64_t x_stride, const float *w, float *out,
                           int64_t out_stride, int64_t t, int64_t h, float eps, int nthreads) {
    FOR_ROWS(t, nthreads, { rms_norm_row(x + r * x_stride, w, out + r * out_stride, h, eps); })
}

void tokenmill_rms_norm(const float *x, int64_t x_stride, const float *w, float *out,
                        int64_t out_stride, int64_t t, int64_t h, float eps) {
    tokenmill_rms_norm_mt(x, x_stride, w, out, out_stride, t, h, eps, 1);
}

/* res_out[t] = x[t] + res[t]; out[t] = rms_norm(res_out[t]); all [t, h] contiguous */
static inline void fused_add_rms_norm_row(const float *xr, const float *rr, const float *w,
                                          float *o, float *ro, int64_t h, float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < h; i++) {
        const float v = xr[i] + rr[i];
        ro[i] = v;
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) o[i] = w[i] * (ro[i] * inv);
}

void tokenmill_fused_add_rms_norm_mt(const float *x, const float *res, const float *w,
                                     float *out, float *res_out, int64_t t, int64_t h, float eps,
                                     int nthreads) {
    FOR_ROWS(t, nthreads, {
        fused_add_rms_norm_row(x + r * h, res + r * h, w, out + r * h, res_out + r * h, h, eps);
    })
}

void tokenmill_fused_add_rms_norm(const float *x, const float *res, const float *w, float *out,
                                  float *res_out, int64_t t, int64_t h, float eps) {
    tokenmill_fused_add_rms_norm_mt(x, res, w, out, res_out, t, h, eps, 1);
}

/* Neox RoPE in place on x [t, heads, d] (token stride x_stride floats, heads contiguous d
 * apart) with cos, sin [t, d] contiguous: the two halves of each head rotate together. */
void tokenmill_rotary(float *x, int64_t x_stride, int64_t t, int64_t heads, int64_t d,
                      const float *cos_, const float *sin_) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < t; r++) {
        const float *c = cos_ + r * d, *s = sin_ + r * d;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *v = x + r * x_stride + hd * d;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* e^x for 8 floats, AVX2 + FMA: x = n ln2 + r with |r| <= ln2 / 2, e^r from Cephes' degree-7
 * polynomial (about 1 ulp), times 2^n built in the exponent bits. x is clamped to
 * [-87.3, 88.7] so that 2^n stays a normal float (e^-87.3 ~ 1.2e-38; e^88.7 ~ 3.3e38). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* out[t, i] = silu(x[t, i]) * x[t, n + i]; x [t, 2n] contiguous, out [t, n]. Eight lanes at a
 * time with exp8 (expf itself does not vectorise: a prefill's 500 x 1536 values took 2.3 ms a
 * layer on one core); a prefill's many rows split across nthreads OpenMP threads. */
static inline void silu_and_mul_row(const float *g, float *o, int64_t n) {
    const float *u = g + n;
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign)));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

void tokenmill_silu_and_mul_mt(const float *x, float *out, int64_t t, int64_t n, int nthreads) {
    FOR_ROWS(t, nthreads, { silu_and_mul_row(x + r * 2 * n, out + r * n, n); })
}

void tokenmill_silu_and_mul(const float *x, float *out, int64_t t, int64_t n) {
    tokenmill_silu_and_mul_mt(x, out, t, n, 1);
}
