/* The bf16 expert matmul of the grouped layout (see kernels.expert_mm): y[r] = x[r] @ w[e]^T for the rows r of each
 * expert e, fp32 sums rounded once to bf16. It exists because decode reads each expert's weights for one to a few
 * rows: the step is a weights read, and a weights read wants one sequential stream per thread, which torch's grouped /
 * per-expert matmuls do not give on the CPU (they read at ~half the rate; benchmarks/bench_decode.py).
 * Each thread walks a contiguous range of weight rows (K contiguous values each) once, front to back, and takes the
 * dot product of each with every row of its expert: four fp32 accumulators per x row (columns k mod 128 in four
 * 32-wide lanes), AVX512-BF16 `vdpbf16ps`, then one horizontal sum. Experts with more than max_rows rows are
 * skipped (their output rows are left as they are): there a blocked matmul (torch's, oneDNN) is compute-bound and
 * faster. Only the AVX512-BF16 build exists: elsewhere
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

typedef struct {
    const uint16_t *x, *w;
    uint16_t *y;
    const int32_t *offs;
    int64_t N, K, begin, end; /* weight rows [begin, end) of the flattened [E * N] */
    int64_t max_rows;         /* experts with more rows are left to the caller */
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
        y[r * N] = dep_f32_bf16(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))));
        if (rows - r > 1)
            y[(r + 1) * N] =
                dep_f32_bf16(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3))));
    }
}

static void run(const Job *j) {
    for (int64_t t = j->begin; t < j->end;) {
        int64_t e = t / j->N, n = t % j->N, r0 = e ? j->offs[e - 1] : 0, r1 = j->offs[e];
        int64_t stop = (e + 1) * j->N < j->end ? (e + 1) * j->N : j->end;
        for (; r1 > r0 && r1 - r0 <= j->max_rows && t < stop; t++, n++)
            weight_row(j->w + t * j->K, j->K, j->x + r0 * j->K, r1 - r0, j->y + r0 * j->N + n, j->N);
        t = stop;
    }
}

/* The helper threads, started on first use and kept (a thread's start costs ~50-80 us in a VM, a wake-up less): a call
 * hands jobs 1.. to helpers 1.. and runs job 0 itself. One call at a time uses them; a concurrent call runs alone. A
 * forked child starts with none. */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER, call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_go = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static int64_t pool_size, pool_round, pool_left, pool_n, pool_seen0[MAX_THREADS];
static const Job *pool_jobs;
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void pool_after_fork(void) {
    pthread_mutex_init(&pool_mu, NULL), pthread_mutex_init(&call_mu, NULL);
    pthread_cond_init(&pool_go, NULL), pthread_cond_init(&pool_done, NULL);
    pool_size = 0;
}

static void pool_register(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

static void *pool_main(void *arg) {
    int64_t me = (int64_t)(intptr_t)arg;
    pthread_mutex_lock(&pool_mu);
    for (int64_t seen = pool_seen0[me];; seen = pool_round) {
        while (pool_round == seen)
            pthread_cond_wait(&pool_go, &pool_mu);
        if (me < pool_n) {
            const Job *job = &pool_jobs[me];
            pthread_mutex_unlock(&pool_mu);
            run(job);
            pthread_mutex_lock(&pool_mu);
            if (--pool_left == 0)
                pthread_cond_signal(&pool_done);
        }
    }
    return NULL;
}

/* Runs jobs[0 .. n) on this thread and the helpers, returning when all are done. */
static void run_all(const Job *jobs, int64_t n) {
    int64_t shared = 1, pooled = n > 1 && pthread_mutex_trylock(&call_mu) == 0;
    if (pooled) {
        pthread_once(&pool_once, pool_register);
        pthread_mutex_lock(&pool_mu);
        for (pthread_t tid; pool_size + 1 < n; pool_size++) {
            pool_seen0[pool_size + 1] = pool_round;
            if (pthread_create(&tid, NULL, pool_main, (void *)(intptr_t)(pool_size + 1)) != 0)
                break;
            pthread_detach(tid);
        }
        shared = pool_size + 1 < n ? pool_size + 1 : n;
        pool_left = shared - 1;
        pool_jobs = jobs, pool_n = shared;
        pool_round++;
        pthread_cond_broadcast(&pool_go);
        pthread_mutex_unlock(&pool_mu);
    }
    for (int64_t i = shared; i < n; i++) /* no helper for these: run them here */
        run(&jobs[i]);
    run(&jobs[0]);
    if (pooled) {
        pthread_mutex_lock(&pool_mu);
        while (pool_left > 0)
            pthread_cond_wait(&pool_done, &pool_mu);
        pthread_mutex_unlock(&pool_mu);
        pthread_mutex_unlock(&call_mu);
    }
}

/* An expert this call multiplies: one with rows, at most max_rows of them. */
static int mine(const int32_t *offs, int64_t e, int64_t max_rows) {
    int64_t rows = offs[e] - (e ? offs[e - 1] : 0);
    return rows > 0 && rows <= max_rows;
}

int dep_expert_mm(const uint16_t *x, const uint16_t *w, uint16_t *y, const int32_t *offs, int64_t E, int64_t N,
                  int64_t K, int64_t threads, int64_t max_rows) {
    if (!__builtin_cpu_supports("avx512bf16"))
        return 0;
    int64_t active = 0; /* the weight rows of the experts multiplied here, split evenly over the threads */
    for (int64_t e = 0; e < E; e++)
        active += mine(offs, e, max_rows) ? N : 0;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    /* a thread is worth its wake-up and its share of the split from MIN_THREAD_BYTES of weights (~0.2 ms of reading) */
    int64_t fit = active * K * 2 / MIN_THREAD_BYTES;
    threads = fit < threads ? (fit < 1 ? 1 : fit) : threads;
    Job jobs[MAX_THREADS];
    int64_t t = 0, seen = 0;
    for (int64_t i = 0; i < threads; i++) {
        int64_t begin = t, goal = active * (i + 1) / threads;
        while (t < E * N && seen < goal) {
            int64_t e = t / N, take = N - t % N;
            if (mine(offs, e, max_rows)) {
                take = take < goal - seen ? take : goal - seen;
                seen += take;
            }
            t += take;
        }
        jobs[i] = (Job){x, w, y, offs, N, K, begin, i == threads - 1 ? E * N : t, max_rows};
    }
    run_all(jobs, threads);
    return 1;
}
#else
int dep_expert_mm(const uint16_t *x, const uint16_t *w, uint16_t *y, const int32_t *offs, int64_t E, int64_t N,
                  int64_t K, int64_t threads, int64_t max_rows) {
    (void)x, (void)w, (void)y, (void)offs, (void)E, (void)N, (void)K, (void)threads, (void)max_rows;
    return 0;
}
#endif
