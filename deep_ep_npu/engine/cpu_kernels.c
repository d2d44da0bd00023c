/* The two CPU loops that move most of a low-latency call's bytes, each one pass over them (see cpu_kernels.py).
 * Results are bit-identical to the torch code they replace: fp32 products and sums rounded one by one, in the same
 * order (built with -ffp-contract=off: no fused multiply-add). */
#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target_clones("avx2", "default"))) /* 32-byte vectors where the CPU has them */
#else
#define WIDE
#endif

WIDE static void axpy_f32(float *restrict acc, const float *restrict x, float w, int64_t n) {
    for (int64_t h = 0; h < n; h++) {
        float p = w * x[h];
        acc[h] = acc[h] + p;
    }
}

WIDE static void axpy_bf16(float *restrict acc, const uint16_t *restrict x, float w, int64_t n) {
    for (int64_t h = 0; h < n; h++) {
        uint32_t bits = (uint32_t)x[h] << 16;
        float v;
        memcpy(&v, &bits, sizeof v);
        float p = w * v;
        acc[h] = acc[h] + p;
    }
}

#ifdef __FLT16_MAX__
WIDE static void axpy_f16(float *restrict acc, const _Float16 *restrict x, float w, int64_t n) {
    for (int64_t h = 0; h < n; h++) {
        float p = w * (float)x[h];
        acc[h] = acc[h] + p;
    }
}
#endif

/* Whether dep_accumulate takes rows of `dtype`. */
int dep_has_dtype(int dtype) {
#ifdef __FLT16_MAX__
    return dtype == DTYPE_F32 || dtype == DTYPE_BF16 || dtype == DTYPE_F16;
#else
    return dtype == DTYPE_F32 || dtype == DTYPE_BF16;
#endif
}

/* acc[token[i]] += weight[i] * x_i for i = 0 .. n - 1 in order, in fp32 (each product rounded, then the sum): x_i is
 * `hidden` values of `dtype` at base + (index ? index[i] : i) * stride bytes, acc is [num_tokens][hidden] fp32.
 * Returns 0; -1 when a token is outside [0, num_tokens) (nothing is written from that pair on); -2 for a dtype
 * this build lacks. */
int dep_accumulate(float *acc, int64_t num_tokens, int64_t hidden, const uint8_t *base, int64_t stride, int dtype,
                   const int64_t *index, const int64_t *token, const float *weight, int64_t n) {
    if (!dep_has_dtype(dtype))
        return -2;
    for (int64_t i = 0; i < n; i++) {
        int64_t t = token[i];
        if (t < 0 || t >= num_tokens)
            return -1;
        const uint8_t *row = base + (index ? index[i] : i) * stride;
        float *a = acc + t * hidden;
        if (dtype == DTYPE_BF16)
            axpy_bf16(a, (const uint16_t *)row, weight[i], hidden);
        else if (dtype == DTYPE_F32)
            axpy_f32(a, (const float *)row, weight[i], hidden);
#ifdef __FLT16_MAX__
        else
            axpy_f16(a, (const _Float16 *)row, weight[i], hidden);
#endif
    }
    return 0;
}

/* Expand n dispatch rows of one source into the masked layout: for each row i in order and each slot j in order
 * whose local expert e (int32 at row + slot_off + 4 j) is >= 0, the row's first data_bytes go to row pos[e] of
 * expert e of recv ([num_local][cap][data_bytes]), the row's token (int32 at row + token_off) to
 * src_info[e * cap + pos[e]], and pos[e] and counts[e * num_ranks + src] grow by one; pair_row / pair_pos (room for
 * n * num_slots) get the pair's row i and flat position e * cap + pos[e]. Returns the number of pairs; -1 when an
 * expert is outside [-1, num_local), -2 when an expert's rows would pass cap (nothing is written then). */
int64_t dep_place(const uint8_t *rows, int64_t n, int64_t row_bytes, int64_t data_bytes, int64_t token_off,
                  int64_t slot_off, int64_t num_slots, int64_t num_local, int64_t cap, int64_t num_ranks, int64_t src,
                  uint8_t *recv, int32_t *src_info, int64_t *pos, int64_t *counts, int64_t *pair_row,
                  int64_t *pair_pos) {
    int64_t added[num_local > 0 ? num_local : 1];
    memset(added, 0, sizeof added);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = rows + i * row_bytes;
        for (int64_t j = 0; j < num_slots; j++) {
            int32_t e;
            memcpy(&e, row + slot_off + 4 * j, sizeof e);
            if (e < -1 || e >= num_local)
                return -1;
            if (e >= 0 && pos[e] + ++added[e] > cap)
                return -2;
        }
    }
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = rows + i * row_bytes;
        int32_t token;
        memcpy(&token, row + token_off, sizeof token);
        for (int64_t j = 0; j < num_slots; j++) {
            int32_t e;
            memcpy(&e, row + slot_off + 4 * j, sizeof e);
            if (e < 0)
                continue;
            int64_t flat = e * cap + pos[e]++;
            memcpy(recv + flat * data_bytes, row, (size_t)data_bytes);
            src_info[flat] = token;
            counts[e * num_ranks + src]++;
            pair_row[k] = i;
            pair_pos[k++] = flat;
        }
    }
    return k;
}
