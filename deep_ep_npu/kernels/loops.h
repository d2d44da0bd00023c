/* The CPU loops of loops.c, expert_mm.c, rms_norm.c, attention.c and rope.c (each documented there), called only by the checked bindings
 * in _cpu.c; and the bf16 conversions they share. */
#ifndef DEP_LOOPS_H
#define DEP_LOOPS_H
#include <stdint.h>
#include <string.h>

/* bf16 <-> fp32: the widening is exact; the narrowing rounds to nearest even and keeps a NaN a (quiet) NaN. */
static inline float dep_bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t dep_f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(DEP_X86_64_V4)
/* 64-byte vectors (AVX-512 with byte ops) or 32-byte ones where the CPU has them; the build falls back to the next
 * line on a compiler without x86-64-v4 */
#define WIDE __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target_clones("avx2", "default"))) /* 32-byte vectors where the CPU has them */
#else
#define WIDE
#endif

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

int dep_has_dtype(int dtype);
int dep_accumulate(float *acc, int64_t num_tokens, int64_t hidden, const uint8_t *base, int64_t stride, int dtype,
                   const int64_t *index, const int64_t *addr, const int64_t *token, const float *weight, int64_t n,
                   int zero_first);
int dep_sum_tokens(uint8_t *out, int out_dtype, int64_t num_tokens, int64_t hidden, int dtype, const int64_t *addr,
                   const int64_t *token, const float *weight, int64_t n);
int64_t dep_place(const uint8_t *rows, int64_t n, int64_t row_bytes, int64_t data_bytes, int64_t token_off,
                  int64_t slot_off, int64_t num_slots, int64_t num_local, int64_t cap, int64_t num_ranks, int64_t src,
                  uint8_t *recv, int32_t *src_info, int64_t *pos, int64_t *counts, int64_t *pair_row,
                  int64_t *pair_pos);
int dep_check_ids(const int64_t *ids, int64_t n, int64_t k, int64_t lo, int64_t hi);
int64_t dep_plan(const int64_t *ids, int64_t T, int64_t K, int64_t L, int64_t R, int64_t me, const uint8_t *mask,
                 int per_pair_rows, int64_t *token, int64_t *slot, int64_t *dest, int64_t *expert,
                 int64_t *pairs_per_dest, int64_t *row_token, int64_t *row_of_pair, int64_t *rows_per_dest,
                 int32_t *slot_expert, int64_t *scratch, int64_t *rows_out);
void dep_pack(const uint8_t *x, int64_t data_bytes, const int64_t *row_token, const int32_t *slot_expert, int64_t n,
              int64_t k, uint8_t *out, int64_t row_bytes, int64_t token_off, int64_t slot_off, int streaming);
void dep_gather(const uint8_t *x, int64_t x_stride, int64_t row_bytes, const int64_t *index, int64_t n, uint8_t *out,
                int64_t out_stride);
void dep_layout_range(const int64_t *counts, int64_t num_local, int64_t num_ranks, int64_t me, int64_t *layout_range,
                      int32_t *recv_count);
int64_t dep_return_rows(const int64_t *layout_range, int64_t num_local, int64_t num_ranks, int64_t n,
                        const uint8_t *mask, int64_t *rows, int64_t *per_src);
int dep_place_pairs(const uint8_t *x, int64_t data_bytes, const int64_t *token, const int64_t *expert, int64_t n,
                    int64_t num_local, int64_t cap, int64_t num_ranks, int64_t src, uint8_t *recv, int32_t *src_info,
                    int64_t *pos, int64_t *counts);
int64_t dep_place_flat(const int64_t *block_addr, const int64_t *block_n, const int64_t *block_src, int64_t nb,
                       int64_t row_bytes, int64_t data_bytes, int64_t scale_off, int64_t scale_bytes, int64_t token_off,
                       int64_t slot_off, int64_t num_slots, int64_t weight_off, int64_t num_local, int64_t num_ranks,
                       int64_t cap, uint8_t *expand_x, uint8_t *scales, int32_t *assist, float *expand_scales,
                       int64_t *counts);
int dep_pack_int8(const uint8_t *x, int dtype, int64_t hidden, const int64_t *row_token, const int32_t *slot_expert,
                  const float *weights, int64_t n, int64_t k, uint8_t *out, int64_t row_bytes, int64_t scale_off,
                  int64_t token_off, int64_t slot_off, int64_t weight_off);
void dep_place_scales(const uint8_t *rows, int64_t row_bytes, int64_t scale_off, const int64_t *pair_row,
                      const int64_t *pair_pos, int64_t k, float *out, int64_t cap, int64_t groups, int repeat);
int dep_pack_fp8(const uint8_t *x, int dtype, int64_t hidden, const int64_t *row_token, const int32_t *slot_expert,
                 int64_t n, int64_t k, uint8_t *out, int64_t row_bytes, int64_t scale_off, int64_t token_off,
                 int64_t slot_off);
void dep_to_e4m3(const float *x, int64_t n, uint8_t *out);

/* expert_mm.c */
int dep_expert_mm(const uint16_t *x, const uint16_t *w, uint16_t *y, const int32_t *offs, int64_t E, int64_t N,
                  int64_t K, int64_t threads, int64_t max_rows);

/* rms_norm.c */
void dep_rms_norm(const uint16_t *x, int64_t rows, int64_t H, const void *w, int w_fp32, int round_first, float eps,
                  uint16_t *y);
void dep_add_rms_norm(uint16_t *x, const uint16_t *d, int64_t rows, int64_t H, const void *w, int w_fp32,
                      int round_first, float eps, uint16_t *y);

/* attention.c */
int dep_decode_attention(int bf16, const uint8_t *qkv, int64_t W, int64_t S, int64_t H, int64_t KV, int64_t D,
                         uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, const int64_t *table, int64_t MB,
                         int64_t bs, const int64_t *pos, int64_t window, const float *sinks, float scale,
                         uint8_t *out);

/* rope.c */
void dep_qk_norm_rope(int bf16, uint8_t *qkv, int64_t T, int64_t W, int64_t H, int64_t KV, int64_t D,
                      const uint8_t *q_w, const uint8_t *k_w, float eps, const uint8_t *cos, const uint8_t *sin,
                      int64_t rd);
#endif
