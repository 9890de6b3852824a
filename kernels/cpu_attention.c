/* Decode attention over the paged KV cache for CPU steps (kernels/cpu.py).
 *
 * One new token per sequence: store its K/V at its cache slot, then attend its query (every
 * query head; GQA groups share a KV head) over the sequence's cached context through the
 * block table, causal and within an optional sliding window. Same result as
 * kernels/reference.py's paged attention for one-token chunks; one C call per layer instead of
 * the ~15 aten calls of gathering, SDPA and the copies around it.
 *
 * Two cache dtypes: float32, and bfloat16 (--dtype bfloat16): the upper half of a float32, so
 * widening a cached value is a 16-bit shift, and the new K/V are rounded to nearest even on
 * the way in, as torch's .to(torch.bfloat16). Queries, the new K/V and all math are float32
 * in both (the caller widens the step's few bf16 rows).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* 8 cached values as float32, from either cache dtype */
static inline __m256 load8(const void *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p);
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline float load1(const void *p, int64_t j, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[j]) : ((const float *)p)[j];
}

/* q . k over d values. Written out in AVX2 because the compiler keeps a float sum in order
 * (no -ffast-math), one FMA at a time: that scalar chain made this kernel ~18% of an int8
 * batch-1 step on SmolLM2-135M (perf, 400-token contexts), more than its memory traffic. */
static inline float dot(const float *a, const void *b, int64_t d, int bf16) {
    const size_t elt = bf16 ? 2 : 4;
    const char *bb = (const char *)b;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), load8(bb + j * elt, bf16), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), load8(bb + (j + 8) * elt, bf16), acc1);
    }
    for (; j + 8 <= d; j += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), load8(bb + j * elt, bf16), acc0);
    __m256 v = _mm256_add_ps(acc0, acc1);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    float s = _mm_cvtss_f32(lo);
    for (; j < d; j++) s += a[j] * load1(b, j, bf16);
    return s;
}

/* The kernel for one cache dtype (bf16 a constant in each caller, so each gets its own
 * specialised copy). Arguments as tokenmill_decode_attention's; the caches are float32 or
 * uint16 (bf16) by `bf16`. */
static inline __attribute__((always_inline)) int decode_attention(
    const float *q, int64_t q_stride, const float *k_new, const float *v_new, int64_t kv_stride,
    void *k_cache, void *v_cache, const int64_t *slots, const int32_t *tables,
    int64_t table_stride, const int32_t *seq_lens, int64_t b, int64_t hq, int64_t hkv,
    int64_t d, int64_t block_size, float scale, int64_t window, float *out, int nthreads,
    const int bf16) {
    const int64_t row = hkv * d; /* values per cached token */
    const size_t elt = bf16 ? 2 : 4;
    for (int64_t i = 0; i < b; i++) {
        if (slots[i] < 0) continue;
        if (!bf16) {
            memcpy((float *)k_cache + slots[i] * row, k_new + i * kv_stride, row * sizeof(float));
            memcpy((float *)v_cache + slots[i] * row, v_new + i * kv_stride, row * sizeof(float));
            continue;
        }
        uint16_t *kc = (uint16_t *)k_cache + slots[i] * row, *vc = (uint16_t *)v_cache + slots[i] * row;
        for (int64_t j = 0; j < row; j++) {
            kc[j] = to_bf16(k_new[i * kv_stride + j]);
            vc[j] = to_bf16(v_new[i * kv_stride + j]);
        }
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
                const char *kv = (const char *)k_cache +
                                 (((int64_t)table[blk] * block_size + off) * row + g * d) * elt;
                if (++off == block_size) off = 0, blk++;
                const float s = dot(qv, kv, d, bf16) * scale;
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
                const char *vv = (const char *)v_cache +
                                 (((int64_t)table[blk] * block_size + off) * row + g * d) * elt;
                if (++off == block_size) off = 0, blk++;
                const float w = scores[p - start] / sum;
                int64_t j = 0;
                if (bf16) /* float32 rows: the compiler vectorises the plain loop below */
                    for (; j + 8 <= d; j += 8)
                        _mm256_storeu_ps(o + j, _mm256_fmadd_ps(_mm256_set1_ps(w),
                                                                load8(vv + j * elt, 1),
                                                                _mm256_loadu_ps(o + j)));
                for (; j < d; j++) o[j] += w * load1(vv, j, bf16);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* q: [b, hq, d] (token stride q_stride floats); k_new, v_new: [b, hkv, d] (strides kv_stride);
 * caches: [blocks, block_size, hkv, d] float32 contiguous; slots: [b] int64 (-1: not stored);
 * tables: [b, table_stride] int32; seq_lens: [b] int32 (context after this token);
 * window <= 0: none. out: [b, hq, d] contiguous. Returns 0, -1 when out of memory. */
int tokenmill_decode_attention(const float *q, int64_t q_stride, const float *k_new,
                               const float *v_new, int64_t kv_stride, float *k_cache,
                               float *v_cache, const int64_t *slots, const int32_t *tables,
                               int64_t table_stride, const int32_t *seq_lens, int64_t b,
                               int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                               float scale, int64_t window, float *out, int nthreads) {
    return decode_attention(q, q_stride, k_new, v_new, kv_stride, k_cache, v_cache, slots, tables,
                            table_stride, seq_lens, b, hq, hkv, d, block_size, scale, window, out,
                            nthreads, 0);
}

/* As tokenmill_decode_attention, with bf16 caches (uint16 [blocks, block_size, hkv, d]). */
int tokenmill_decode_attention_bf16(const float *q, int64_t q_stride, const float *k_new,
                                    const float *v_new, int64_t kv_stride, uint16_t *k_cache,
                                    uint16_t *v_cache, const int64_t *slots,
                                    const int32_t *tables, int64_t table_stride,
                                    const int32_t *seq_lens, int64_t b, int64_t hq, int64_t hkv,
                                    int64_t d, int64_t block_size, float scale, int64_t window,
                                    float *out, int nthreads) {
    return decode_attention(q, q_stride, k_new, v_new, kv_stride, k_cache, v_cache, slots, tables,
                            table_stride, seq_lens, b, hq, hkv, d, block_size, scale, window, out,
                            nthreads, 1);
}
