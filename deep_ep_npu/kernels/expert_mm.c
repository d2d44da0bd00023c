/* The bf16 expert matmul of the grouped layout (see kernels.expert_mm): y[r] = x[r] @ w[e]^T for the rows r of each
 * expert e, fp32 sums rounded once to bf16. It exists because decode reads each expert's weights for one to a few
 * rows: the step is a weights read, and a weights read wants one sequential stream per thread, which
 * torch's grouped / per-expert matmuls do not give on the CPU (they read at ~half the rate; benchmarks/bench_decode.py).
 * Each thread walks a contiguous range of weight rows (K contiguous values each) once, front to back, and takes the
 * dot product of each with every row of its expert: four fp32 accumulators per x row (columns k mod 128 in four
 * 32-wide lanes), AVX512-BF16 `vdpbf16ps`, then one horizontal sum. Only the AVX512-BF16 build exists: elsewhere
 * dep_expert_mm returns 0 (not done) and the caller keeps torch's matmul. */
#include <pthread.h>
#include <string.h>

#include "loops.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(DEP_X86_64_V4)
#include <immintrin.h>

#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define MAX_THREADS 64
#ifndef MIN_THREAD_BYTES
#define MIN_THREAD_BYTES (4 << 20)
#endif

static inline uint16_t round_bf16(float f) { /* round to nearest even; a NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

typedef struct {
    const uint16_t *x, *w;
    uint16_t *y;
    const int32_t *offs;
    int64_t N, K, begin, end; /* weight rows [begin, end) of the flattened [E * N] */
} Job;

BF16 static inline __m512bh lanes(const uint16_t *p, int64_t left) {
    __mmask32 m = left >= 32 ? (__mmask32)~0u : (((__mmask32)1 << left) - 1);
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

/* One weight row w [K] against the rows x [rows][K]: y[q * N] for each row q. Two x rows share each weight load. */
BF16 static void weight_row(const uint16_t *w, int64_t K, const uint16_t *x, int64_t rows, uint16_t *y, int64_t N) {
    for (int64_t r = 0; r < rows; r += 2) {
        const uint16_t *x0 = x + r * K, *x1 = x + (r + (rows - r > 1)) * K;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int64_t k = 0;
        for (; k + 128 <= K; k += 128) {
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
            __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + k + 64), w3 = (__m512bh)_mm512_loadu_si512(w + k + 96);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x0 + k), w0);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x0 + k + 32), w1);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(x0 + k + 64), w2);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(x0 + k + 96), w3);
            b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_loadu_si512(x1 + k), w0);
            b1 = _mm512_dpbf16_ps(b1, (__m512bh)_mm512_loadu_si512(x1 + k + 32), w1);
            b2 = _mm512_dpbf16_ps(b2, (__m512bh)_mm512_loadu_si512(x1 + k + 64), w2);
            b3 = _mm512_dpbf16_ps(b3, (__m512bh)_mm512_loadu_si512(x1 + k + 96), w3);
        }
        for (; k < K; k += 32) {
            __m512bh wv = lanes(w + k, K - k);
            a0 = _mm512_dpbf16_ps(a0, lanes(x0 + k, K - k), wv);
            b0 = _mm512_dpbf16_ps(b0, lanes(x1 + k, K - k), wv);
        }
        y[r * N] = round_bf16(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))));
        if (rows - r > 1)
            y[(r + 1) * N] = round_bf16(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3))));
    }
}

static void run(const Job *j) {
    for (int64_t t = j->begin; t < j->end;) {
        int64_t e = t / j->N, n = t % j->N, r0 = e ? j->offs[e - 1] : 0, r1 = j->offs[e];
        int64_t stop = (e + 1) * j->N < j->end ? (e + 1) * j->N : j->end;
        for (; r1 > r0 && t < stop; t++, n++)
            weight_row(j->w + t * j->K, j->K, j->x + r0 * j->K, r1 - r0, j->y + r0 * j->N + n, j->N);
        t = stop;
    }
}

static void *thread_main(void *job) {
    run((const Job *)job);
    return NULL;
}

int dep_expert_mm(const uint16_t *x, const uint16_t *w, uint16_t *y, const int32_t *offs, int64_t E, int64_t N,
                  int64_t K, int64_t threads) {
    if (!__builtin_cpu_supports("avx512bf16"))
        return 0;
    int64_t active = 0; /* the weight rows of experts with rows, split evenly over the threads */
    for (int64_t e = 0; e < E; e++)
        active += offs[e] > (e ? offs[e - 1] : 0) ? N : 0;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    /* a thread is worth its start (~0.1 ms in a VM) from MIN_THREAD_BYTES of weights on (~0.2 ms of reading) */
    int64_t fit = active * K * 2 / MIN_THREAD_BYTES;
    threads = fit < threads ? (fit < 1 ? 1 : fit) : threads;
    Job jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int64_t t = 0, seen = 0;
    for (int64_t i = 0; i < threads; i++) {
        int64_t begin = t, goal = active * (i + 1) / threads;
        while (t < E * N && seen < goal) {
            int64_t e = t / N, take = N - t % N;
            if (offs[e] > (e ? offs[e - 1] : 0)) {
                take = take < goal - seen ? take : goal - seen;
                seen += take;
            }
            t += take;
        }
        jobs[i] = (Job){x, w, y, offs, N, K, begin, i == threads - 1 ? E * N : t};
    }
    int64_t started = 1;
    for (; started < threads; started++)
        if (pthread_create(&tids[started], NULL, thread_main, &jobs[started]) != 0)
            break;
    for (int64_t i = started; i < threads; i++) /* no thread left: run the rest here */
        run(&jobs[i]);
    run(&jobs[0]);
    for (int64_t i = 1; i < started; i++)
        pthread_join(tids[i], NULL);
    return 1;
}
#else
int dep_expert_mm(const uint16_t *x, const uint16_t *w, uint16_t *y, const int32_t *offs, int64_t E, int64_t N,
                  int64_t K, int64_t threads) {
    (void)x, (void)w, (void)y, (void)offs, (void)E, (void)N, (void)K, (void)threads;
    return 0;
}
#endif
