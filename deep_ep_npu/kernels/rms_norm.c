/* RMSNorm of bf16 rows as transformers computes it (see kernels.rms_norm.rms_norm): per row, in fp32,
 * n = x * (1 / sqrt(mean(x * x) + eps)); then y = bf16(w * bf16(n)) (round_first: HF's `weight * x.to(bf16)`, a
 * bf16 weight) or y = bf16(w * n) (gpt-oss; a bf16 or fp32 weight). Every step is torch's but the sum of
 * squares, which adds in 16 interleaved partial sums (torch's order depends on its vector width): a row's mean may
 * differ from torch's in its last fp32 bits, which moves a rounded bf16 output by one step now and then. It exists
 * because the eight torch ops it replaces cost ~45 us per call in a decode step, the kernel ~5. */
#include <math.h>

#include "loops.h"

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
                float v = dep_bf16_f32(xr[i + j]);
                part[j] += v * v;
            }
        for (; i < H; i++) {
            float v = dep_bf16_f32(xr[i]);
            part[i & 15] += v * v;
        }
        for (int j = 0; j < 16; j++)
            sum += part[j];
        float inv = 1.0f / sqrtf(sum / (float)H + eps);
        if (round_first)
            for (i = 0; i < H; i++) {
                float n = dep_bf16_f32(dep_f32_bf16(dep_bf16_f32(xr[i]) * inv)); /* HF: x.to(bf16), then * w */
                yr[i] = dep_f32_bf16(dep_bf16_f32(wb[i]) * n);
            }
        else if (w_fp32)
            for (i = 0; i < H; i++)
                yr[i] = dep_f32_bf16(wf[i] * (dep_bf16_f32(xr[i]) * inv));
        else
            for (i = 0; i < H; i++)
                yr[i] = dep_f32_bf16(dep_bf16_f32(wb[i]) * (dep_bf16_f32(xr[i]) * inv));
    }
}

/* x += d (each sum rounded to bf16, torch's `x + d`), then y = dep_rms_norm(x): the residual add and the next norm of
 * a decoder layer in one pass. */
void dep_add_rms_norm(uint16_t *x, const uint16_t *d, int64_t rows, int64_t H, const void *w, int w_fp32,
                      int round_first, float eps, uint16_t *y) {
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * H;
        const uint16_t *dr = d + r * H;
        for (int64_t i = 0; i < H; i++)
            xr[i] = dep_f32_bf16(dep_bf16_f32(xr[i]) + dep_bf16_f32(dr[i]));
        dep_rms_norm(xr, 1, H, w, w_fp32, round_first, eps, y + r * H);
    }
}
