/* The decoder's element-wise ops in float32 for small CPU steps (kernels/cpu.py, CpuOps).
 *
 * A decode step on a CPU runs each of these on a few rows of 576-3072 floats, where torch's
 * composite versions cost 4-10 aten calls each (~3 µs of dispatch per call on the 2-core VM,
 * more than the arithmetic). Each function here is one pass over the rows, single-threaded
 * (the rows are too short to split), vectorised by the compiler (-O3 -mavx2 -mfma). Same
 * formulas as kernels/reference.py, in float32 throughout.
 */
#include <math.h>
#include <stdint.h>

/* out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps); x, out: [t, h] with row strides (floats) */
void tokenmill_rms_norm(const float *x, int64_t x_stride, const float *w, float *out,
                        int64_t out_stride, int64_t t, int64_t h, float eps) {
    for (int64_t r = 0; r < t; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        float ss = 0.f;
        for (int64_t i = 0; i < h; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)h + eps);
        for (int64_t i = 0; i < h; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* res_out[t] = x[t] + res[t]; out[t] = rms_norm(res_out[t]); all [t, h] contiguous */
void tokenmill_fused_add_rms_norm(const float *x, const float *res, const float *w, float *out,
                                  float *res_out, int64_t t, int64_t h, float eps) {
    for (int64_t r = 0; r < t; r++) {
        const float *xr = x + r * h, *rr = res + r * h;
        float *o = out + r * h, *ro = res_out + r * h;
        float ss = 0.f;
        for (int64_t i = 0; i < h; i++) {
            const float v = xr[i] + rr[i];
            ro[i] = v;
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)h + eps);
        for (int64_t i = 0; i < h; i++) o[i] = w[i] * (ro[i] * inv);
    }
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

/* out[t, i] = silu(x[t, i]) * x[t, n + i]; x [t, 2n] contiguous, out [t, n] */
void tokenmill_silu_and_mul(const float *x, float *out, int64_t t, int64_t n) {
    for (int64_t r = 0; r < t; r++) {
        const float *g = x + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
