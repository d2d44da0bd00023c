/* RMSNorm of bf16 rows as transformers computes it (see kernels.rms_norm.rms_norm): per row, in fp32,
 * n = x * (1 / sqrt(mean(x * x) + eps)); then y = bf16(w * bf16(n)) (round_first: HF's `weight * x.to(bf16)`, a
 * bf16 weight) or y = bf16(w * n) (gpt-oss; a bf16 or fp32 weight). Every step is torch's but the sum of
 * squares, which adds in 16 interleaved partial sums (torch's order depends on its vector width): a row's mean may
 * differ from torch's in its last fp32 bits, which moves a rounded bf16 output by one step now and then. It exists
 * because the eight torch ops it replaces cost ~45 us per call in a decode step, the kernel ~5. */
#include <math.h>
#include <string.h>

#include "loops.h"

static inline float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* round to nearest even; a NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void dep_rms_norm(const uint16_t *x, int64_t rows, int64_t H, const void *w, int w_fp32, int round_first, float eps,
                  uint16_t *y) {
    const uint16_t *wb = (const uint16_t *)w;
    const float *wf = (const float *)w;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * H;
        uint16_t *yr = y + r * H;
        float part[16] = {0}, sum = 0.0f;
        int64_t i = 0;
        for (; i + 16 <= H; i += 16)
            for (int j = 0; j < 16; j++) {
                float v = bf16_f32(xr[i + j]);
                part[j] += v * v;
            }
        for (; i < H; i++) {
            float v = bf16_f32(xr[i]);
            part[i & 15] += v * v;
        }
        for (int j = 0; j < 16; j++)
            sum += part[j];
        float inv = 1.0f / sqrtf(sum / (float)H + eps);
        if (round_first)
            for (i = 0; i < H; i++)
                yr[i] = f32_bf16(bf16_f32(wb[i]) * bf16_f32(f32_bf16(bf16_f32(xr[i]) * inv)));
        else if (w_fp32)
            for (i = 0; i < H; i++)
                yr[i] = f32_bf16(wf[i] * (bf16_f32(xr[i]) * inv));
        else
            for (i = 0; i < H; i++)
                yr[i] = f32_bf16(bf16_f32(wb[i]) * (bf16_f32(xr[i]) * inv));
    }
}
