/* The engine's per-call loops on CPU tensors, each one pass: the plan, the id check, row packing (with per-token
 * int8 or DeepEP fp8 quantization), the masked placement, scales and block table, the flat placement, combine's
 * return rows and gather, the weighted fp32 reduction, the slot-ordered one and the token-ordered one written into
 * the output. Results are bit-identical to the torch code they replace: products, divisions and sums rounded one
 * by one, in the same order (built with -ffp-contract=off: no fused multiply-add; -fno-trapping-math lets
 * branch-free selects vectorize and changes no value; setup.py). The loops trust their arguments: only _cpu.c
 * calls them, after checking every buffer. */
#include "loops.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
/* Copy n bytes with streaming stores where dst and n allow (x86): the rows are read next by another core, or
 * later, so they need not pass through this core's cache; copies_done() orders them before later stores. */
static void copy_row(uint8_t *dst, const uint8_t *src, int64_t n) {
    if (((uintptr_t)dst & 15) || (n & 63)) {
        memcpy(dst, src, (size_t)n);
        return;
    }
    for (int64_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
}
static void copies_done(void) { _mm_sfence(); }
#else
static void copy_row(uint8_t *dst, const uint8_t *src, int64_t n) { memcpy(dst, src, (size_t)n); }
static void copies_done(void) {}
#endif


static inline float load_f32(float v) { return v; }
static inline float load_bf16(uint16_t v) { return dep_bf16_f32(v); }

/* The int32 at p (a row's token or slot field: any alignment). */
static inline int32_t read_i32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* add_T: acc += w * x; set_T: acc = 0 + w * x (as a sum from zeros: -0.0 becomes +0.0); fp32, each product rounded. */
#define ROW_LOOPS(name, type, load)                                                                     \
    WIDE static void add_##name(float *restrict acc, const type *restrict x, float w, int64_t n) {     \
        for (int64_t h = 0; h < n; h++) {                                                              \
            float p = w * load(x[h]);                                                                  \
            acc[h] = acc[h] + p;                                                                       \
        }                                                                                              \
    }                                                                                                  \
    WIDE static void set_##name(float *restrict acc, const type *restrict x, float w, int64_t n) {     \
        for (int64_t h = 0; h < n; h++) {                                                              \
            float p = w * load(x[h]);                                                                  \
            acc[h] = 0.0f + p;                                                                         \
        }                                                                                              \
    }
ROW_LOOPS(f32, float, load_f32)
ROW_LOOPS(bf16, uint16_t, load_bf16)
#ifdef __FLT16_MAX__
#define load_f16(v) ((float)(v))
ROW_LOOPS(f16, _Float16, load_f16)
#endif

/* acc = w * x (set) or acc += w * x: x is `n` values of `dtype` at row. */
static inline void weigh_row(float *restrict acc, const uint8_t *row, int dtype, float w, int64_t n, int set) {
    if (dtype == DTYPE_BF16)
        (set ? set_bf16 : add_bf16)(acc, (const uint16_t *)row, w, n);
    else if (dtype == DTYPE_F32)
        (set ? set_f32 : add_f32)(acc, (const float *)row, w, n);
#ifdef __FLT16_MAX__
    else
        (set ? set_f16 : add_f16)(acc, (const _Float16 *)row, w, n);
#endif
}

/* Whether dep_accumulate takes rows of `dtype`. */
int dep_has_dtype(int dtype) {
#ifdef __FLT16_MAX__
    return dtype == DTYPE_F32 || dtype == DTYPE_BF16 || dtype == DTYPE_F16;
#else
    return dtype == DTYPE_F32 || dtype == DTYPE_BF16;
#endif
}

/* acc[token[i]] += weight[i] * x_i for i = 0 .. n - 1 in order, in fp32 (each product rounded, then the sum): x_i is
 * `hidden` values of `dtype` at address addr[i] when addr is given, else at base + (index ? index[i] : i) * stride
 * bytes; acc is [num_tokens][hidden] fp32. With
 * zero_first acc starts from zeros (a token's first pair is added to 0 as it is written; rows of tokens without
 * pairs are zeroed): no separate pass. Returns 0; -1 when a token is outside [0, num_tokens) (nothing written); -2
 * for a dtype this build lacks; -3 out of memory. */
int dep_accumulate(float *acc, int64_t num_tokens, int64_t hidden, const uint8_t *base, int64_t stride, int dtype,
                   const int64_t *index, const int64_t *addr, const int64_t *token, const float *weight, int64_t n,
                   int zero_first) {
    if (!dep_has_dtype(dtype))
        return -2;
    for (int64_t i = 0; i < n; i++)
        if (token[i] < 0 || token[i] >= num_tokens)
            return -1;
    uint8_t *seen = zero_first ? calloc((size_t)num_tokens + 1, 1) : NULL;
    if (zero_first && !seen)
        return -3;
    for (int64_t i = 0; i < n; i++) {
        int64_t t = token[i];
        const uint8_t *row = addr ? (const uint8_t *)(uintptr_t)addr[i] : base + (index ? index[i] : i) * stride;
        float *a = acc + t * hidden;
        int set = zero_first && !seen[t];
        if (set)
            seen[t] = 1;
        weigh_row(a, row, dtype, weight[i], hidden, set);
    }
    for (int64_t t = 0; zero_first && t < num_tokens; t++)
        if (!seen[t])
            memset(acc + t * hidden, 0, sizeof(float) * (size_t)hidden);
    free(seen);
    return 0;
}

/* Rows of fp32 sums into out's dtype: bf16 rounds to nearest even with every NaN as 0xFFFF (torch's CPU cast). */
WIDE static void store_bf16(uint16_t *restrict out, const float *restrict acc, int64_t n) {
    for (int64_t h = 0; h < n; h++) {
        uint32_t u;
        memcpy(&u, &acc[h], sizeof u);
        uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        out[h] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0xffffu : r;
    }
}

/* out[t] = the fp32 sum of weight[i] * x_i over the pairs i with token[i] == t, in order (each product rounded; the
 * first added to 0), rounded once to out's dtype (fp32 or bf16); 0 for a token without pairs. The same values as
 * dep_accumulate with zero_first into fp32 and a cast, in one pass over out (no fp32 [num_tokens][hidden]; each
 * token's rows are summed a chunk of channels at a time): token must be non-decreasing. x_i: `hidden` values of
 * `dtype` at address addr[i]. Returns 0; -1 when a token is outside [0, num_tokens) or out of order (nothing
 * written); -2 for a dtype this build lacks. */
int dep_sum_tokens(uint8_t *out, int out_dtype, int64_t num_tokens, int64_t hidden, int dtype, const int64_t *addr,
                   const int64_t *token, const float *weight, int64_t n) {
    if (!dep_has_dtype(dtype) || (out_dtype != DTYPE_F32 && out_dtype != DTYPE_BF16))
        return -2;
    for (int64_t i = 0; i < n; i++)
        if (token[i] < 0 || token[i] >= num_tokens || (i && token[i] < token[i - 1]))
            return -1;
    enum { CHUNK = 512 }; /* each token's sum in chunks of fp32 that stay in registers / L1 */
    float acc[CHUNK];
    int64_t i = 0, item = out_dtype == DTYPE_F32 ? 4 : 2, in = dtype == DTYPE_F32 ? 4 : 2;
    for (int64_t t = 0; t < num_tokens; t++) {
        uint8_t *o = out + t * hidden * item;
        int64_t begin = i;
        while (i < n && token[i] == t)
            i++;
        if (begin == i) {
            memset(o, 0, (size_t)(hidden * item));
            continue;
        }
        for (int64_t h = 0; h < hidden; h += CHUNK) {
            int64_t m = hidden - h < CHUNK ? hidden - h : CHUNK;
            for (int64_t j = begin; j < i; j++) {
                const uint8_t *x = (const uint8_t *)(uintptr_t)addr[j] + h * in;
                weigh_row(acc, x, dtype, weight[j], m, j == begin);
            }
            if (out_dtype == DTYPE_BF16)
                store_bf16((uint16_t *)o + h, acc, m);
            else
                memcpy(o + h * 4, acc, sizeof(float) * (size_t)m);
        }
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
            int32_t e = read_i32(row + slot_off + 4 * j);
            if (e < -1 || e >= num_local)
                return -1;
            if (e >= 0 && pos[e] + ++added[e] > cap)
                return -2;
        }
    }
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = rows + i * row_bytes;
        int32_t token = read_i32(row + token_off);
        for (int64_t j = 0; j < num_slots; j++) {
            int32_t e = read_i32(row + slot_off + 4 * j);
            if (e < 0)
                continue;
            int64_t flat = e * cap + pos[e]++;
            copy_row(recv + flat * data_bytes, row, data_bytes);
            src_info[flat] = token;
            counts[e * num_ranks + src]++;
            pair_row[k] = i;
            pair_pos[k++] = flat;
        }
    }
    copies_done();
    return k;
}

/* Whether every id of ids ([n][k] int64) is in [lo, hi) and no id >= 0 appears twice in a row: 0 yes, 1 no. */
int dep_check_ids(const int64_t *ids, int64_t n, int64_t k, int64_t lo, int64_t hi) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t *row = ids + t * k;
        for (int64_t j = 0; j < k; j++) {
            if (row[j] < lo || row[j] >= hi)
                return 1;
            for (int64_t i = 0; i < j; i++)
                if (row[i] == row[j] && row[j] >= 0)
                    return 1;
        }
    }
    return 0;
}

/* The engine's plan (plan.py's make_plan) of the valid entries of ids ([T][K] int64, checked by dep_check_ids): pair
 * (t, j) goes to rank e / L, local expert e % L, for e = ids[t][j] >= 0 whose rank is not masked (mask [R] uint8;
 * none when mask[me]). Pairs sorted by (dest, expert, token) fill token / slot / dest / expert ([T * K] int64) and
 * pairs_per_dest [R]. Rows (remote ranks in order, this rank's last), into row_token / row_of_pair ([T * K] int64)
 * and rows_per_dest [R]: one per (dest, token) with per_pair_rows = 0 (tokens ascending), else one per pair (pair
 * order). With slot_expert ([T * K][K] int32, or NULL; per_pair_rows = 0), row r's slot j holds the local expert of
 * the pair (row r's token, j), else -1. scratch: 2 * R * T + R * L int64. Returns the number of pairs, or the number
 * of rows with rows_out (the caller's views use both). */
int64_t dep_plan(const int64_t *ids, int64_t T, int64_t K, int64_t L, int64_t R, int64_t me, const uint8_t *mask,
                 int per_pair_rows, int64_t *token, int64_t *slot, int64_t *dest, int64_t *expert,
                 int64_t *pairs_per_dest, int64_t *row_token, int64_t *row_of_pair, int64_t *rows_per_dest,
                 int32_t *slot_expert, int64_t *scratch, int64_t *rows_out) {
    int64_t *cursor = scratch;          /* [R * L]: next pair of each (dest, expert) */
    int64_t *row_at = scratch + R * L;  /* [R * T]: row of (dest, token), -1 none */
    memset(cursor, 0, sizeof(int64_t) * (size_t)(R * L));
    memset(pairs_per_dest, 0, sizeof(int64_t) * (size_t)R);
    memset(rows_per_dest, 0, sizeof(int64_t) * (size_t)R);
    int none = mask[me] != 0;
    int64_t num_pairs = 0;
    for (int64_t i = 0; i < T * K && !none; i++) {
        int64_t e = ids[i];
        if (e >= 0 && !mask[e / L]) {
            cursor[e]++;
            num_pairs++;
        }
    }
    for (int64_t b = 0, begin = 0; b < R * L; b++) { /* counts to first positions (e = dest * L + expert) */
        int64_t c = cursor[b];
        cursor[b] = begin;
        begin += c;
        pairs_per_dest[b / L] += c;
    }
    for (int64_t t = 0; t < T && !none; t++)
        for (int64_t j = 0; j < K; j++) {
            int64_t e = ids[t * K + j];
            if (e < 0 || mask[e / L])
                continue;
            int64_t p = cursor[e]++;
            token[p] = t, slot[p] = j, dest[p] = e / L, expert[p] = e % L;
        }
    int64_t num_rows = 0;
    if (per_pair_rows) { /* pair order, this rank's pairs last */
        for (int64_t pass = 0; pass < 2; pass++)
            for (int64_t p = 0; p < num_pairs; p++)
                if ((dest[p] == me) == (pass == 1)) {
                    row_token[num_rows] = token[p];
                    row_of_pair[p] = num_rows++;
                }
        memcpy(rows_per_dest, pairs_per_dest, sizeof(int64_t) * (size_t)R);
    } else {
        for (int64_t i = 0; i < R * T; i++)
            row_at[i] = -1;
        for (int64_t p = 0; p < num_pairs; p++)
            row_at[dest[p] * T + token[p]] = 0;
        for (int64_t q = 0; q < R; q++) {
            int64_t d = q < R - 1 ? (q < me ? q : q + 1) : me; /* remote ranks ascending, then this rank */
            for (int64_t t = 0; t < T; t++)
                if (row_at[d * T + t] == 0) {
                    row_at[d * T + t] = num_rows;
                    row_token[num_rows++] = t;
                    rows_per_dest[d]++;
                }
        }
        for (int64_t p = 0; p < num_pairs; p++)
            row_of_pair[p] = row_at[dest[p] * T + token[p]];
        if (slot_expert) {
            for (int64_t i = 0; i < num_rows * K; i++)
                slot_expert[i] = -1;
            for (int64_t p = 0; p < num_pairs; p++)
                slot_expert[row_of_pair[p] * K + slot[p]] = (int32_t)expert[p];
        }
    }
    *rows_out = num_rows;
    return num_pairs;
}

/* A dispatch row's token (int32) at token_off and its k slots' local experts (int32) at slot_off. */
static void write_fields(uint8_t *row, int64_t token, const int32_t *slots, int64_t k, int64_t token_off,
                         int64_t slot_off) {
    int32_t t = (int32_t)token;
    memcpy(row + token_off, &t, sizeof t);
    memcpy(row + slot_off, slots, sizeof(int32_t) * (size_t)k);
}

/* Dispatch rows without quantization or weights: row i of out ([n][row_bytes]) gets the data_bytes of x's row
 * row_token[i] (x: [*][data_bytes]), the token (int32) at token_off and slot_expert's row i ([n][K] int32) at
 * slot_off. */
void dep_pack(const uint8_t *x, int64_t data_bytes, const int64_t *row_token, const int32_t *slot_expert, int64_t n,
              int64_t k, uint8_t *out, int64_t row_bytes, int64_t token_off, int64_t slot_off, int streaming) {
    for (int64_t i = 0; i < n; i++) {
        uint8_t *row = out + i * row_bytes;
        if (streaming)
            copy_row(row, x + row_token[i] * data_bytes, data_bytes);
        else
            memcpy(row, x + row_token[i] * data_bytes, (size_t)data_bytes);
        write_fields(row, row_token[i], slot_expert + i * k, k, token_off, slot_off);
    }
    copies_done();
}

/* Row i of out ([n][row_bytes]) = row index[i] of x ([*][row_bytes]), with streaming stores. */
void dep_gather(const uint8_t *x, int64_t x_stride, int64_t row_bytes, const int64_t *index, int64_t n, uint8_t *out,
                int64_t out_stride) {
    for (int64_t i = 0; i < n; i++)
        copy_row(out + i * out_stride, x + index[i] * x_stride, row_bytes);
    copies_done();
}

/* The masked layout's block table from the rows placed per (local expert, source) ([L][R] int64 counts): this
 * rank's block first in each expert, then the other sources by rank. layout_range [L][R] int64 gets
 * (begin << 32) | count, recv_count [L] int32 the rows per expert. */
void dep_layout_range(const int64_t *counts, int64_t num_local, int64_t num_ranks, int64_t me, int64_t *layout_range,
                      int32_t *recv_count) {
    for (int64_t e = 0; e < num_local; e++) {
        const int64_t *c = counts + e * num_ranks;
        int64_t begin = c[me];
        layout_range[e * num_ranks + me] = c[me];
        for (int64_t s = 0; s < num_ranks; s++)
            if (s != me) {
                layout_range[e * num_ranks + s] = (begin << 32) | c[s];
                begin += c[s];
            }
        recv_count[e] = (int32_t)begin;
    }
}

/* The rows of the flattened [L * R * N] expert output that go back to each source, by (source, expert, row) (combine):
 * source s's rows of expert e are e * R * N + begin .. + count, from layout_range [L][R]; none for masked sources
 * (mask [R] uint8). rows gets them (room for L * R * N), per_src [R] their counts. Returns the number of rows, or
 * -1 - e * R - s for the first block outside [0, R * N) (nothing is trustworthy then). */
int64_t dep_return_rows(const int64_t *layout_range, int64_t num_local, int64_t num_ranks, int64_t n,
                        const uint8_t *mask, int64_t *rows, int64_t *per_src) {
    int64_t cap = num_ranks * n, k = 0;
    for (int64_t i = 0; i < num_local * num_ranks; i++) {
        int64_t begin = layout_range[i] >> 32, count = layout_range[i] & 0xFFFFFFFF;
        if (begin < 0 || begin + count > cap)
            return -1 - i;
    }
    for (int64_t s = 0; s < num_ranks; s++) {
        per_src[s] = 0;
        for (int64_t e = 0; e < num_local && !mask[s]; e++) {
            int64_t v = layout_range[e * num_ranks + s], begin = v >> 32, count = v & 0xFFFFFFFF;
            for (int64_t j = 0; j < count; j++)
                rows[k++] = e * cap + begin + j;
            per_src[s] += count;
        }
    }
    return k;
}

/* The masked placement of this rank's own pairs straight from x ([*][data_bytes]): pair i (in order) of local expert
 * expert[i] gets x's row token[i] at row pos[e] of expert e of recv ([num_local][cap][data_bytes]) and its token in
 * src_info; pos[e] and counts[e * num_ranks + src] grow. The same rows dep_place writes from packed rows of the
 * tokens, in the same order when the pairs are sorted by (expert, token). Returns 0; -1 for an expert outside
 * [0, num_local), -2 when an expert's rows would pass cap (nothing is written then). */
int dep_place_pairs(const uint8_t *x, int64_t data_bytes, const int64_t *token, const int64_t *expert, int64_t n,
                    int64_t num_local, int64_t cap, int64_t num_ranks, int64_t src, uint8_t *recv, int32_t *src_info,
                    int64_t *pos, int64_t *counts) {
    int64_t added[num_local > 0 ? num_local : 1];
    memset(added, 0, sizeof added);
    for (int64_t i = 0; i < n; i++) {
        if (expert[i] < 0 || expert[i] >= num_local)
            return -1;
        if (pos[expert[i]] + ++added[expert[i]] > cap)
            return -2;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t e = expert[i], flat = e * cap + pos[e]++;
        copy_row(recv + flat * data_bytes, x + token[i] * data_bytes, data_bytes);
        src_info[flat] = (int32_t)token[i];
        counts[e * num_ranks + src]++;
    }
    copies_done();
    return 0;
}

/* The flat (Ascend) layout's placement of dispatch rows: nb blocks, block b holding block_n[b] rows of row_bytes at
 * address block_addr[b], from source rank block_src[b]. Each pair (row, slot j whose local expert e, int32 at
 * row + slot_off + 4 j, is >= 0) gets one output row; the rows are ordered by (expert, source), pairs inside one
 * (expert, source) in block, row and slot order. Output row p gets the row's data_bytes in expand_x
 * ([cap][data_bytes]), its scale_bytes from scale_off in scales ([cap][scale_bytes]; none when scale_bytes is 0),
 * (source, token (int32 at token_off), slot) in assist[3 p .. 3 p + 2] and, with weight_off >= 0, the slot's weight
 * (fp32 at weight_off + 4 j) in expand_scales[p]. counts [num_local][num_ranks] gets the pairs per (expert, source)
 * (also when the rows do not fit). Returns the number of pairs; -1 when an expert is outside [-1, num_local) or a
 * source outside [0, num_ranks), -2 when the pairs exceed cap (then nothing but counts is written). */
int64_t dep_place_flat(const int64_t *block_addr, const int64_t *block_n, const int64_t *block_src, int64_t nb,
                       int64_t row_bytes, int64_t data_bytes, int64_t scale_off, int64_t scale_bytes, int64_t token_off,
                       int64_t slot_off, int64_t num_slots, int64_t weight_off, int64_t num_local, int64_t num_ranks,
                       int64_t cap, uint8_t *expand_x, uint8_t *scales, int32_t *assist, float *expand_scales,
                       int64_t *counts) {
    int64_t cells = num_local * num_ranks, total = 0;
    memset(counts, 0, sizeof(int64_t) * (size_t)cells);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rows = (const uint8_t *)(uintptr_t)block_addr[b];
        int64_t s = block_src[b];
        if (s < 0 || s >= num_ranks)
            return -1;
        for (int64_t i = 0; i < block_n[b]; i++)
            for (int64_t j = 0; j < num_slots; j++) {
                int32_t e = read_i32(rows + i * row_bytes + slot_off + 4 * j);
                if (e < -1 || e >= num_local)
                    return -1;
                if (e >= 0) {
                    counts[e * num_ranks + s]++;
                    total++;
                }
            }
    }
    if (total > cap)
        return -2;
    int64_t *cursor = malloc(sizeof(int64_t) * (size_t)(cells > 0 ? cells : 1));
    if (!cursor)
        return -3;
    for (int64_t c = 0, begin = 0; c < cells; c++) {
        cursor[c] = begin;
        begin += counts[c];
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rows = (const uint8_t *)(uintptr_t)block_addr[b];
        int64_t s = block_src[b];
        for (int64_t i = 0; i < block_n[b]; i++) {
            const uint8_t *row = rows + i * row_bytes;
            int32_t token = read_i32(row + token_off);
            for (int64_t j = 0; j < num_slots; j++) {
                int32_t e = read_i32(row + slot_off + 4 * j);
                if (e < 0)
                    continue;
                int64_t p = cursor[e * num_ranks + s]++;
                memcpy(expand_x + p * data_bytes, row, (size_t)data_bytes);
                if (scale_bytes)
                    memcpy(scales + p * scale_bytes, row + scale_off, (size_t)scale_bytes);
                assist[3 * p] = (int32_t)s, assist[3 * p + 1] = token, assist[3 * p + 2] = (int32_t)j;
                if (weight_off >= 0)
                    memcpy(expand_scales + p, row + weight_off + 4 * j, sizeof(float));
            }
        }
    }
    free(cursor);
    return total;
}

/* Row values as fp32 (v, `hidden` of them) from `dtype` data. */
#define TO_F32(name, type, load)                                                                        \
    WIDE static void to_f32_##name(float *restrict v, const type *restrict x, int64_t n) {             \
        for (int64_t h = 0; h < n; h++)                                                                \
            v[h] = load(x[h]);                                                                         \
    }
TO_F32(f32, float, load_f32)
TO_F32(bf16, uint16_t, load_bf16)
#ifdef __FLT16_MAX__
TO_F32(f16, _Float16, load_f16)
#endif

/* A row of `hidden` values of `dtype` as fp32 (exact). */
static void row_to_f32(float *v, const uint8_t *x, int dtype, int64_t hidden) {
    if (dtype == DTYPE_BF16)
        to_f32_bf16(v, (const uint16_t *)x, hidden);
    else if (dtype == DTYPE_F32)
        to_f32_f32(v, (const float *)x, hidden);
#ifdef __FLT16_MAX__
    else
        to_f32_f16(v, (const _Float16 *)x, hidden);
#endif
}

/* max |v| over n values, NaN when one is NaN (magnitudes compare as their bits: NaN's are above Inf's). */
WIDE static float abs_max(const float *restrict v, int64_t n) {
    const uint32_t *bits = (const uint32_t *)v;
    uint32_t top = 0;
    for (int64_t h = 0; h < n; h++) {
        uint32_t m = bits[h] & 0x7FFFFFFFu;
        top = m > top ? m : top;
    }
    float amax;
    memcpy(&amax, &top, sizeof amax);
    return top > 0x7F800000u ? __builtin_nanf("") : amax;
}

/* q = int8(clamp(nan_to_0(rint(v * inv)), -127, 127)), ties to even. */
WIDE static void to_int8(int8_t *restrict q, const float *restrict v, float inv, int64_t n) {
    for (int64_t h = 0; h < n; h++) {
        float r = __builtin_rintf(v[h] * inv);
        r = r != r ? 0.0f : r;
        r = r < -127.0f ? -127.0f : r;
        r = r > 127.0f ? 127.0f : r;
        q[h] = (int8_t)r;
    }
}

/* One quantized dispatch row: v's `hidden` fp32 values as data and scales (at scale_off) into row. Returns 0, or -4
 * when the row's scale is the torch code's to write (a NaN, for fp8 also an Inf: which NaN bits, torch chooses). */
typedef int (*QuantRow)(uint8_t *row, const float *v, int64_t hidden, int64_t scale_off);

/* The loop of the quantizing packers: row i of out ([n][row_bytes]) gets quant() of x's row row_token[i] as fp32,
 * the token (int32) at token_off, slot_expert's row i ([n][k] int32) at slot_off and, when weights ([n][k] fp32) is
 * given, its row i at weight_off. Returns 0; -2 for a dtype this build lacks, -3 out of memory, or quant's -4 (rows
 * written so far are partial: the caller runs the torch code). */
static int pack_quantized(QuantRow quant, const uint8_t *x, int dtype, int64_t hidden, const int64_t *row_token,
                          const int32_t *slot_expert, const float *weights, int64_t n, int64_t k, uint8_t *out,
                          int64_t row_bytes, int64_t scale_off, int64_t token_off, int64_t slot_off,
                          int64_t weight_off) {
    if (!dep_has_dtype(dtype))
        return -2;
    int64_t item = dtype == DTYPE_F32 ? 4 : 2;
    float *v = malloc(sizeof(float) * (size_t)(hidden > 0 ? hidden : 1));
    if (!v)
        return -3;
    int rc = 0;
    for (int64_t i = 0; i < n && rc == 0; i++) {
        uint8_t *row = out + i * row_bytes;
        row_to_f32(v, x + row_token[i] * hidden * item, dtype, hidden);
        rc = quant(row, v, hidden, scale_off);
        if (rc == 0)
            write_fields(row, row_token[i], slot_expert + i * k, k, token_off, slot_off);
        if (rc == 0 && weights)
            memcpy(row + weight_off, weights + i * k, sizeof(float) * (size_t)k);
    }
    free(v);
    return rc;
}

/* Per-token int8: amax = max |v| (NaN: -4), data int8(clamp(nan_to_0(rint(v * (127 / amax))), -127, 127)) (the
 * factor 0 unless amax > 0), one fp32 scale amax / 127. */
static int quant_int8_row(uint8_t *row, const float *v, int64_t hidden, int64_t scale_off) {
    float amax = abs_max(v, hidden);
    if (amax != amax)
        return -4;
    to_int8((int8_t *)row, v, amax > 0.0f ? 127.0f / amax : 0.0f, hidden);
    float scale = amax / 127.0f;
    memcpy(row + scale_off, &scale, sizeof scale);
    return 0;
}

/* Dispatch rows with per-token dynamic int8 quantization (Ascend quant_mode 2, no smoothing): row i of out
 * ([n][row_bytes]) gets q = int8(clamp(nan_to_0(rint(v * (127 / amax))), -127, 127)) of x's row row_token[i] (v: its
 * `hidden` values of `dtype` as fp32; amax = max |v|, NaN when a value is NaN; the factor is 0 unless amax > 0), the
 * scale amax / 127 (fp32) at scale_off, the token (int32) at token_off, slot_expert's row i ([n][k] int32) at
 * slot_off and, when weights ([n][k] fp32) is given, its row i at weight_off. The torch code's roundings: true
 * fp32 divisions, one fp32 product per value, ties to even. Returns 0; -2 for a dtype this build lacks, -3 out of
 * memory, -4 for a row holding NaN (rows written so far are partial: the caller runs the torch code). */
int dep_pack_int8(const uint8_t *x, int dtype, int64_t hidden, const int64_t *row_token, const int32_t *slot_expert,
                  const float *weights, int64_t n, int64_t k, uint8_t *out, int64_t row_bytes, int64_t scale_off,
                  int64_t token_off, int64_t slot_off, int64_t weight_off) {
    return pack_quantized(quant_int8_row, x, dtype, hidden, row_token, slot_expert, weights, n, k, out, row_bytes,
                          scale_off, token_off, slot_off, weight_off);
}

/* The masked layout's scales of placed pairs: pair i (row pair_row[i] of rows ([*][row_bytes]), flat position
 * pair_pos[i] = e * cap + p) gets its row's fp32 scales at scale_off in out ([num_local][groups][cap] fp32, token
 * dimension innermost as DeepEP's): groups of them, or with repeat the row's one scale in every group. */
void dep_place_scales(const uint8_t *rows, int64_t row_bytes, int64_t scale_off, const int64_t *pair_row,
                      const int64_t *pair_pos, int64_t k, float *out, int64_t cap, int64_t groups, int repeat) {
    for (int64_t i = 0; i < k; i++) {
        const uint8_t *src = rows + pair_row[i] * row_bytes + scale_off;
        int64_t e = pair_pos[i] / cap, p = pair_pos[i] % cap;
        for (int64_t g = 0; g < groups; g++)
            memcpy(out + (e * groups + g) * cap + p, src + (repeat ? 0 : 4 * g), sizeof(float));
    }
}

/* float to float8 e4m3fn (4 exponent bits, bias 7, 3 mantissa bits, no infinities, 0x7F / 0xFF NaN), rounding to
 * nearest, ties to even, as torch's cast: NaN stays NaN (its sign kept), magnitudes from 448 (the largest finite)
 * on, infinities included, saturate to +-448. Branch-free (masks), so that loops over it vectorize. */
static inline uint8_t to_e4m3(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    uint32_t sign = (b >> 24) & 0x80u, u = b & 0x7FFFFFFFu;
    /* below 2^-6 (the smallest normal) the values are multiples of 2^-9: adding 2^14 (ulp 2^-9) rounds |f| to one,
     * ties to even, and its bits minus those of 2^14 count them (8 of them is 2^-6 itself, the next code) */
    uint32_t capped = u < 0x3C800000u ? u : 0x3C800000u;
    float small;
    memcpy(&small, &capped, sizeof small);
    float grid = small + 16384.0f;
    uint32_t sub;
    memcpy(&sub, &grid, sizeof sub);
    sub -= 0x46800000u;
    /* normal: round away the low 20 mantissa bits (ties to even), exponent bias 127 -> 7 */
    uint32_t normal = (u + 0x7FFFFu + ((u >> 20) & 1u) - ((uint32_t)(127 - 7) << 23)) >> 20;
    uint32_t is_sub = 0u - (uint32_t)(u < 0x3C800000u), is_big = 0u - (uint32_t)(u >= 0x43E00000u);
    uint32_t is_nan = 0u - (uint32_t)(u > 0x7F800000u);
    uint32_t q = (sub & is_sub) | (normal & ~is_sub);
    q = (0x7Eu & is_big) | (q & ~is_big);
    q = (0x7Fu & is_nan) | (q & ~is_nan);
    return (uint8_t)(sign | q);
}

/* q = e4m3(clamp(w / scale, -448, 448)) for n values (no NaN among them). */
WIDE static void to_e4m3_scaled(uint8_t *restrict q, const float *restrict w, float scale, int64_t n) {
    for (int64_t h = 0; h < n; h++) {
        float t = w[h] / scale;
        t = t < -448.0f ? -448.0f : t;
        t = t > 448.0f ? 448.0f : t;
        q[h] = to_e4m3(t);
    }
}

/* DeepEP's fp8 per 128 channels: per group, amax = max |v| (NaN or Inf: -4) clamped to >= 1e-4, scale_inv =
 * amax / 448, data e4m3(clamp(v / scale_inv, -448, 448)), the fp32 scale_inv at scale_off + 4 * group. */
static int quant_fp8_row(uint8_t *row, const float *v, int64_t hidden, int64_t scale_off) {
    for (int64_t g = 0; g < hidden / 128; g++) {
        const float *w = v + 128 * g;
        float amax = abs_max(w, 128);
        if (!(amax <= 3.4028235e38f))
            return -4;
        amax = amax < 1e-4f ? 1e-4f : amax;
        float scale = amax / 448.0f;
        to_e4m3_scaled(row + 128 * g, w, scale, 128);
        memcpy(row + scale_off + 4 * g, &scale, sizeof scale);
    }
    return 0;
}

/* Dispatch rows in DeepEP's fp8 (per 128 channels, scales not rounded): for each group of x's row row_token[i]
 * (values v as fp32, from `dtype`), amax = max |v| clamped to >= 1e-4, scale_inv = amax / 448; the data is
 * e4m3(clamp(v / scale_inv, -448, 448)) and the scale_inv (fp32, one per group) goes to scale_off; then the token
 * (int32) at token_off and slot_expert's row i ([n][k] int32) at slot_off. The torch code's roundings: true fp32
 * divisions, one cast. Returns 0; -2 for a dtype this build lacks; -3 out of memory; -4 for a group holding NaN or
 * Inf (rows written so far are partial: the caller runs the torch code, whose NaN bits are its own). */
int dep_pack_fp8(const uint8_t *x, int dtype, int64_t hidden, const int64_t *row_token, const int32_t *slot_expert,
                 int64_t n, int64_t k, uint8_t *out, int64_t row_bytes, int64_t scale_off, int64_t token_off,
                 int64_t slot_off) {
    return pack_quantized(quant_fp8_row, x, dtype, hidden, row_token, slot_expert, NULL, n, k, out, row_bytes,
                          scale_off, token_off, slot_off, 0);
}

/* e4m3fn bytes of n floats (the cast alone, for tests). */
void dep_to_e4m3(const float *x, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; i++)
        out[i] = to_e4m3(x[i]);
}
