/* The decode step's attention in one call per layer (see kernels.attention): each sequence's one query attends every
 * cached key of its sequence up to its position, read in place through the block table (no gather, no mask tensor,
 * no padding), after this step's key and value are written to their cache slots. Per (sequence, key/value head):
 * scores = scale * q.k in fp32 for each query head of the group, masked to the window, an fp32 softmax (a sink logit
 * per head joins the denominator, gpt-oss), out = sum p * v in fp32, rounded once to the dtype. The same fp32
 * arithmetic as the torch code (attention.attend) but for the order of the sums of q.k (16 interleaved partial sums),
 * which moves a score in its last fp32 bits. It exists because the ~20 torch ops of a decode layer's attention (two
 * cache gathers, the mask, two casts, two batched matmuls, where, softmax) cost more than the arithmetic. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "loops.h"

#define LANES 16

/* n values of a bf16 / fp32 row as fp32 (the widening is exact). */
static inline void widen(float *dst, const uint8_t *src, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; i++)
            dst[i] = dep_bf16_f32(((const uint16_t *)src)[i]);
    else
        memcpy(dst, src, (size_t)n * 4);
}

/* q.k of D fp32 values, in LANES interleaved partial sums (vectorizes without reassociating). */
static inline float dot(const float *q, const float *k, int64_t D) {
    float part[LANES] = {0}, sum = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int j = 0; j < LANES; j++)
            part[j] += q[i + j] * k[i + j];
    for (; i < D; i++)
        part[i & (LANES - 1)] += q[i] * k[i];
    for (int j = 0; j < LANES; j++)
        sum += part[j];
    return sum;
}

/* scratch: group * keys scores, then group * D of q, group * D of the output sums and D of a key or value row. */
static inline __attribute__((always_inline)) void attend(int bf16, const uint8_t *qkv, int64_t W, int64_t S, int64_t H,
                                                         int64_t KV, int64_t D, uint8_t *k_cache, uint8_t *v_cache,
                                                         const int64_t *slots, const int64_t *table, int64_t MB,
                                                         int64_t bs, const int64_t *pos, int64_t window,
                                                         const float *sinks, float scale, uint8_t *out,
                                                         float *scores) {
    const int64_t item = bf16 ? 2 : 4, group = H / KV, row = W * item, slot_bytes = KV * D * item;
    float *q = scores + group * MB * bs, *acc = q + group * D, *kv = acc + group * D;
    for (int64_t s = 0; s < S; s++) { /* this step's key and value into the cache */
        memcpy(k_cache + slots[s] * slot_bytes, qkv + s * row + H * D * item, (size_t)slot_bytes);
        memcpy(v_cache + slots[s] * slot_bytes, qkv + s * row + (H + KV) * D * item, (size_t)slot_bytes);
    }
    for (int64_t s = 0; s < S; s++) {
        int64_t last = pos[s], first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
        int64_t n = last - first + 1;
        for (int64_t g = 0; g < KV; g++) {
            widen(q, qkv + s * row + g * group * D * item, group * D, bf16);
            for (int64_t j = 0; j < n; j++) { /* scores[h][j]: the group's query heads against key first + j */
                int64_t p = first + j;
                widen(kv, k_cache + (table[s * MB + p / bs] * bs + p % bs) * slot_bytes + g * D * item, D, bf16);
                for (int64_t h = 0; h < group; h++)
                    scores[h * n + j] = dot(q + h * D, kv, D) * scale;
            }
            for (int64_t h = 0; h < group; h++) {
                float *sc = scores + h * n, m = -INFINITY, sum = 0.0f;
                float sink = sinks ? sinks[g * group + h] : -INFINITY;
                for (int64_t j = 0; j < n; j++)
                    m = sc[j] > m ? sc[j] : m;
                m = sink > m ? sink : m;
                for (int64_t j = 0; j < n; j++)
                    sum += sc[j] = expf(sc[j] - m);
                if (sinks)
                    sum += expf(sink - m);
                for (int64_t j = 0; j < n; j++)
                    sc[j] /= sum;
            }
            memset(acc, 0, sizeof(float) * (size_t)(group * D));
            for (int64_t j = 0; j < n; j++) {
                int64_t p = first + j;
                widen(kv, v_cache + (table[s * MB + p / bs] * bs + p % bs) * slot_bytes + g * D * item, D, bf16);
                for (int64_t h = 0; h < group; h++) {
                    float w = scores[h * n + j], *a = acc + h * D;
                    for (int64_t d = 0; d < D; d++)
                        a[d] += w * kv[d];
                }
            }
            uint8_t *o = out + (s * H + g * group) * D * item;
            for (int64_t i = 0; i < group * D; i++) {
                if (bf16)
                    ((uint16_t *)o)[i] = dep_f32_bf16(acc[i]);
                else
                    ((float *)o)[i] = acc[i];
            }
        }
    }
}

WIDE int dep_decode_attention(int bf16, const uint8_t *qkv, int64_t W, int64_t S, int64_t H, int64_t KV,
                              int64_t D, uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, const int64_t *table, int64_t MB,
                         int64_t bs, const int64_t *pos, int64_t window, const float *sinks, float scale,
                         uint8_t *out) {
    int64_t group = H / KV;
    float *scratch = malloc(sizeof(float) * (size_t)(group * MB * bs + 2 * group * D + D));
    if (!scratch)
        return 0;
    if (bf16)
        attend(1, qkv, W, S, H, KV, D, k_cache, v_cache, slots, table, MB, bs, pos, window, sinks, scale, out, scratch);
    else
        attend(0, qkv, W, S, H, KV, D, k_cache, v_cache, slots, table, MB, bs, pos, window, sinks, scale, out, scratch);
    free(scratch);
    return 1;
}
