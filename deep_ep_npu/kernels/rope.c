/* The q / k heads of a fused q|k|v projection, in place, in one call (see kernels.rope): each head's optional RMSNorm
 * over head_dim (Qwen3's / GLM's q_norm and k_norm: dep_rms_norm's arithmetic for bf16; for fp32 HF's
 * weight * (x * rsqrt(mean(x * x) + eps)), the sum of squares in 16 partial sums), then the rotary embedding of its
 * first rd dims (rotate_half pairs i and i + rd / 2) with that token's cos / sin: out = x * cos + rotate_half(x) *
 * sin, each product and the sum rounded to the dtype as torch's elementwise ops do, so bf16 results equal the torch
 * code bit for bit. It exists because the norms and rope of q and k are ~20 torch ops per layer of a decode step. */
#include <math.h>

#include "loops.h"

static inline float ld(const uint8_t *p, int64_t i, int bf16) {
    return bf16 ? dep_bf16_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float rnd(float v, int bf16) { return bf16 ? dep_bf16_f32(dep_f32_bf16(v)) : v; }

static inline void put(uint8_t *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = dep_f32_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline void norm_f32(float *x, int64_t D, const float *w, float eps) {
    float part[16] = {0}, sum = 0.0f;
    for (int64_t i = 0; i < D; i++)
        part[i & 15] += x[i] * x[i];
    for (int j = 0; j < 16; j++)
        sum += part[j];
    float inv = 1.0f / sqrtf(sum / (float)D + eps);
    for (int64_t i = 0; i < D; i++)
        x[i] = w[i] * (x[i] * inv);
}

static inline __attribute__((always_inline)) void heads(int bf16, uint8_t *qkv, int64_t T, int64_t W, int64_t H,
                                                        int64_t KV, int64_t D, const uint8_t *q_w,
                                                        const uint8_t *k_w, float eps, const uint8_t *cos,
                                                        const uint8_t *sin, int64_t rd) {
    const int64_t item = bf16 ? 2 : 4, half = rd / 2;
    float x[1024];
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H + KV; h++) {
            uint8_t *head = qkv + (t * W + h * D) * item;
            const uint8_t *w = h < H ? q_w : k_w, *c = cos + t * rd * item, *s = sin + t * rd * item;
            if (w && bf16)
                dep_rms_norm((const uint16_t *)head, 1, D, w, 0, 1, eps, (uint16_t *)head);
            else if (w)
                for (int64_t i = 0; i < D; i++)
                    x[i] = ((float *)head)[i];
            if (w && !bf16)
                norm_f32(x, D, (const float *)w, eps);
            else
                for (int64_t i = 0; i < rd; i++)
                    x[i] = ld(head, i, bf16);
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                put(head, i, rnd(x1 * ld(c, i, bf16), bf16) + rnd(-x2 * ld(s, i, bf16), bf16), bf16);
                put(head, i + half, rnd(x2 * ld(c, i + half, bf16), bf16) + rnd(x1 * ld(s, i + half, bf16), bf16),
                    bf16);
            }
            if (w && !bf16) /* the normalised dims past rd pass through */
                for (int64_t i = rd; i < D; i++)
                    ((float *)head)[i] = x[i];
        }
}

WIDE void dep_qk_norm_rope(int bf16, uint8_t *qkv, int64_t T, int64_t W, int64_t H, int64_t KV, int64_t D,
                           const uint8_t *q_w, const uint8_t *k_w, float eps, const uint8_t *cos, const uint8_t *sin,
                           int64_t rd) {
    if (bf16)
        heads(1, qkv, T, W, H, KV, D, q_w, k_w, eps, cos, sin, rd);
    else
        heads(0, qkv, T, W, H, KV, D, q_w, k_w, eps, cos, sin, rd);
}
