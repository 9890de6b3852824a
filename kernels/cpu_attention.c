/* Decode attention over the paged KV cache for float32 CPU steps (kernels/cpu.py).
 *
 * One new token per sequence: store its K/V at its cache slot, then attend its query (every
 * query head; GQA groups share a KV head) over the sequence's cached context through the
 * block table, causal and within an optional sliding window. Same result as
 * kernels/reference.py's paged attention for one-token chunks; one C call per layer instead of
 * the ~15 aten calls of gathering, SDPA and the copies around it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* q . k over d floats. Written out in AVX2 because the compiler keeps a float sum in order
 * (no -ffast-math), one FMA at a time: that scalar chain made this kernel ~18% of an int8
 * batch-1 step on SmolLM2-135M (perf, 400-token contexts), more than its memory traffic. */
static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), acc1);
    }
    for (; j + 8 <= d; j += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
    __m256 v = _mm256_add_ps(acc0, acc1);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    float s = _mm_cvtss_f32(lo);
    for (; j < d; j++) s += a[j] * b[j];
    return s;
}

/* q: [b, hq, d] (token stride q_stride floats); k_new, v_new: [b, hkv, d] (strides kv_stride);
 * caches: [blocks, block_size, hkv, d] contiguous; slots: [b] int64 (-1: not stored);
 * tables: [b, table_stride] int32; seq_lens: [b] int32 (context after this token);
 * window <= 0: none. out: [b, hq, d] contiguous. Returns 0, -1 when out of memory. */
int tokenmill_decode_attention(const float *q, int64_t q_stride, const float *k_new,
                               const float *v_new, int64_t kv_stride, float *k_cache,
                               float *v_cache, const int64_t *slots, const int32_t *tables,
                               int64_t table_stride, const int32_t *seq_lens, int64_t b,
                               int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                               float scale, int64_t window, float *out, int nthreads) {
    const int64_t row = hkv * d; /* floats per cached token */
    for (int64_t i = 0; i < b; i++) {
        if (slots[i] < 0) continue;
        memcpy(k_cache + slots[i] * row, k_new + i * kv_stride, row * sizeof(float));
        memcpy(v_cache + slots[i] * row, v_new + i * kv_stride, row * sizeof(float));
    }
    int64_t max_len = 1;
    for (int64_t i = 0; i < b; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int64_t group = hq / hkv;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc(max_len * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t job = 0; job < b * hq; job++) {
            if (!scores) continue;
            const int64_t i = job / hq, h = job % hq, g = h / group;
            const int64_t len = seq_lens[i];
            const int64_t start = window > 0 && len > window ? len - window : 0;
            const float *qv = q + i * q_stride + h * d;
            const int32_t *table = tables + i * table_stride;
            float m = -INFINITY;
            /* walk the block table: one division per sequence, not two per position */
            int64_t blk = start / block_size, off = start % block_size;
            for (int64_t p = start; p < len; p++) {
                const float *kv =
                    k_cache + ((int64_t)table[blk] * block_size + off) * row + g * d;
                if (++off == block_size) off = 0, blk++;
                const float s = dot(qv, kv, d) * scale;
                scores[p - start] = s;
                m = s > m ? s : m;
            }
            float sum = 0.f;
            for (int64_t p = 0; p < len - start; p++) {
                scores[p] = expf(scores[p] - m);
                sum += scores[p];
            }
            float *o = out + (i * hq + h) * d;
            for (int64_t j = 0; j < d; j++) o[j] = 0.f;
            blk = start / block_size, off = start % block_size;
            for (int64_t p = start; p < len; p++) {
                const float *vv =
                    v_cache + ((int64_t)table[blk] * block_size + off) * row + g * d;
                if (++off == block_size) off = 0, blk++;
                const float w = scores[p - start] / sum;
                for (int64_t j = 0; j < d; j++) o[j] += w * vv[j];
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
