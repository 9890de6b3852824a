/* A whole decode step of a Llama-family decoder in one C call, for small float32 CPU batches
 * (kernels/cpu.py: decode_step; the engine's adapter is engine/models/native_step.py).
 *
 * A batch-1 decode step of SmolLM2-135M through the Python decoder makes ~10 kernel calls a
 * layer over 30 layers; with the weights streamed at the memory's speed the calls' Python and
 * torch dispatch (module calls, tensor allocation, ctypes argument conversion) cost more than
 * the int8 GEMVs themselves (benchmarks/RESULTS.md, "A small step against its floor"). This
 * loop runs the same kernels (cpu_gemv.c, cpu_ops.c, cpu_attention.c) in the same order on
 * the same float32 values, over preallocated scratch, so its result equals the Python path's
 * up to float32 rounding (a bias fused into the int8 GEMV's output instead of added after).
 */
#include <stdint.h>
#include <string.h>

int tokenmill_gemv_f32(const float *w, const float *x, const float *bias, float *y, int64_t n,
                       int64_t k, int64_t m, int nthreads);
int tokenmill_gemv_i8(const int8_t *q, const float *scale, const float *x, const float *bias,
                      float *y, int64_t n, int64_t k, int64_t m, int nthreads);
int tokenmill_gemv_i4(const uint8_t *q, const uint32_t *sz, const float *x, const float *bias,
                      float *y, int64_t n, int64_t k, int64_t m, int nthreads);
void tokenmill_rms_norm(const float *x, int64_t x_stride, const float *w, float *out,
                        int64_t out_stride, int64_t t, int64_t h, float eps);
void tokenmill_fused_add_rms_norm(const float *x, const float *res, const float *w, float *out,
                                  float *res_out, int64_t t, int64_t h, float eps);
void tokenmill_rotary(float *x, int64_t x_stride, int64_t t, int64_t heads, int64_t d,
                      const float *cos_, const float *sin_);
void tokenmill_silu_and_mul(const float *x, float *out, int64_t t, int64_t n);
int tokenmill_decode_attention(const float *q, int64_t q_stride, const float *k_new,
                               const float *v_new, int64_t kv_stride, float *k_cache,
                               float *v_cache, const int64_t *slots, const int32_t *tables,
                               int64_t table_stride, const int32_t *seq_lens, int64_t b,
                               int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                               float scale, int64_t window, float *out, int nthreads);

/* kind 0: float32 weight [n, k]; kind 1: int8 weight [n, k] with float32 scale [n, k / 32]
 * (cpu_gemv.c: INT8_GROUP); kind 2: int4 in cpu_gemv.c's layout, its group words as scale */
typedef struct {
    int64_t kind;
    const void *weight;
    const void *scale;
    const float *bias; /* [n] or NULL */
    int64_t n, k;
} tm_linear;

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* [d] each, or NULL (Qwen3 has them) */
    tm_linear qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [blocks, block_size, hkv, d] contiguous */
    int64_t window;           /* <= 0: none */
} tm_layer;

typedef struct {
    int64_t num_layers, hidden, hq, hkv, d, inter, block_size;
    float eps, scale;
    const float *final_norm;
    const tm_layer *layers;
} tm_model;

static int linear(const tm_linear *l, const float *x, float *y, int64_t b, int nthreads) {
    if (l->kind == 1)
        return tokenmill_gemv_i8(l->weight, l->scale, x, l->bias, y, l->n, l->k, b, nthreads);
    if (l->kind == 2)
        return tokenmill_gemv_i4(l->weight, l->scale, x, l->bias, y, l->n, l->k, b, nthreads);
    return tokenmill_gemv_f32(l->weight, x, l->bias, y, l->n, l->k, b, nthreads);
}

/* Floats of scratch decode_step needs for b rows. */
int64_t tokenmill_decode_step_scratch(const tm_model *m, int64_t b) {
    const int64_t qkv = (m->hq + 2 * m->hkv) * m->d;
    return b * (3 * m->hidden + qkv + m->hq * m->d + 3 * m->inter);
}

/* h: [b, hidden] the token embeddings in, the final norm's output out. cos_, sin_: [b, d].
 * slots, tables, seq_lens as tokenmill_decode_attention. scratch: decode_step_scratch floats.
 * Returns 0, or -1 (a kernel refused its sizes or ran out of memory; h is then undefined). */
int tokenmill_decode_step(const tm_model *m, float *h, const float *cos_, const float *sin_,
                          const int64_t *slots, const int32_t *tables, int64_t table_stride,
                          const int32_t *seq_lens, int64_t b, float *scratch, int nthreads) {
    const int64_t hd = m->hidden, q_size = m->hq * m->d, kv_size = m->hkv * m->d;
    const int64_t qkv_w = q_size + 2 * kv_size;
    float *residual = scratch;
    float *normed = residual + b * hd;
    float *mlp_out = normed + b * hd;
    float *qkv = mlp_out + b * hd;
    float *attn = qkv + b * qkv_w;
    float *gate_up = attn + b * q_size;
    float *act = gate_up + b * 2 * m->inter;
    memcpy(residual, h, b * hd * sizeof(float));
    for (int64_t li = 0; li < m->num_layers; li++) {
        const tm_layer *l = &m->layers[li];
        if (li == 0)
            tokenmill_rms_norm(h, hd, l->input_norm, normed, hd, b, hd, m->eps);
        else
            tokenmill_fused_add_rms_norm(mlp_out, residual, l->input_norm, normed, residual, b,
                                         hd, m->eps);
        if (linear(&l->qkv, normed, qkv, b, nthreads)) return -1;
        if (l->q_norm) {
            for (int64_t i = 0; i < b; i++) {
                float *row = qkv + i * qkv_w;
                tokenmill_rms_norm(row, m->d, l->q_norm, row, m->d, m->hq, m->d, m->eps);
                tokenmill_rms_norm(row + q_size, m->d, l->k_norm, row + q_size, m->d, m->hkv,
                                   m->d, m->eps);
            }
        }
        tokenmill_rotary(qkv, qkv_w, b, m->hq, m->d, cos_, sin_);
        tokenmill_rotary(qkv + q_size, qkv_w, b, m->hkv, m->d, cos_, sin_);
        if (tokenmill_decode_attention(qkv, qkv_w, qkv + q_size, qkv + q_size + kv_size, qkv_w,
                                       l->k_cache, l->v_cache, slots, tables, table_stride,
                                       seq_lens, b, m->hq, m->hkv, m->d, m->block_size, m->scale,
                                       l->window, attn, nthreads))
            return -1;
        if (linear(&l->o, attn, h, b, nthreads)) return -1;
        tokenmill_fused_add_rms_norm(h, residual, l->post_norm, normed, residual, b, hd, m->eps);
        if (linear(&l->gate_up, normed, gate_up, b, nthreads)) return -1;
        tokenmill_silu_and_mul(gate_up, act, b, m->inter);
        if (linear(&l->down, act, mlp_out, b, nthreads)) return -1;
    }
    tokenmill_fused_add_rms_norm(mlp_out, residual, m->final_norm, h, residual, b, hd, m->eps);
    return 0;
}
