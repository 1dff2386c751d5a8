/* One-token decode products y = W x (+ b) on the CPU: the bandwidth-bound heart of a decode step.
 *
 * Built at first use by infer/kernels/native.py with the machine's own compiler for the machine's own CPU
 * (-march=native), so the preprocessor picks the widest path it has:
 *   AVX512-BF16  bf16 pairs multiplied and summed into fp32 by one instruction (vdpbf16ps);
 *   AVX512F      bf16 widened to fp32 by a shift, fp32 FMAs (fp16 by vcvtph2ps);
 *   AVX2 + FMA   the same with 256-bit vectors (the AMD EPYCs without bf16 units);
 *   generic      plain C, whatever the compiler makes of it.
 * Each thread streams one contiguous range of rows, one row after the other, with a software prefetch a
 * fixed distance ahead: a single linear stream per core is what the prefetchers keep at full read
 * bandwidth (measured on a 2-core Xeon: 32 GB/s, against 28 GB/s for ATen's bf16 torch.mv). Every output is
 * its own row's fp32 sum, rounded once to the weights' dtype (round to nearest even), so an output does
 * not depend on how many rows a call holds: fused projections give the separate products' bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };
#define PREFETCH_BYTES 2048 /* how far ahead of the loads each thread prefetches; tuned on a Xeon and an EPYC */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#endif

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
static const char ISA[] = "avx512_bf16";
#elif defined(HAVE_AVX512)
static const char ISA[] = "avx512f";
#elif defined(__AVX2__) && defined(__FMA__)
static const char ISA[] = "avx2";
#else
static const char ISA[] = "generic";
#endif

/* ---- scalar conversions (round to nearest even, NaN kept quiet) ---- */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past the largest half: inf */
    if (a < 0x38800000u) { /* subnormal half (or zero): round the shifted mantissa to nearest even */
        if (a < 0x33000000u) return (uint16_t)sign;
        uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t h = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a >> 13) - (112u << 10)), rest = a & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static inline float load_scalar(int dtype, const void *p, int64_t i) {
    if (dtype == BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dtype == F16) return f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline void store_scalar(int dtype, void *p, int64_t i, float v) {
    if (dtype == BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else if (dtype == F16) ((uint16_t *)p)[i] = f32_to_f16(v);
    else ((float *)p)[i] = v;
}

/* Where the streams' software prefetches land: 1 the L1 cache (prefetcht0), 2 the L2 (prefetcht1). Which is
 * faster depends on the machine: on a 2-core EPYC (Zen 4) into L2 streamed the GEMV's weights at 27.6 GB/s against
 * 23.7 and the few-row product at 4 rows 35% faster (engine decode steps of 1-8 rows 1.13-1.44x); 16 rows and
 * more, and the paged attention inside a step, did not change. infer.tuning.choose_prefetch times it per machine;
 * a prefetch changes no result. The paged attention's stream (kv_stream) prefetches into L2 whatever the level, and
 * so do the few-row products' tiles (gemm_tile_bf16):
 * their lines are read a tile later, after x's rows have streamed through L1, so an L1 prefetch is evicted first on
 * any machine. */
static int prefetch_level = 1;

void infer_set_prefetch(int level) { prefetch_level = level == 2 ? 2 : 1; }

int infer_prefetch_level(void) { return prefetch_level; }

static inline void prefetch(const void *p) {
#if defined(__GNUC__)
    if (prefetch_level == 2) __builtin_prefetch(p, 0, 2);
    else __builtin_prefetch(p, 0, 3);
#else
    (void)p;
#endif
}

/* ---- one row's dot product, per instruction set ----
 * dot_bf16: both operands bf16 (the AVX512-BF16 path); dot_wide: x already widened to fp32 once per call
 * (every other path), w converted as it streams. Each cache line of w is prefetched PREFETCH_BYTES ahead of its
 * load; the pair path sums alternate lines into two registers (one sum waits on the instruction's latency: 63-75
 * GB/s on a 2-core EPYC, 79-84 with two).
 */

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
#define HAVE_DOT_BF16 1
static float dot_bf16(const uint16_t *w, const uint16_t *x, int64_t k) {
    const char *bytes = (const char *)w;
    __m512 acc = _mm512_setzero_ps(), other = _mm512_setzero_ps(); /* two sums: the pair instruction's latency */
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        prefetch(bytes + 2 * i + PREFETCH_BYTES);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
        prefetch(bytes + 2 * i + 64 + PREFETCH_BYTES);
        other = _mm512_dpbf16_ps(other, (__m512bh)_mm512_loadu_si512(w + i + 32),
                                 (__m512bh)_mm512_loadu_si512(x + i + 32));
    }
    acc = _mm512_add_ps(acc, other);
    for (; i + 32 <= k; i += 32) {
        prefetch(bytes + 2 * i + PREFETCH_BYTES);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
    }
    if (i < k) {
        __mmask32 m = (__mmask32)((1u << (k - i)) - 1);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, w + i),
                               (__m512bh)_mm512_maskz_loadu_epi16(m, x + i));
    }
    return _mm512_reduce_add_ps(acc);
}
#endif

#if defined(HAVE_AVX512)
static inline __m512 load16(int dtype, const void *p, int64_t i, __mmask16 m) {
    if (dtype == F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    if (dtype == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static float dot_wide(int dtype, const void *w, const float *x, int64_t k) {
    const char *bytes = (const char *)w;
    int64_t esize = dtype == F32 ? 4 : 2, step = 64 / esize, i = 0;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; i + step <= k; i += step) {
        prefetch(bytes + esize * i + PREFETCH_BYTES);
        a0 = _mm512_fmadd_ps(load16(dtype, w, i, 0xffff), _mm512_loadu_ps(x + i), a0);
        if (step == 32) a1 = _mm512_fmadd_ps(load16(dtype, w, i + 16, 0xffff), _mm512_loadu_ps(x + i + 16), a1);
    }
    for (; i < k; i += 16) {
        __mmask16 m = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        a0 = _mm512_fmadd_ps(load16(dtype, w, i, m), _mm512_maskz_loadu_ps(m, x + i), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(int dtype, const void *p, int64_t i) {
    if (dtype == F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
#if defined(__F16C__)
    if (dtype == F16) return _mm256_cvtph_ps(h);
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static float dot_wide(int dtype, const void *w, const float *x, int64_t k) {
    const char *bytes = (const char *)w;
    int64_t esize = dtype == F32 ? 4 : 2, step = 64 / esize, i = 0;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = a0, a3 = a0;
    for (; i + step <= k; i += step) {
        prefetch(bytes + esize * i + PREFETCH_BYTES);
        a0 = _mm256_fmadd_ps(load8(dtype, w, i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(load8(dtype, w, i + 8), _mm256_loadu_ps(x + i + 8), a1);
        if (step == 32) {
            a2 = _mm256_fmadd_ps(load8(dtype, w, i + 16), _mm256_loadu_ps(x + i + 16), a2);
            a3 = _mm256_fmadd_ps(load8(dtype, w, i + 24), _mm256_loadu_ps(x + i + 24), a3);
        }
    }
    float sum = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; i++) sum += load_scalar(dtype, w, i) * x[i];
    return sum;
}

#else
static float dot_wide(int dtype, const void *w, const float *x, int64_t k) {
    float sum = 0.f;
    for (int64_t i = 0; i < k; i++) sum += load_scalar(dtype, w, i) * x[i];
    return sum;
}
#endif

/* ---- entry points ---- */

/* Whether the fast path an environment variable names is on: anything but a leading '0' (the tests run both). */
static int switched_on(const char *name) {
    const char *v = getenv(name);
    return !(v && v[0] == '0');
}

/* This OpenMP thread's rows [r0, r1) of n: contiguous ranges in whole 16-row blocks, so no two threads share a
 * cache line of y. */
static inline void thread_rows(int64_t n, int64_t *r0, int64_t *r1) {
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    int64_t blocks = (n + 15) / 16;
    *r0 = blocks * t / nt * 16;
    *r1 = blocks * (t + 1) / nt * 16;
    if (*r1 > n) *r1 = n;
}

/* Work items [0, count) shared by the threads of a region, in contiguous ranges, one per thread (front | back << 32,
 * a cache line each): a thread takes its own range from the front, in order (its weights streamed and prefetched
 * ahead as with a static split), then, its range spent, the others' last items from their backs. On a shared 2-vCPU
 * host the two threads ran equal halves of a product up to 1.2x apart, and the faster one waited at the region's end
 * (an OpenMP barrier spin, a fifth of a worker thread's samples over prefill steps). INFER_BALANCE=0: no taking from
 * the others' backs, the static split (the check: each item is computed the same whoever takes it). */
typedef struct {
    uint64_t v;
    char pad[56];
} work_range;

/* `groups` sets of `threads` ranges over [0, count) (NULL without memory). */
static work_range *work_ranges(int64_t groups, int threads, int64_t count) {
    work_range *r = (work_range *)aligned_alloc(64, sizeof(work_range) * (size_t)(groups * threads));
    for (int64_t g = 0; r && g < groups; g++)
        for (int t = 0; t < threads; t++)
            r[g * threads + t].v = (uint64_t)(count * t / threads) | (uint64_t)(count * (t + 1) / threads) << 32;
    return r;
}

/* Takes from range r: from its front, a quarter of what is left (at least one item: few atomic instructions per
 * range, each of which waits for this thread's stores to drain), or from its back, one item. The first item taken
 * (the rest up to *end follow it), or -1 where the range is spent. */
static inline int64_t work_take(work_range *r, int back, int64_t *end) {
    uint64_t cur = __atomic_load_n(&r->v, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t front = cur & 0xffffffffu, last = cur >> 32;
        if (front >= last) return -1;
        uint64_t take = back ? 1 : (last - front + 3) / 4;
        uint64_t next = back ? front | (last - 1) << 32 : (front + take) | last << 32;
        if (__atomic_compare_exchange_n(&r->v, &cur, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *end = (int64_t)(back ? last : front + take);
            return (int64_t)(back ? last - 1 : front);
        }
    }
}

/* This thread's walk over one set of `nr` ranges of [0, count): the fronts of its own (range t, and t + team, ...
 * where the team came out smaller than the ranges asked for), then (balance) the others' backs. */
typedef struct {
    work_range *r;
    int64_t count, next, end, lo, hi; /* next .. end: taken, not yet walked; lo .. hi: their range as set out */
    int nr, t, team, balance, own, other, back;
} work_walk;

/* INFER_BALANCE: 1 (unset) the others' backs taken once a range is spent, 0 never, 2 first (see work_next). */
static int work_balance(void) {
    const char *v = getenv("INFER_BALANCE");
    return v && v[0] == '0' ? 0 : v && v[0] == '2' ? 2 : 1;
}

static inline work_walk work_start(work_range *r, int nr, int64_t count, int balance) {
    work_walk w = {r, count, 0, 0, 0, 0, nr, 0, 1, balance, 0, 1, 0};
#ifdef _OPENMP
    w.t = w.own = omp_get_thread_num();
    w.team = omp_get_num_threads();
#endif
    return w;
}

/* The walk's next items from the front of its own ranges (back 0) or the back of the others' (back 1): the first,
 * or -1 where they are spent; *at the range it came from. */
static inline int64_t work_walk_take(work_walk *w, int back, int *at) {
    int *cursor = back ? &w->other : &w->own;
    while (*cursor < w->nr) {
        *at = back ? (w->t + *cursor) % w->nr : *cursor;
        int64_t i = work_take(w->r + *at, back, &w->end);
        if (i >= 0) {
            w->back = back;
            return i;
        }
        *cursor += back ? 1 : w->team;
    }
    return -1;
}

/* The next item of the walk, -1 when none is left. Balance 2 (INFER_BALANCE=2, the tests' check of the taking from
 * the backs) takes the others' backs first. */
static inline int64_t work_next(work_walk *w) {
    if (w->next < w->end) return w->next++;
    int at = -1;
    int64_t i = w->balance == 2 ? work_walk_take(w, 1, &at) : -1;
    if (i < 0) i = work_walk_take(w, 0, &at);
    if (i < 0 && w->balance == 1) i = work_walk_take(w, 1, &at);
    if (i < 0) return -1;
    w->next = i + 1;
    w->lo = w->count * at / w->nr;
    w->hi = w->count * (at + 1) / w->nr;
    return i;
}

/* Blocks from .. to of the item (`per_item` blocks each) `ahead` items further along the walk than `item` (forwards
 * from a front, backwards from a back), for prefetching; empty (blocks .. blocks) past the range it came from. */
static inline void work_ahead(const work_walk *w, int64_t item, int64_t ahead, int64_t per_item, int64_t blocks,
                              int64_t *from, int64_t *to) {
    int64_t next = w->back ? item - ahead : item + ahead;
    *from = next >= w->lo && next < w->hi && per_item * next < blocks ? per_item * next : blocks;
    *to = *from + per_item < blocks ? *from + per_item : blocks;
}

/* A one-row product's blocks of 16 output rows shared by its threads (work_range: each its own from the front, then
 * the others' from the back; INFER_BALANCE=0 the static split): a row's value is the same whoever computes it. On
 * this shared 2-vCPU host the static halves left one thread spinning at the region's end (23% of a decode profile in
 * libgomp, 11% shared). `ranges` NULL without memory. */
typedef struct {
    work_range *ranges;
    int64_t items;
    int nr, balance;
} row_blocks;

static row_blocks share_row_blocks(int64_t n, int threads) {
    row_blocks rb = {NULL, (n + 15) / 16, threads > 1 ? threads : 1, work_balance()};
    rb.ranges = work_ranges(1, rb.nr, rb.items);
    return rb;
}

/* The instruction-set path this build took. */
const char *infer_isa(void) { return ISA; }

/* Whether the many-row small ops (infer_rms_norm over rows, infer_rope_rows, infer_gated_rows) run 16 (AVX512) or 8
 * (AVX2) lanes at a time on bf16 here. */
int infer_rows_vectorized(void) {
#if defined(HAVE_AVX512) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

/* Whether this build computes `dtype` (fp16 needs hardware conversions on x86 without AVX512). */
int infer_supports(int dtype) {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(HAVE_AVX512) && !defined(__F16C__)
    if (dtype == F16) return 0;
#endif
    return dtype == F32 || dtype == BF16 || dtype == F16;
}

/* y[r] = sum_i w[r * k + i] * x[i] (+ bias[r]) for r < n, in fp32, rounded once to `dtype`; w, x, bias and y
 * all of `dtype`, w row-major with rows of k. Blocks of 16 rows are shared by the `threads` threads (below).
 * Returns 0, or -1 without memory (nothing written). */
int infer_gemv(int dtype, const void *w, const void *x, const void *bias, void *y, int64_t n, int64_t k,
               int threads) {
    int64_t esize = dtype == F32 ? 4 : 2;
    int bf16_pairs = 0;
#if defined(HAVE_DOT_BF16)
    bf16_pairs = dtype == BF16;
#endif
    float *wide = NULL;
    if (!bf16_pairs && dtype != F32) {
        wide = (float *)malloc((size_t)k * sizeof(float));
        if (!wide) return -1;
        for (int64_t i = 0; i < k; i++) wide[i] = load_scalar(dtype, x, i);
    }
    const float *xf = dtype == F32 ? (const float *)x : wide;
    row_blocks rb = share_row_blocks(n, threads);
    if (!rb.ranges) {
        free(wide);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        work_walk walk = work_start(rb.ranges, rb.nr, rb.items, rb.balance);
        for (int64_t item; (item = work_next(&walk)) >= 0;)
            for (int64_t r = 16 * item, r1 = r + 16 < n ? r + 16 : n; r < r1; r++) {
                const char *row = (const char *)w + r * k * esize;
                float v;
#if defined(HAVE_DOT_BF16)
                if (bf16_pairs) v = dot_bf16((const uint16_t *)row, (const uint16_t *)x, k);
                else
#endif
                    v = dot_wide(dtype, row, xf, k);
                if (bias) v += load_scalar(dtype, bias, r);
                store_scalar(dtype, y, r, v);
            }
    }
    free(rb.ranges);
    free(wide);
    return 0;
}


/* ---- the small ops between the products: one call each instead of 3 to 8 PyTorch ops ----
 * The products stream the weights through every cache level, so each PyTorch op after one runs cold
 * (an 8-op RMSNorm of 2048 values: 16 us warm, 55 us after a GEMV, on a 2-core Xeon); one call touches far
 * less. Each computes the PyTorch formula beside it in infer/models/transformer.py, rounding where that
 * rounds (the build has -ffp-contract=off: a fused multiply-add would skip one): adds, products and
 * rotations bit for bit; the norm's sum of squares in another order and the activations with libm's
 * exp/tanh, so within an ulp of fp32 before the final rounding. */

static inline float round_to(int dtype, float v) {
    if (dtype == BF16) return bf16_to_f32(f32_to_bf16(v));
    if (dtype == F16) return f16_to_f32(f32_to_f16(v));
    return v;
}

#if defined(HAVE_AVX512)
/* 16 bf16 values widened to fp32: bf16 is fp32's upper half. */
static inline __m512 bf16x16_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 bf16x16_load(const uint16_t *p) { return bf16x16_widen(_mm256_loadu_si256((const __m256i *)p)); }

/* 16 fp32 lanes rounded to bf16 as f32_to_bf16 rounds one: to nearest even; a NaN kept quiet with its payload's
 * top bits. Where the build has AVX512-BF16, its conversion instruction, which rounds the same except that it flushes
 * subnormals (all 2^32 inputs compared on a Zen 4 EPYC: equal on every other one, NaNs and infinities included); a
 * vector holding a subnormal takes the formula. At a 16-request step's shapes of a 150M Llama on a 2-core Zen 4 (two
 * copies of the build loaded with the switch each way, alternating, the calls' Python included): SiLU * up of 16 x
 * 3072 1.13x, RMSNorm of 16 x 768 1.14x, RoPE of 16 x 12 heads 1.14x: ~0.1 ms of a 13-15 ms step, the formula's dozen
 * integer operations a vector. INFER_BF16_CONVERT=0 (read when the library loads): the formula alone. */
static int bf16_convert = 1;

__attribute__((constructor)) static void read_bf16_convert(void) { bf16_convert = switched_on("INFER_BF16_CONVERT"); }

static inline __m256i bf16x16_round_formula(__m512 v);

static inline __m256i bf16x16_round(__m512 v) {
#if defined(HAVE_DOT_BF16)
    __m512i bits = _mm512_castps_si512(v);
    __mmask16 tiny = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)) &
                     _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007fffff));
    if (!tiny && bf16_convert) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    return bf16x16_round_formula(v);
}

static inline __m256i bf16x16_round_formula(__m512 v) {
    __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    __m512i nearest = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, nearest, quiet));
}

/* -v exactly (the sign bit flipped: 0 - v would make -0 of +0). */
static inline __m512 negate16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}

/* One bf16 row of RMSNorm, 16 lanes at a time (d a multiple of 16): the scalar loop's formula and roundings, the
 * sum of squares in 16 partial sums (another order: within an ulp, as the scalar one is of PyTorch's). */
static inline void rms_norm_row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t d, float eps,
                                     int gemma) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        __m512 v = bf16x16_load(x + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)d + eps));
    for (int64_t i = 0; i < d; i += 16) {
        __m512 h = _mm512_mul_ps(bf16x16_load(x + i), inv), wv = bf16x16_load(w + i);
        __m512 o = gemma ? _mm512_mul_ps(h, _mm512_add_ps(_mm512_set1_ps(1.0f), wv))
                         : _mm512_mul_ps(wv, bf16x16_widen(bf16x16_round(h)));
        _mm256_storeu_si256((__m256i *)(out + i), bf16x16_round(o));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same helpers 8 lanes at a time, for AVX2 builds (a Zen 3 EPYC: PyTorch's RMSNorm, RoPE and SiLU * up took
 * ~15 ms of a 16-request decode step of a 150M model, the scalar loops longer). */
#define HAVE_AVX2_ROWS 1
static inline __m256 bf16x8_widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 bf16x8_load(const uint16_t *p) { return bf16x8_widen(_mm_loadu_si128((const __m128i *)p)); }

/* 8 fp32 lanes rounded to bf16 as f32_to_bf16 rounds one (bf16x16_round's formula). */
static inline __m128i bf16x8_round(__m256 v) {
    __m256i u = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    __m256i nearest = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
    /* |u| and 0x7f800000 are both below 2^31: the signed compare is the unsigned one */
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i halves = _mm256_blendv_epi8(nearest, quiet, nan); /* each lane < 2^16: packus keeps it */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08));
}

static inline __m256 negate8(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }

static inline void rms_norm_row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t d, float eps,
                                     int gemma) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(); /* 16 partial sums, as the AVX512 loop's */
    for (int64_t i = 0; i < d; i += 16) {
        __m256 v0 = bf16x8_load(x + i), v1 = bf16x8_load(x + i + 8);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(v0, v0));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(v1, v1));
    }
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(_mm256_add_ps(acc0, acc1)) / (float)d + eps));
    for (int64_t i = 0; i < d; i += 8) {
        __m256 h = _mm256_mul_ps(bf16x8_load(x + i), inv), wv = bf16x8_load(w + i);
        __m256 o = gemma ? _mm256_mul_ps(h, _mm256_add_ps(_mm256_set1_ps(1.0f), wv))
                         : _mm256_mul_ps(wv, bf16x8_widen(bf16x8_round(h)));
        _mm_storeu_si128((__m128i *)(out + i), bf16x8_round(o));
    }
}
#endif

/* RMSNorm of `rows` rows of d: h = x * 1/sqrt(mean(x^2) + eps) in fp32, then
 * Llama/Qwen: weight * round(h) (weight in dtype, the product rounded); Gemma: round(h * (1 + weight)).
 * out may be x. Rows split over `threads` where there are many (the batched engine's steps). */
void infer_rms_norm(int dtype, const void *x, const void *weight, void *out, int64_t rows, int64_t d, float eps,
                    int gemma, int threads) {
    int64_t esize = dtype == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows >= 64) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * d * esize;
        char *outr = (char *)out + r * d * esize;
#if defined(HAVE_AVX512) || defined(HAVE_AVX2_ROWS)
        if (dtype == BF16 && d % 16 == 0) {
            rms_norm_row_bf16((const uint16_t *)xr, (const uint16_t *)weight, (uint16_t *)outr, d, eps, gemma);
            continue;
        }
#endif
        float squares = 0.f;
        for (int64_t i = 0; i < d; i++) {
            float v = load_scalar(dtype, xr, i);
            squares += v * v;
        }
        float inv = 1.0f / sqrtf(squares / (float)d + eps);
        for (int64_t i = 0; i < d; i++) {
            float h = load_scalar(dtype, xr, i) * inv;
            float w = load_scalar(dtype, weight, i);
            store_scalar(dtype, outr, i, gemma ? h * (1.0f + w) : w * round_to(dtype, h));
        }
    }
}

/* Rotary embedding of `rows` rows of d (the half-split layout) by one position's cos/sin rows of d:
 * out = x * cos + rotate_half(x) * sin, each product and the sum rounded to dtype. out may be x. */
void infer_rope(int dtype, const void *x, const void *cos, const void *sin, void *out, int64_t rows, int64_t d) {
    int64_t esize = dtype == F32 ? 4 : 2, half = d / 2;
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * d * esize;
        char *outr = (char *)out + r * d * esize;
        for (int64_t i = 0; i < half; i++) {
            float a = load_scalar(dtype, xr, i), b = load_scalar(dtype, xr, i + half);
            float lo = round_to(dtype, a * load_scalar(dtype, cos, i)) + round_to(dtype, -b * load_scalar(dtype, sin, i));
            float hi = round_to(dtype, b * load_scalar(dtype, cos, i + half)) +
                       round_to(dtype, a * load_scalar(dtype, sin, i + half));
            store_scalar(dtype, outr, i, lo);
            store_scalar(dtype, outr, i + half, hi);
        }
    }
}

/* infer_rope for the batched engine's steps: `tokens` tokens of `heads` heads of d, token t's head h at
 * x + t * token_stride + h * head_stride (elements; a view of the step's q or k), each token rotated by its own
 * row of cos/sin [tokens, d], into out [tokens, heads, d]: the same formula and roundings, bit for bit (bf16 with
 * half of d a multiple of 16: 16 lanes at a time). Tokens split over `threads` where there are many. */
/* (`at`: NULL, or each token's row of cos/sin, tables of every position: the batched whole step's) */
static void rope_rows_at(int dtype, const void *x, int64_t token_stride, int64_t head_stride, const void *cos,
                         const void *sin, const int64_t *at, void *out, int64_t tokens, int64_t heads, int64_t d,
                         int threads) {
    int64_t esize = dtype == F32 ? 4 : 2, half = d / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && tokens >= 64) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        int64_t row = at ? at[t] : t;
        const char *ct = (const char *)cos + row * d * esize, *st = (const char *)sin + row * d * esize;
        for (int64_t h = 0; h < heads; h++) {
            const char *xr = (const char *)x + (t * token_stride + h * head_stride) * esize;
            char *outr = (char *)out + (t * heads + h) * d * esize;
#if defined(HAVE_AVX512)
            if (dtype == BF16 && half % 16 == 0) {
                const uint16_t *xa = (const uint16_t *)xr, *c = (const uint16_t *)ct, *s = (const uint16_t *)st;
                uint16_t *o = (uint16_t *)outr;
                for (int64_t i = 0; i < half; i += 16) {
                    __m512 a = bf16x16_load(xa + i), b = bf16x16_load(xa + half + i);
                    __m512 lo = _mm512_add_ps(bf16x16_widen(bf16x16_round(_mm512_mul_ps(a, bf16x16_load(c + i)))),
                        bf16x16_widen(bf16x16_round(_mm512_mul_ps(negate16(b),
                                                                  bf16x16_load(s + i)))));
                    __m512 hi = _mm512_add_ps(bf16x16_widen(bf16x16_round(_mm512_mul_ps(b, bf16x16_load(c + half + i)))),
                        bf16x16_widen(bf16x16_round(_mm512_mul_ps(a, bf16x16_load(s + half + i)))));
                    _mm256_storeu_si256((__m256i *)(o + i), bf16x16_round(lo));
                    _mm256_storeu_si256((__m256i *)(o + half + i), bf16x16_round(hi));
                }
                continue;
            }
#elif defined(HAVE_AVX2_ROWS)
            if (dtype == BF16 && half % 8 == 0) {
                const uint16_t *xa = (const uint16_t *)xr, *c = (const uint16_t *)ct, *s = (const uint16_t *)st;
                uint16_t *o = (uint16_t *)outr;
                for (int64_t i = 0; i < half; i += 8) {
                    __m256 a = bf16x8_load(xa + i), b = bf16x8_load(xa + half + i);
                    __m256 lo = _mm256_add_ps(bf16x8_widen(bf16x8_round(_mm256_mul_ps(a, bf16x8_load(c + i)))),
                        bf16x8_widen(bf16x8_round(_mm256_mul_ps(negate8(b), bf16x8_load(s + i)))));
                    __m256 hi = _mm256_add_ps(bf16x8_widen(bf16x8_round(_mm256_mul_ps(b, bf16x8_load(c + half + i)))),
                        bf16x8_widen(bf16x8_round(_mm256_mul_ps(a, bf16x8_load(s + half + i)))));
                    _mm_storeu_si128((__m128i *)(o + i), bf16x8_round(lo));
                    _mm_storeu_si128((__m128i *)(o + half + i), bf16x8_round(hi));
                }
                continue;
            }
#endif
            infer_rope(dtype, xr, ct, st, outr, 1, d);
        }
    }
}

void infer_rope_rows(int dtype, const void *x, int64_t token_stride, int64_t head_stride, const void *cos,
                     const void *sin, void *out, int64_t tokens, int64_t heads, int64_t d, int threads) {
    rope_rows_at(dtype, x, token_stride, head_stride, cos, sin, NULL, out, tokens, heads, d, threads);
}

/* Where token n's head h lies in blocks [N, Hkv, bs, d] (bytes from the start; `row`: d elements' bytes). */
static inline size_t kv_slot(const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t n, int64_t h, size_t block,
                             int64_t bs, size_t row) {
    return (size_t)slot_blocks[n] * block + (size_t)(h * bs + slot_offsets[n]) * row;
}

/* The batched engine's new K/V rows into one layer's blocks [N, Hkv, bs, d]: first each block of `fresh` zeroed (a
 * block a sequence starts: its unwritten slots must not keep a previous owner's values), then token n's head h
 * (k + n * k_ts + h * k_hs elements, d of them) to k_blocks[slot_blocks[n], h, slot_offsets[n]], and v's the same:
 * one call where PyTorch took two index_fill_ and two index_put_ (about 100 us a layer at 44 requests). Elements
 * of `esize` bytes copied as they are. */
void infer_write_kv(const void *k, int64_t k_ts, int64_t k_hs, const void *v, int64_t v_ts, int64_t v_hs,
                    void *k_blocks, void *v_blocks, const int64_t *slot_blocks, const int64_t *slot_offsets,
                    int64_t tokens, const int64_t *fresh, int64_t num_fresh, int64_t kv_heads, int64_t bs, int64_t d,
                    int64_t esize) {
    size_t block = (size_t)(kv_heads * bs * d * esize), row = (size_t)(d * esize);
    for (int64_t f = 0; f < num_fresh; f++) {
        memset((char *)k_blocks + fresh[f] * block, 0, block);
        memset((char *)v_blocks + fresh[f] * block, 0, block);
    }
    /* The slots lie in blocks all over the pool, long out of cache (a step's weights streamed through since): each
     * line is asked for first (a prefetch for writing), so that their misses overlap instead of each copy waiting
     * for its own (decode steps of 16 and 64 requests of a 150M Llama 1.02x faster on a 2-core Zen 5 EPYC). */
    for (int64_t n = 0; n < tokens; n++)
        for (int64_t h = 0; h < kv_heads; h++) {
            size_t slot = kv_slot(slot_blocks, slot_offsets, n, h, block, bs, row);
            for (size_t b = 0; b < row; b += 64) {
                __builtin_prefetch((char *)k_blocks + slot + b, 1, 3);
                __builtin_prefetch((char *)v_blocks + slot + b, 1, 3);
            }
        }
    for (int64_t n = 0; n < tokens; n++)
        for (int64_t h = 0; h < kv_heads; h++) {
            size_t slot = kv_slot(slot_blocks, slot_offsets, n, h, block, bs, row);
            memcpy((char *)k_blocks + slot, (const char *)k + (n * k_ts + h * k_hs) * esize, row);
            memcpy((char *)v_blocks + slot, (const char *)v + (n * v_ts + h * v_hs) * esize, row);
        }
}

/* The gated MLP's middle: out[i] = round(act(gate[i])) * up[i] (rounded), gate = gate_up[0:n],
 * up = gate_up[n:2n]; act SiLU x / (1 + exp(-x)), or (gelu) tanh-GELU 0.5 x (1 + tanh(b (x + k x^3))). */
void infer_gated(int dtype, const void *gate_up, void *out, int64_t n, int gelu) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2/pi), as PyTorch's kBeta */
    for (int64_t i = 0; i < n; i++) {
        float g = load_scalar(dtype, gate_up, i), up = load_scalar(dtype, gate_up, n + i), act;
        if (gelu) {
            float cube = g * g * g;
            act = 0.5f * g * (1.0f + tanhf(beta * (g + kappa * cube)));
        } else {
            act = g / (1.0f + expf(-g));
        }
        store_scalar(dtype, out, i, round_to(dtype, act) * up);
    }
}

/* The index of each row's largest value, as torch.argmax of the rows widened to fp32 takes it (the first of equal
 * maxima; a row holding NaN: its first NaN): fp32 or bf16 rows `stride` elements apart, split over threads. The
 * batched engine's greedy picks (48 rows of a 32k vocabulary: PyTorch's index, widening and argmax took ~1.5 ms of a
 * 50 ms decode step on 2 EPYC cores). */
/* The vector scan's answer from its lanes (each lane's largest value and where it first was; every lane saw a
 * value): the largest, of equal ones the first index; its value in *top. */
static inline int64_t first_of_largest(const float *lanes, const int32_t *where, int count, float *top) {
    int64_t best = -1;
    for (int l = 0; l < count; l++)
        if (best < 0 || lanes[l] > *top || (lanes[l] == *top && where[l] < best)) *top = lanes[l], best = where[l];
    return best;
}

static int64_t argmax_row(int dtype, const char *x, int64_t n) {
    int64_t i = 0, best = 0;
    float top = -INFINITY;
#if defined(HAVE_AVX512)
    if (n >= 16) { /* per lane: its largest value and where it first was (strictly greater moves it) */
        size_t es = dtype == F32 ? 4 : 2;
        __m512 m = _mm512_set1_ps(-INFINITY);
        __m512i at = _mm512_setzero_si512();
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __mmask16 nan = 0;
        for (; i + 16 <= n && i + 16 <= INT32_MAX; i += 16) {
            __m512 v = dtype == F32 ? _mm512_loadu_ps(x + i * es) : bf16x16_load((const uint16_t *)(x + i * es));
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            __mmask16 up = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
            m = _mm512_mask_mov_ps(m, up, v);
            at = _mm512_mask_mov_epi32(at, up, idx);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        }
        if (nan) {
            i = 0; /* rare: the scalar scan below finds the first NaN */
        } else {
            float lanes[16];
            int32_t where[16];
            _mm512_storeu_ps(lanes, m);
            _mm512_storeu_si512(where, at);
            best = first_of_largest(lanes, where, 16, &top);
        }
    }
#elif defined(HAVE_AVX2_ROWS)
    if (n >= 8) { /* the AVX512 scan 8 lanes at a time (the scalar loop's compare and branch per value: 0.58 ms of a
                   * 16-request decode step's 32k-vocabulary picks on a 2-core Zen 3) */
        size_t es = dtype == F32 ? 4 : 2;
        __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        __m256i at = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (; i + 8 <= n && i + 8 <= INT32_MAX; i += 8) {
            __m256 v = dtype == F32 ? _mm256_loadu_ps((const float *)(const void *)(x + i * es))
                                    : bf16x8_load((const uint16_t *)(const void *)(x + i * es));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            __m256 up = _mm256_cmp_ps(v, m, _CMP_GT_OQ);
            m = _mm256_blendv_ps(m, v, up);
            at = _mm256_blendv_epi8(at, idx, _mm256_castps_si256(up));
            idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
        }
        if (_mm256_movemask_ps(nan)) {
            i = 0; /* rare: the scalar scan below finds the first NaN */
        } else {
            float lanes[8];
            int32_t where[8];
            _mm256_storeu_ps(lanes, m);
            _mm256_storeu_si256((__m256i *)(void *)where, at);
            best = first_of_largest(lanes, where, 8, &top);
        }
    }
#endif
    for (; i < n; i++) {
        float v = load_scalar(dtype, x, i);
        if (v != v) return i;
        if (v > top) top = v, best = i;
    }
    return best;
}

void infer_argmax_rows(int dtype, const void *x, int64_t stride, int64_t rows, int64_t n, int64_t *out, int threads) {
    size_t es = dtype == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(dtype, (const char *)x + r * stride * es, n);
}

/* ---- top-p (HF's TopPLogitsWarper) over rows whose values come sorted ----
 * HF sorts a row ascending, takes the softmax's cumulative sums (torch's CPU cumsum: a double accumulator, each
 * sum rounded to float) and removes the positions whose sum is at most 1 - top_p (compared in float), never the
 * last. The sums never fall, so the removed are the first m positions of the order: every token below the first
 * kept value, then, where m ends among tokens equal to it, the lowest-indexed of those (a stable sort's order).
 * `sorted` holds each row's values ascending and `probs` their softmax (PyTorch's, so the sums round as HF's do);
 * `out` gets `x` with the removed tokens at -inf. Rows split over `threads`. */
static inline int zeros16(const float *p) {
    int any = 0;
    for (int i = 0; i < 16; i++) any |= p[i] != 0.f;
    return !any;
}

static void top_p_row(const float *x, const float *sorted, const float *probs, float *out, int64_t n, float limit) {
    double sum = 0;
    int64_t m = 0;
    /* the tokens of probability 0 come first (a top-k's removed, at -inf) and add nothing to the sums: their
     * run is skipped sixteen at a time (Qwen3's top-k 20 at 152k: the pass 1.1 -> 0.65 ms over 16 rows) */
    while (m + 16 <= n - 1 && zeros16(probs + m)) m += 16;
    for (; m < n - 1; m++) {
        sum += probs[m];
        if (!((float)sum <= limit)) break;
    }
    float kept = sorted[m];
    int64_t below = m; /* the tokens below `kept` lie before its run of equals in the sorted row */
    while (below > 0 && sorted[below - 1] == kept) below--;
    int64_t ties = m - below, j = 0; /* how many of the tokens equal to `kept` go, from the lowest index */
#ifdef HAVE_AVX512
    /* bf16 logits tie at the boundary in most rows: their run ends anywhere in the row, so sixteen at a time */
    __m512 at = _mm512_set1_ps(kept), gone16 = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n && ties > 0; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        __mmask16 eq = _mm512_cmp_ps_mask(v, at, _CMP_EQ_OQ), tied_gone = 0;
        for (; eq && ties > 0; ties--) { /* the lowest-indexed equal lanes, while ties remain */
            tied_gone |= eq & -eq;
            eq &= eq - 1;
        }
        _mm512_storeu_ps(out + j, _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, at, _CMP_LT_OQ) | tied_gone, gone16));
    }
#endif
    for (; j < n && ties > 0; j++) {
        float v = x[j];
        int gone = v < kept || (v == kept && ties-- > 0);
        out[j] = gone ? -INFINITY : v;
    }
    for (; j < n; j++) out[j] = x[j] < kept ? -INFINITY : x[j];
}

void infer_top_p_rows(const float *x, int64_t x_stride, const float *sorted, const float *probs, int64_t s_stride,
                      float *out, int64_t rows, int64_t n, double top_p, int threads) {
    float limit = (float)(1.0 - top_p);
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        top_p_row(x + r * x_stride, sorted + r * s_stride, probs + r * s_stride, out + r * n, n, limit);
}

/* ---- a token a row by its inverse CDF ----
 * The first token whose cumulative probability exceeds u times the row's total, the sums in double. A cumulative
 * sum token by token is a chain of dependent adds (~20 us a row of 32k); here blocks of 64 are summed in eight
 * lanes, the blocks walked to the one the target falls in, and only that block token by token. A row of NaN or
 * inf gets -1. */
#define DRAW_BLOCK 64
static double draw_block_sum(const float *p) {
    double s[8] = {0};
    for (int i = 0; i < DRAW_BLOCK; i += 8)
        for (int l = 0; l < 8; l++) s[l] += p[i + l];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

static int64_t draw_row(const float *p, int64_t n, double u) {
    double total = 0;
    int64_t i = 0;
    for (; i + DRAW_BLOCK <= n; i += DRAW_BLOCK) total += draw_block_sum(p + i);
    for (; i < n; i++) total += p[i];
    if (!isfinite(total)) return -1;
    double target = u * total, sum = 0;
    for (i = 0; i + DRAW_BLOCK <= n; i += DRAW_BLOCK) { /* the same block sums, in the same order */
        double block = draw_block_sum(p + i);
        if (sum + block > target) break;
        sum += block;
    }
    int64_t last = -1; /* the last token with probability, should rounding leave the target past every sum */
    for (; i < n; i++) {
        if (p[i] > 0.f) last = i;
        sum += p[i];
        if (sum > target) return i; /* a token of probability 0 adds nothing, so never the first past */
    }
    return last;
}

void infer_draw_rows(const float *probs, int64_t stride, int64_t rows, int64_t n, const double *u, int64_t *out,
                     int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = draw_row(probs + r * stride, n, u[r]);
}

/* Reads `nbytes` (a multiple of 4) once, as a GEMV reads its weights (same threads, ranges and prefetch),
 * and returns their float sum so nothing is optimised away: the machine's read bandwidth for the bench. */
typedef float vf16 __attribute__((vector_size(64)));

double infer_read(const void *p, int64_t nbytes, int threads) {
    int64_t n = nbytes / 4;
    double total = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(+ : total)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int64_t a = n * t / nt, b = n * (t + 1) / nt;
        const float *f = (const float *)p;
        vf16 s0 = {0}, s1 = {0};
        int64_t i = a;
        for (; i + 32 <= b; i += 32) {
            vf16 c0, c1;
            prefetch(f + i + PREFETCH_BYTES / 4);
            prefetch(f + i + 16 + PREFETCH_BYTES / 4);
            memcpy(&c0, f + i, 64);
            memcpy(&c1, f + i + 16, 64);
            s0 += c0;
            s1 += c1;
        }
        s0 += s1;
        float s = 0.f;
        for (int j = 0; j < 16; j++) s += s0[j];
        for (; i < b; i++) s += f[i];
        total += s;
    }
    return total;
}

/* ---- one-token attention over a quantized KV cache, reading the codes where they lie ----
 * The layout of infer/cache/quantized.py: the first `ns` tokens exact (sinks), then `nq` tokens as codes
 * (int8; int4 or FP4 two per byte, element 2i in the low nibble) with values scaled per row and keys per row
 * or per channel over blocks of `block` tokens, then `nr` newest tokens exact in a ring of `ring` slots (stream
 * index s at slot s % ring). Values age on their own count (a row's scale needs no block): the first `nqv` stream
 * tokens' values are codes (`nqv_cap` rows a sequence and head), the rest exact in a ring of `vring` slots. Per
 * (sequence, KV head) the G query heads that share it are scored against every key row decoded once, in fp32:
 * q.k = sum_d (q_d * channel_scale_d) * code_d (or (q . code) * row_scale); softmax in fp32; values summed as
 * sum_t (p_t * row_scale_t) * code_t. No dequantized copy of the cache is made: each code is read once per step.
 * Keys outside `window` (> 0) of the query's position are skipped, `softcap` (> 0) applies softcap * tanh(s /
 * softcap). Exact parts and q/out are of `dtype`; scales are bf16. */
enum { Q_INT8 = 0, Q_INT4 = 1, Q_FP4 = 2 };
static const float FP4_VALUES[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                     -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
/* int4's codes, two's complement nibbles, by their bits */
static const float INT4_VALUES[16] = {0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f,
                                      -8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f};

static inline void decode_codes(int scheme, const uint8_t *c, float *out, int64_t d) {
    if (scheme == Q_INT8) {
        const int8_t *s = (const int8_t *)c;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) out[i] = (float)s[i];
    } else if (scheme == Q_INT4) {
#pragma omp simd
        for (int64_t i = 0; i < d / 2; i++) {
            out[2 * i] = (float)((int8_t)(uint8_t)(c[i] << 4) >> 4);
            out[2 * i + 1] = (float)((int8_t)c[i] >> 4);
        }
    } else {
        for (int64_t i = 0; i < d / 2; i++) {
            out[2 * i] = FP4_VALUES[c[i] & 15];
            out[2 * i + 1] = FP4_VALUES[c[i] >> 4];
        }
    }
}

/* exp(x) for x <= 0 (a softmax's shifted scores) by Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial for e^r, 2^k by the exponent bits; within 2 ulp of libm's expf, and branch-free, so a loop of it
 * vectorizes (libm's expf is a call per element: 4096 keys x 4 heads of them cost more than the dot products). */
static inline float exp_nonpositive(float x) {
    x = fmaxf(x, -87.0f);
    float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, 4);
    return p * two_k;
}

static inline float dot_f32(const float *a, const float *b, int64_t d) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* The fast path (head_dim a multiple of 32): 32 elements of a row at a time as two 16-lane vectors A and B. int8:
 * A, B = elements 0-15, 16-31; two per byte: A = the low nibbles (even elements), B = the high ones (odd). The
 * queries and the value sums are kept in that order (`permute`), so the codes are widened in registers and never
 * reordered; each key costs one horizontal sum per query head. */
typedef float qv16 __attribute__((vector_size(64)));
typedef int8_t qi8x16 __attribute__((vector_size(16)));

static inline void permute(int scheme, const float *x, float *out, int64_t d) {
    for (int64_t c = 0; c < d / 32; c++)
        for (int64_t j = 0; j < 16; j++) {
            out[32 * c + j] = x[32 * c + (scheme == Q_INT8 ? j : 2 * j)];
            out[32 * c + 16 + j] = x[32 * c + (scheme == Q_INT8 ? 16 + j : 2 * j + 1)];
        }
}

static inline void unpermute_add(int scheme, const float *x, float *out, int64_t d) {
    for (int64_t c = 0; c < d / 32; c++)
        for (int64_t j = 0; j < 16; j++) {
            out[32 * c + (scheme == Q_INT8 ? j : 2 * j)] += x[32 * c + j];
            out[32 * c + (scheme == Q_INT8 ? 16 + j : 2 * j + 1)] += x[32 * c + 16 + j];
        }
}

typedef int32_t qi32x16 __attribute__((vector_size(64)));

/* 16 int8 lanes to fp32. gcc 12 turns a convertvector from int8 into one byte extract and one scalar convert per
 * lane (a third of the kernel's time), so the sign extension is spelled out where the instructions exist. */
static inline qv16 i8_to_f32(qi8x16 x) {
#if defined(__AVX512F__)
    return (qv16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)x));
#elif defined(__AVX2__)
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32((__m128i)x));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128((__m128i)x, 8)));
    qv16 out;
    memcpy(&out, &lo, 32);
    memcpy((char *)&out + 32, &hi, 32);
    return out;
#else
    return __builtin_convertvector(__builtin_convertvector(x, qi32x16), qv16);
#endif
}

/* 16 four-bit codes (one per byte, 0-15) to their FP4 values: one in-register table lookup per lane. */
static inline qv16 fp4_to_f32(qi8x16 nibbles) {
#if defined(__AVX512F__)
    const __m512 table = _mm512_loadu_ps(FP4_VALUES);
    return (qv16)_mm512_permutexvar_ps(_mm512_cvtepu8_epi32((__m128i)nibbles), table);
#else
    qv16 out;
    for (int j = 0; j < 16; j++) out[j] = FP4_VALUES[(uint8_t)nibbles[j]];
    return out;
#endif
}

/* Chunk c of a code row as (A, B). */
static inline void widen(int scheme, const uint8_t *row, int64_t c, qv16 *a, qv16 *b) {
    if (scheme == Q_INT8) {
        qi8x16 x0, x1;
        memcpy(&x0, row + 32 * c, 16);
        memcpy(&x1, row + 32 * c + 16, 16);
        *a = i8_to_f32(x0);
        *b = i8_to_f32(x1);
    } else {
#if defined(__AVX512F__)
        /* each byte widened to a lane once; the permute reads only an index's low 4 bits, so the low nibble's
         * value is the table at the lane and the high one's at the lane shifted down 4 (int4's sign extension
         * and conversion took three times the instructions, a quarter of an int4 pool's attention) */
        const __m512 table = _mm512_loadu_ps(scheme == Q_INT4 ? INT4_VALUES : FP4_VALUES);
        __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * c)));
        *a = (qv16)_mm512_permutexvar_ps(w, table);
        *b = (qv16)_mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), table);
#else
        qi8x16 x;
        memcpy(&x, row + 16 * c, 16);
        if (scheme == Q_INT4) {
            *a = i8_to_f32((qi8x16)(x << 4) >> 4);
            *b = i8_to_f32(x >> 4);
        } else {
            *a = fp4_to_f32(x & 15);
            *b = fp4_to_f32((qi8x16)((uint8_t __attribute__((vector_size(16))))x >> 4));
        }
#endif
    }
}

typedef float qv8 __attribute__((vector_size(32)));
typedef float qv4 __attribute__((vector_size(16)));

/* The 16 lanes' sum as a tree of halves: a few shuffles and adds instead of 15 dependent ones. */
static inline float hsum16(qv16 v) {
#if defined(HAVE_AVX512)
    return _mm512_reduce_add_ps((__m512)v);
#else
    qv8 lo, hi;
    memcpy(&lo, &v, 32);
    memcpy(&hi, (const char *)&v + 32, 32);
    qv8 s8 = lo + hi;
    qv4 a, b;
    memcpy(&a, &s8, 16);
    memcpy(&b, (const char *)&s8 + 16, 16);
    qv4 s4 = a + b;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

/* Two vectors' lanes picked by constant indices 0-31 (a's lanes, then b's). */
#if defined(__clang__)
#define SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, (qi32x16){__VA_ARGS__})
#endif

/* Sixteen vectors' lane sums at once, lane j the sum of v[j]: a transposing tree (pairs of vectors fold halves
 * into one vector, four times), 15 adds and 30 shuffles where 16 horizontal sums take about 64 dependent ops.
 * Always inlined: gcc 12 called it, its 16 vectors stored and reloaded through memory (a fifth of the paged
 * attention's time; inlined, the attention ran 1.05-1.12x on a 2-core Zen 4 at 16-144 keys, the same bits). */
static inline __attribute__((always_inline)) qv16 sum16x16(const qv16 *v) {
    qv16 r[8], s[4], u[2];
    for (int j = 0; j < 8; j++) /* lanes 0-7: v[2j]'s 8 partial sums, 8-15: v[2j+1]'s */
        r[j] = SHUFFLE2(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUFFLE2(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++) /* four lanes each of v[4j .. 4j+3] */
        s[j] = SHUFFLE2(r[2 * j], r[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUFFLE2(r[2 * j], r[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++) /* two lanes each of v[8j .. 8j+7] */
        u[j] = SHUFFLE2(s[2 * j], s[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUFFLE2(s[2 * j], s[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE2(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUFFLE2(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Lanes of a where mask (a vector comparison: all ones) is set, else of b (C has no vector ?:). */
static inline qv16 select16(qi32x16 mask, qv16 a, qv16 b) {
    return (qv16)(((qi32x16)a & mask) | ((qi32x16)b & ~mask));
}

/* exp_nonpositive on 16 lanes, the same steps: floor by truncation corrected where it rounded up, 2^k by the
 * exponent bits (a vector cast reinterprets them). */
static inline qv16 exp16_nonpositive(qv16 x) {
    const qv16 lo = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f,
                     -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
    x = select16(x < lo, lo, x);
    qv16 y = x * 1.44269504088896341f + 0.5f;
    qi32x16 ki = __builtin_convertvector(y, qi32x16);
    qv16 t = __builtin_convertvector(ki, qv16);
    ki += (qi32x16)(y < t); /* truncation went up for negative y: one less */
    qv16 k = __builtin_convertvector(ki, qv16);
    qv16 r = x - k * 0.693359375f + k * 2.12194440e-4f;
    qv16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (qv16)((ki + 127) << 23);
}

#if defined(HAVE_AVX512)
/* e^x for x <= 0 by exp_nonpositive's reduction and polynomial in fused multiply-adds, 2^k by vscalefps: within
 * a few fp32 ulps of it, twice as fast as exp16_nonpositive's separate products and sums (whose loop the
 * compiler could not overlap). */
static inline __m512 exp16_fma(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, k);
}
#endif

/* infer_gated over `rows` rows at once (the batched engine's steps): out[r] = act(gate[r]) * up[r], gate and up
 * rows `gate_stride` / `up_stride` elements apart (the halves of a fused [gate | up] product, or two), split over
 * `threads`. SiLU of bf16 and fp32 rows 16 lanes at a time where the build has AVX512 (PyTorch's F.silu then mul
 * took 11 ms of a 512-token step of a 150M model on 2 EPYC cores), and tanh-GELU (Gemma's) the same way; the rest
 * (fp16, a row's last values) by the scalar formula. */
#if defined(HAVE_AVX512)
/* SiLU of 16 lanes: g / (1 + e^-g) with e^-|g| <= 1 only: g / (1 + e) for g >= 0, g e / (1 + e) below (the same
 * value, no overflow); -inf gives NaN as the formula does. Below -87 e stays e^-87: ~1e-36 where the formula's is
 * ~0. */
static inline __m512 gate_times(__m512 g, __mmask16 neg, __m512 e);

static inline __m512 silu16(__m512 g) {
    __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    return gate_times(g, neg, exp16_fma(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g))));
}

/* tanh-GELU 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), as g s / (1 + e) with e = exp(-2|u|) and s = e
 * where u < 0, else 1 (1 + tanh(u) = 2 s / (1 + e): no cancellation for very negative gates); -inf gives NaN, as the
 * formula's -inf * 0. */
static inline __m512 gelu16(__m512 g) {
    __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), g), g);
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_add_ps(g, cube));
    __m512 e = exp16_fma(_mm512_mul_ps(_mm512_set1_ps(-2.f), _mm512_abs_ps(u)));
    __mmask16 neg = _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ);
    return gate_times(g, neg, e);
}

/* Both activations' last step: g s / (1 + e), s = e in the `neg` lanes, else 1; -inf gates give NaN. */
static inline __m512 gate_times(__m512 g, __mmask16 neg, __m512 e) {
    __m512 act = _mm512_div_ps(_mm512_mask_mul_ps(g, neg, g, e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
    return _mm512_mask_mov_ps(act, _mm512_cmp_ps_mask(g, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                              _mm512_set1_ps(NAN));
}

static inline __m512 load16_of(int dtype, const char *p) {
    return dtype == F32 ? _mm512_loadu_ps(p) : bf16x16_load((const uint16_t *)p);
}
#elif defined(HAVE_AVX2_ROWS)
/* exp16_fma's reduction and polynomial 8 lanes at a time; 2^k built in the exponent field (k in [-126, 0] for
 * x in [-87, 0]: a normal number, so p * 2^k rounds as vscalefps does). */
static inline __m256 exp8_fma(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(1.9875691500e-4f), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

static inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

/* gate_times of 8 lanes: g s / (1 + e), s = e where `neg` (a lane mask), else 1; -inf gates give NaN. */
static inline __m256 gate_times8(__m256 g, __m256 neg, __m256 e) {
    __m256 act = _mm256_div_ps(_mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg), _mm256_add_ps(_mm256_set1_ps(1.f), e));
    return _mm256_blendv_ps(act, _mm256_set1_ps(NAN), _mm256_cmp_ps(g, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
}

static inline __m256 silu8(__m256 g) {
    __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    return gate_times8(g, neg, exp8_fma(_mm256_sub_ps(_mm256_setzero_ps(), abs8(g))));
}

static inline __m256 gelu8(__m256 g) {
    __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), g), g);
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_add_ps(g, cube));
    __m256 e = exp8_fma(_mm256_mul_ps(_mm256_set1_ps(-2.f), abs8(u)));
    return gate_times8(g, _mm256_cmp_ps(u, _mm256_setzero_ps(), _CMP_LT_OQ), e);
}

static inline __m256 load8_of(int dtype, const char *p) {
    return dtype == F32 ? _mm256_loadu_ps((const float *)p) : bf16x8_load((const uint16_t *)p);
}
#endif

static inline void gated_row(int dtype, const char *gate, const char *up, char *out, int64_t n, int gelu) {
    int64_t i = 0;
#if defined(HAVE_AVX512)
    size_t es = dtype == F32 ? 4 : 2;
    if (dtype == F32 || dtype == BF16)
        for (; i + 64 <= n; i += 64) { /* four vectors a turn: each is one long dependent chain */
            __m512 act[4];
            for (int v = 0; v < 4; v++) {
                __m512 g = load16_of(dtype, gate + (i + 16 * v) * es);
                act[v] = gelu ? gelu16(g) : silu16(g);
            }
            for (int v = 0; v < 4; v++) {
                __m512 u = load16_of(dtype, up + (i + 16 * v) * es);
                if (dtype == F32) {
                    _mm512_storeu_ps(out + (i + 16 * v) * es, _mm512_mul_ps(act[v], u));
                } else { /* the activation is a bf16 tensor before the product */
                    __m512 a = bf16x16_widen(bf16x16_round(act[v]));
                    _mm256_storeu_si256((__m256i *)(out + (i + 16 * v) * es), bf16x16_round(_mm512_mul_ps(a, u)));
                }
            }
        }
#elif defined(HAVE_AVX2_ROWS)
    size_t es = dtype == F32 ? 4 : 2;
    if (dtype == F32 || dtype == BF16)
        for (; i + 32 <= n; i += 32) {
            __m256 act[4];
            for (int v = 0; v < 4; v++) {
                __m256 g = load8_of(dtype, gate + (i + 8 * v) * es);
                act[v] = gelu ? gelu8(g) : silu8(g);
            }
            for (int v = 0; v < 4; v++) {
                __m256 u = load8_of(dtype, up + (i + 8 * v) * es);
                if (dtype == F32) {
                    _mm256_storeu_ps((float *)(out + (i + 8 * v) * es), _mm256_mul_ps(act[v], u));
                } else {
                    __m256 a = bf16x8_widen(bf16x8_round(act[v]));
                    _mm_storeu_si128((__m128i *)(out + (i + 8 * v) * es), bf16x8_round(_mm256_mul_ps(a, u)));
                }
            }
        }
#endif
    for (; i < n; i++) {
        float g = load_scalar(dtype, gate, i), u = load_scalar(dtype, up, i), act;
        if (gelu) {
            const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2/pi), as PyTorch's kBeta */
            act = 0.5f * g * (1.0f + tanhf(beta * (g + kappa * g * g * g)));
        } else {
            act = g / (1.0f + expf(-g));
        }
        store_scalar(dtype, out, i, round_to(dtype, act) * u);
    }
}

void infer_gated_rows(int dtype, const void *gate, int64_t gate_stride, const void *up, int64_t up_stride, void *out,
                      int64_t rows, int64_t n, int gelu, int threads) {
    size_t es = dtype == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        gated_row(dtype, (const char *)gate + r * gate_stride * es, (const char *)up + r * up_stride * es,
                  (char *)out + r * n * es, n, gelu);
}

/* This block's channel scales `s` folded into the queries (`s` NULL: keys scaled per row, q as is) and, keys being
 * codes * scales + offsets `o`, q . offsets, the same for the block's every key, into qo; qp: qs permuted (fast). */
static inline void load_row(int dtype, const char *src, float *out, int64_t d);

static inline void fold_key_scales(int scheme, int fast, const float *qf, const uint16_t *s, const uint16_t *o,
                                   float *qs, float *qp, float *qo, int64_t groups, int64_t d) {
    float of[256] __attribute__((aligned(64)));
    int wide = o && d % 16 == 0 && d <= 256;
    if (wide) load_row(BF16, (const char *)o, of, d);
    for (int64_t g = 0; g < groups; g++) {
        qo[g] = 0.f;
        if (wide) { /* q . offsets 16 lanes at a time (a scalar sum through memory was 6% of a 16k-token step) */
            const qv16 *qv = (const qv16 *)(qf + g * d), *ov = (const qv16 *)of;
            qv16 a = qv[0] * ov[0];
            for (int64_t c = 1; c < d / 16; c++) a += qv[c] * ov[c];
            qo[g] = hsum16(a);
        } else if (o) {
            for (int64_t i = 0; i < d; i++) qo[g] += qf[g * d + i] * bf16_to_f32(o[i]);
        }
        for (int64_t i = 0; i < d; i++) qs[g * d + i] = s ? qf[g * d + i] * bf16_to_f32(s[i]) : qf[g * d + i];
        if (fast) permute(scheme, qs + g * d, qp + g * d, d);
    }
}

#if defined(HAVE_AVX2_ROWS)
/* widen for AVX2: 8 codes at a time to 8 fp32 lanes stored straight into the row. widen's 16-lane values went
 * through the stack there, piece by piece (with the value sums' broadcasts, most of an int8 pool's attention on a
 * Zen 3). Exact conversions, so the same floats. Two 4-bit codes a byte: bytes 16c + 8h .. + 8 are lanes 8h .. 8h + 7
 * of chunk c's A (low nibbles, signed by a shift up and back) and B (high); FP4's magnitude is its table's first 8
 * entries indexed by the code's low 3 bits (vpermps reads only those), its sign the code's bit 3. */
static inline void decode_row_avx2(int scheme, const uint8_t *codes, float *row, int64_t d) {
    if (scheme == Q_INT8) {
        for (int64_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(row + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64((const __m128i *)(codes + i)))));
        return;
    }
    const __m256 mags = _mm256_loadu_ps(FP4_VALUES);
    const __m256i sign = _mm256_set1_epi32(8);
    for (int64_t c = 0; c < d / 32; c++)
        for (int h = 0; h < 2; h++) {
            __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 16 * c + 8 * h)));
            __m256 a, b;
            if (scheme == Q_INT4) {
                a = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 28), 28));
                b = _mm256_cvtepi32_ps(_mm256_srai_epi32(x, 4));
            } else {
                __m256i y = _mm256_srli_epi32(x, 4);
                a = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, x),
                                  _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(x, sign), 28)));
                b = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, y),
                                  _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(y, sign), 28)));
            }
            _mm256_storeu_ps(row + 32 * c + 8 * h, a);
            _mm256_storeu_ps(row + 32 * c + 16 + 8 * h, b);
        }
}
#endif

/* A code row decoded into `row`: in the permuted order on the fast path, else natural. */
static inline void decode_row(int scheme, int fast, const uint8_t *codes, float *row, int64_t d) {
    if (fast) {
#if defined(HAVE_AVX2_ROWS)
        decode_row_avx2(scheme, codes, row, d);
#else
        qv16 *rv = (qv16 *)row;
        for (int64_t c = 0; c < d / 32; c++) widen(scheme, codes, c, rv + 2 * c, rv + 2 * c + 1);
#endif
    } else {
        decode_codes(scheme, codes, row, d);
    }
}

/* Score one code row with row scale rs for every query head: sc[g * n + t]. */
static inline void score_code_row(int scheme, int fast, const uint8_t *codes, const float *qp, const float *qs,
                                  const float *qo, float rs, float *row, float *sc, int64_t groups, int64_t n,
                                  int64_t t, int64_t d) {
    decode_row(scheme, fast, codes, row, d);
    for (int64_t g = 0; g < groups; g++) {
        if (fast) {
            const qv16 *qv = (const qv16 *)(qp + g * d), *rv = (const qv16 *)row;
            qv16 a = {0};
            for (int64_t c = 0; c < d / 16; c++) a += qv[c] * rv[c];
            sc[g * n + t] = hsum16(a) * rs + qo[g];
        } else {
            sc[g * n + t] = dot_f32(qs + g * d, row, d) * rs + qo[g];
        }
    }
}

/* The 16 rows of `tile` (`nv` vectors each) dotted with the query vectors `qv`: each row's lane sums in c order,
 * then folded by sum16x16. The vector step c runs outside the rows: 16 independent sums per step, where one row's
 * nv dependent adds at a time waited on the add's latency (the same sums, in the same order). */
static inline __attribute__((always_inline)) qv16 tile_dots_n(const qv16 *qv, const qv16 *tv, const int64_t nv) {
    qv16 a[16];
    for (int j = 0; j < 16; j++) a[j] = qv[0] * tv[j * nv];
    for (int64_t c = 1; c < nv; c++)
        for (int j = 0; j < 16; j++) a[j] += qv[c] * tv[j * nv + c];
    return sum16x16(a);
}

/* tile_dots_n with the common head sizes' vector counts as constants (64 and 128: 4 and 8 vectors). */
static inline qv16 tile_dots(const qv16 *qv, const qv16 *tv, int64_t nv) {
    if (nv == 4) return tile_dots_n(qv, tv, 4);
    if (nv == 8) return tile_dots_n(qv, tv, 8);
    return tile_dots_n(qv, tv, nv);
}

#if defined(HAVE_AVX2_ROWS)
/* tile_dots_n for AVX2, bit for bit: its 16 accumulators of 16 lanes are 32 ymm registers' worth, and they spilled
 * to the stack. Here 4 rows at a time, each row's 16 lanes as two 8-lane halves (8 registers), each product then its
 * add (no fused multiply-add), in c order; then sum16x16's tree for each row: lanes l + (l + 8), then (l, l + 4),
 * (l, l + 2), (l, l + 1). Returns the 4 rows' pair sums: low half [r0 r0 r2 r2], high half [r1 r1 r3 r3]. */
static inline __attribute__((always_inline)) __m256 rows4_pair_sums(const float *q, const float *rows,
                                                                    const int64_t d) {
    __m256 lo[4], hi[4];
    __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8);
    for (int j = 0; j < 4; j++) {
        lo[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(rows + j * d));
        hi[j] = _mm256_mul_ps(q1, _mm256_loadu_ps(rows + j * d + 8));
    }
    for (int64_t c = 1; c < d / 16; c++) {
        q0 = _mm256_loadu_ps(q + 16 * c);
        q1 = _mm256_loadu_ps(q + 16 * c + 8);
        for (int j = 0; j < 4; j++) {
            lo[j] = _mm256_add_ps(lo[j], _mm256_mul_ps(q0, _mm256_loadu_ps(rows + j * d + 16 * c)));
            hi[j] = _mm256_add_ps(hi[j], _mm256_mul_ps(q1, _mm256_loadu_ps(rows + j * d + 16 * c + 8)));
        }
    }
    __m256 h[4];
    for (int j = 0; j < 4; j++) h[j] = _mm256_add_ps(lo[j], hi[j]);
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(h[0], h[1], 0x20), _mm256_permute2f128_ps(h[0], h[1], 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(h[2], h[3], 0x20), _mm256_permute2f128_ps(h[2], h[3], 0x31));
    return _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* 8 consecutive fp32 rows of d values (a multiple of 16) dotted with q: lane j row j's sum, tile_dots_n's bits. */
static inline __attribute__((always_inline)) __m256 rows8_dots(const float *q, const float *rows, const int64_t d) {
    __m256 s = _mm256_hadd_ps(rows4_pair_sums(q, rows, d), rows4_pair_sums(q, rows + 4 * d, d));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* s: rows 0 2 4 6 1 3 5 7 */
}

/* tile_dots for the 16 rows of a tile on AVX2 (rows8_dots twice), the common head sizes' lengths as constants. */
static inline qv16 tile_dots_avx2(const float *q, const float *tile, int64_t d) {
    __m256 s[2];
    if (d == 64) {
        s[0] = rows8_dots(q, tile, 64);
        s[1] = rows8_dots(q, tile + 8 * 64, 64);
    } else if (d == 128) {
        s[0] = rows8_dots(q, tile, 128);
        s[1] = rows8_dots(q, tile + 8 * 128, 128);
    } else {
        s[0] = rows8_dots(q, tile, d);
        s[1] = rows8_dots(q, tile + 8 * d, d);
    }
    qv16 out;
    memcpy(&out, s, 64);
    return out;
}
#endif

/* A tile's 16 rows (d values each, fp32) dotted with q: by tile_dots, or where `avx2` (qattn_avx2_tiles) by
 * tile_dots_avx2, the same bits. */
static inline qv16 tile_scores(const float *q, const float *tile, int64_t d, int avx2) {
#if defined(HAVE_AVX2_ROWS)
    if (avx2) return tile_dots_avx2(q, tile, d);
#endif
    (void)avx2;
    return tile_dots((const qv16 *)q, (const qv16 *)tile, d / 16);
}

/* 16 consecutive code rows decoded into `tile` (fast path). */
static inline void decode_code_tile(int scheme, int64_t dp, const uint8_t *codes, float *tile, int64_t d) {
    for (int j = 0; j < 16; j++) decode_row(scheme, 1, codes + j * dp, tile + j * d, d);
}

/* Score 16 decoded code rows at once (`rscale` their 16 row scales, or NULL for channel-scaled keys), summed by
 * tile_scores. */
static inline void score_decoded_tile(const float *tile, const float *qp, const float *qo, const uint16_t *rscale,
                                      float *sc, int64_t groups, int64_t n, int64_t t, int64_t d, int avx2) {
    qv16 rsv;
    for (int j = 0; j < 16; j++) rsv[j] = rscale ? bf16_to_f32(rscale[j]) : 1.f;
    for (int64_t g = 0; g < groups; g++) {
        qv16 scores = tile_scores(qp + g * d, tile, d, avx2) * rsv + qo[g];
        memcpy(sc + g * n + t, &scores, 64);
    }
}

/* Score 16 consecutive code rows at once: decoded into `tile`, then score_decoded_tile. */
static inline void score_code_tile(int scheme, int64_t dp, const uint8_t *codes, const float *qp, const float *qo,
                                   const uint16_t *rscale, float *tile, float *sc, int64_t groups, int64_t n,
                                   int64_t t, int64_t d, int avx2) {
    decode_code_tile(scheme, dp, codes, tile, d);
    score_decoded_tile(tile, qp, qo, rscale, sc, groups, n, t, d, avx2);
}

typedef uint16_t qu16x16 __attribute__((vector_size(32)));

/* An exact row of d values (fp32, bf16 or fp16) as fp32, 16 lanes at a time where the dtype allows (bf16 is fp32's
 * upper half: a zero extension and a shift). */
static inline void load_row(int dtype, const char *src, float *out, int64_t d) {
    if (dtype == F32) {
        memcpy(out, src, sizeof(float) * (size_t)d);
    } else if (dtype == BF16 && d % 16 == 0) {
        for (int64_t c = 0; c < d / 16; c++) {
            qu16x16 h;
            memcpy(&h, src + 32 * c, 32);
            qi32x16 w = (qi32x16)__builtin_convertvector(h, qi32x16) << 16;
            memcpy(out + 16 * c, &w, 64);
        }
    } else {
        for (int64_t i = 0; i < d; i++) out[i] = load_scalar(dtype, src, i);
    }
}

/* d fp32 values stored as the dtype: bf16 16 lanes at a time where the build has AVX512 (bf16x16_round), 8 with
 * AVX2 (bf16x8_round). */
static inline void store_row(int dtype, const float *x, void *dst, int64_t d) {
    int64_t c = 0;
#if defined(HAVE_AVX512)
    if (dtype == BF16)
        for (; c + 16 <= d; c += 16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + c), bf16x16_round(_mm512_loadu_ps(x + c)));
#elif defined(HAVE_AVX2_ROWS)
    if (dtype == BF16)
        for (; c + 8 <= d; c += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + c), bf16x8_round(_mm256_loadu_ps(x + c)));
#endif
    for (; c < d; c++) store_scalar(dtype, dst, c, x[c]);
}

/* Score 16 consecutive exact rows at once (d a multiple of 16): loaded into `tile`, summed by tile_scores. */
static inline void score_exact_tile(int dtype, const char *rows, int64_t esize, const float *qf, float *tile,
                                    float *sc, int64_t groups, int64_t n, int64_t t, int64_t d, int avx2) {
    for (int j = 0; j < 16; j++) load_row(dtype, rows + j * d * esize, tile + j * d, d);
    for (int64_t g = 0; g < groups; g++) {
        qv16 scores = tile_scores(qf + g * d, tile, d, avx2);
        memcpy(sc + g * n + t, &scores, 64);
    }
}

/* bf16 rows widened in registers, no copy: a 32-bit lane of a row holds two bf16 values, the even element in its
 * low half, the odd one in its high half, so fp32 of the even one is the lane shifted up 16 and of the odd one the
 * lane with its low half cleared. Sums run over these halves (64 bytes -> an even and an odd vector), the 4-bit
 * codes' order (permute(Q_INT4, ...)), where load_row widened through a tile in memory. */
static inline __attribute__((always_inline)) void bf16_halves(const char *src, qv16 *even, qv16 *odd) {
    qi32x16 x;
    memcpy(&x, src, 64);
    *even = (qv16)(x << 16);
    *odd = (qv16)(x & (int32_t)-65536);
}

/* 16 consecutive bf16 rows (nv2 = d / 32 pairs of vectors each) dotted with a split query: lane sums over the
 * halves in c order, folded by sum16x16 (tile_dots' shape, the rows widened as they are read). */
static inline __attribute__((always_inline)) qv16 bf16_tile_dots_n(const qv16 *qs, const char *rows,
                                                                   const int64_t nv2) {
    qv16 a[16];
    for (int j = 0; j < 16; j++) {
        qv16 e, o;
        bf16_halves(rows + j * nv2 * 64, &e, &o);
        a[j] = qs[0] * e;
        a[j] += qs[1] * o;
    }
    for (int64_t c = 1; c < nv2; c++)
        for (int j = 0; j < 16; j++) {
            qv16 e, o;
            bf16_halves(rows + (j * nv2 + c) * 64, &e, &o);
            a[j] += qs[2 * c] * e;
            a[j] += qs[2 * c + 1] * o;
        }
    return sum16x16(a);
}

#if defined(HAVE_DOT_BF16)
/* bf16_tile_dots_n by the pair instruction: the bf16 query (unscaled) against 16 rows, 32 products a step (each
 * product of two bf16 values is exact in fp32; the instruction flushes denormal inputs and sums to zero). */
static inline __attribute__((always_inline)) qv16 pair_tile_dots_n(const uint16_t *qb, const char *rows,
                                                                   const int64_t nv2) {
    __m512 a[16];
    for (int j = 0; j < 16; j++)
        a[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qb),
                                (__m512bh)_mm512_loadu_si512(rows + j * nv2 * 64));
    for (int64_t c = 1; c < nv2; c++)
        for (int j = 0; j < 16; j++)
            a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(qb + 32 * c),
                                    (__m512bh)_mm512_loadu_si512(rows + (j * nv2 + c) * 64));
    qv16 v[16];
    memcpy(v, a, sizeof v);
    return sum16x16(v);
}
#endif

#if defined(HAVE_AVX2_ROWS)
/* AVX2 has 16 registers of 8 lanes: bf16_tile_dots_n's and bf16_value_heads' generic 16-lane sums (32 registers'
 * worth, products and sums apart) spilled and ran at ~4 GFLOP/s a core on a Zen 3. These keep their sums in
 * registers and fuse each product into its sum: a 32-byte piece of a row (16 bf16 values) is its 8 even values
 * (the lanes shifted up 16) and its 8 odd ones (the low halves cleared), the split sums' order of bf16_halves. */
static inline void bf16x16_halves(const char *src, __m256 *even, __m256 *odd) {
    __m256i x = _mm256_loadu_si256((const __m256i *)src);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int32_t)0xffff0000u)));
}

/* Lane j: the sum of a[j]'s 8 lanes (a fixed tree: pairs within 128-bit halves, then the halves). */
static inline __m256 sum8x8(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 consecutive bf16 rows of d values dotted with the split query `qs` (scaled; fp32 in bf16_halves' order). */
static inline __m256 bf16_rows8_dots(const float *qs, const char *rows, int64_t d) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d / 16; c++) { /* 32 bytes of each row: split-order lanes 32 (c / 2) + 8 (c % 2) */
        const float *qc = qs + 32 * (c / 2) + 8 * (c % 2);
        __m256 qe = _mm256_loadu_ps(qc), qo = _mm256_loadu_ps(qc + 16);
        for (int j = 0; j < 8; j++) {
            __m256 e, o;
            bf16x16_halves(rows + j * 2 * d + 32 * c, &e, &o);
            a[j] = _mm256_fmadd_ps(qe, e, a[j]);
            a[j] = _mm256_fmadd_ps(qo, o, a[j]);
        }
    }
    return sum8x8(a);
}

/* Up to 16 bf16 value rows into `heads` (at most 4) query heads' split sums, 32 bytes of the rows at a time (the
 * heads' 8 sums in registers); weights sc[(g0 + g) * n + t + r]. */
static inline __attribute__((always_inline)) void bf16_value_rows8(const char *rows, const float *sc, float *sums,
                                                                   int64_t g0, const int heads, int64_t n, int64_t t,
                                                                   int64_t rt, int64_t d) {
    int skips = 0; /* a zero weight's row is skipped, as bf16_value_heads skips it (where none is: no compare) */
    for (int g = 0; g < heads; g++)
        for (int64_t r = 0; r < rt; r++) skips |= sc[(g0 + g) * n + t + r] == 0.f;
    for (int64_t c = 0; c < d / 16; c++) {
        int64_t lane = 32 * (c / 2) + 8 * (c % 2);
        __m256 a[4][2];
        for (int g = 0; g < heads; g++) {
            a[g][0] = _mm256_loadu_ps(sums + (g0 + g) * d + lane);
            a[g][1] = _mm256_loadu_ps(sums + (g0 + g) * d + lane + 16);
        }
        for (int64_t r = 0; r < rt; r++) {
            __m256 e, o;
            bf16x16_halves(rows + r * 2 * d + 32 * c, &e, &o);
            for (int g = 0; g < heads; g++) {
                const float *w = sc + (g0 + g) * n + t + r;
                if (skips && *w == 0.f) continue;
                __m256 wv = _mm256_broadcast_ss(w);
                a[g][0] = _mm256_fmadd_ps(wv, e, a[g][0]);
                a[g][1] = _mm256_fmadd_ps(wv, o, a[g][1]);
            }
        }
        for (int g = 0; g < heads; g++) {
            _mm256_storeu_ps(sums + (g0 + g) * d + lane, a[g][0]);
            _mm256_storeu_ps(sums + (g0 + g) * d + lane + 16, a[g][1]);
        }
    }
}
#endif

/* Score 16 consecutive bf16 rows for every query head, head size 64 or 128. Where the CPU has the pair
 * instruction, `qsplit` holds the bf16 queries as they came (head g's d values at qsplit + g * d) and the sums are
 * scaled after; else the scaled queries in bf16_halves' order ([G, d] fp32) against the rows widened in registers. */
static inline void score_bf16_tile(const char *rows, const float *qsplit, float scale, float *sc, int64_t groups,
                                   int64_t n, int64_t t, int64_t d, int64_t rt) {
    for (int64_t g = 0; g < groups; g++) {
#if defined(HAVE_DOT_BF16)
        const uint16_t *q = (const uint16_t *)(qsplit + g * d);
        qv16 scores = (d == 64 ? pair_tile_dots_n(q, rows, 2) : pair_tile_dots_n(q, rows, 4)) * scale;
        /* the first rt lanes by a masked store: the memcpy of a variable length below compiled to a string move,
         * a third of this function's time at 16 sequences of 400-530 keys on a 2-core Zen 4 EPYC */
        _mm512_mask_storeu_ps(sc + g * n + t, (__mmask16)(rt >= 16 ? 0xffffu : (1u << rt) - 1), (__m512)scores);
        continue;
#elif defined(HAVE_AVX2_ROWS)
        (void)scale;
        __m256 scores[2] = {bf16_rows8_dots(qsplit + g * d, rows, d), bf16_rows8_dots(qsplit + g * d, rows + 16 * d, d)};
        if (rt == 16) { /* (a memcpy of a variable length is a slow string move) */
            _mm256_storeu_ps(sc + g * n + t, scores[0]);
            _mm256_storeu_ps(sc + g * n + t + 8, scores[1]);
            continue;
        }
#else
        (void)scale;
        const qv16 *qs = (const qv16 *)(qsplit + g * d);
        qv16 scores = d == 64 ? bf16_tile_dots_n(qs, rows, 2) : bf16_tile_dots_n(qs, rows, 4);
#endif
        memcpy(sc + g * n + t, &scores, 4 * (size_t)rt);
    }
}

/* Up to 16 bf16 value rows into `heads` query heads' split sums at once (value_tile_heads with the rows widened in
 * registers, once for all the heads): weights sc[g * n + t + r]. */
static inline __attribute__((always_inline)) void bf16_value_heads(const char *rows, const float *sc, qv16 *sums,
                                                                   int64_t g0, const int heads, int64_t n, int64_t t,
                                                                   int64_t rt, const int64_t nv2) {
    qv16 a[16];
    for (int g = 0; g < heads; g++)
        for (int64_t c = 0; c < 2 * nv2; c++) a[g * 2 * nv2 + c] = sums[(g0 + g) * 2 * nv2 + c];
    for (int64_t r = 0; r < rt; r++) {
        qv16 v[8];
        for (int64_t c = 0; c < nv2; c++) bf16_halves(rows + (r * nv2 + c) * 64, &v[2 * c], &v[2 * c + 1]);
        for (int g = 0; g < heads; g++) {
            float w = sc[(g0 + g) * n + t + r];
            if (w == 0.f) continue;
#if defined(HAVE_AVX512) /* one rounding instead of two, and half the instructions */
            for (int64_t c = 0; c < 2 * nv2; c++)
                a[g * 2 * nv2 + c] = (qv16)_mm512_fmadd_ps(_mm512_set1_ps(w), (__m512)v[c], (__m512)a[g * 2 * nv2 + c]);
#else
            for (int64_t c = 0; c < 2 * nv2; c++) a[g * 2 * nv2 + c] += w * v[c];
#endif
        }
    }
    for (int g = 0; g < heads; g++)
        for (int64_t c = 0; c < 2 * nv2; c++) sums[(g0 + g) * 2 * nv2 + c] = a[g * 2 * nv2 + c];
}

/* Up to 16 consecutive bf16 value rows into every query head's split sums, head size 64 or 128 (the only sizes
 * that take this path): 4 or 2 heads at once, as add_value_tile. */
static inline void add_bf16_value_tile(const char *rows, const float *sc, float *sums, int64_t groups, int64_t n,
                                       int64_t t, int64_t rt, int64_t d) {
#if defined(HAVE_AVX2_ROWS)
    for (int64_t g = 0; g < groups; g += 4) {
        int64_t left = groups - g;
        if (left >= 4) bf16_value_rows8(rows, sc, sums, g, 4, n, t, rt, d);
        else if (left == 3) bf16_value_rows8(rows, sc, sums, g, 3, n, t, rt, d);
        else if (left == 2) bf16_value_rows8(rows, sc, sums, g, 2, n, t, rt, d);
        else bf16_value_rows8(rows, sc, sums, g, 1, n, t, rt, d);
    }
    return;
#endif
    qv16 *out = (qv16 *)sums;
    int64_t g = 0;
    if (d == 64)
        for (; g < groups; g += 4) {
            int64_t left = groups - g;
            if (left >= 4) bf16_value_heads(rows, sc, out, g, 4, n, t, rt, 2);
            else if (left == 3) bf16_value_heads(rows, sc, out, g, 3, n, t, rt, 2);
            else if (left == 2) bf16_value_heads(rows, sc, out, g, 2, n, t, rt, 2);
            else bf16_value_heads(rows, sc, out, g, 1, n, t, rt, 2);
        }
    else
        for (; g < groups; g += 2) {
            if (groups - g >= 2) bf16_value_heads(rows, sc, out, g, 2, n, t, rt, 4);
            else bf16_value_heads(rows, sc, out, g, 1, n, t, rt, 4);
        }
}

/* Each query head's scores turned into probabilities in place, with the softcap and the sliding window: key t sits
 * at position t (t < split) or t + gap (the rest), the query at qpos. */
static void softmax_heads(float *sc, int64_t groups, int64_t n, int64_t split, int64_t gap, int64_t qpos,
                          float softcap, int64_t window) {
    for (int64_t g = 0; g < groups; g++) {
        float *s = sc + g * n, top = -INFINITY, sum = 0.f;
        int64_t t = 0;
        if (softcap <= 0.f && window <= 0) { /* no element to change: the maximum 16 lanes at a time */
            qv16 m = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                      -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
            for (; t + 16 <= n; t += 16) {
                qv16 v;
                memcpy(&v, s + t, 64);
                m = select16(v > m, v, m);
            }
            for (int j = 0; j < 16; j++) top = m[j] > top ? m[j] : top;
        }
        for (; t < n; t++) {
            int64_t pos = t < split ? t : t + gap;
            if (softcap > 0.f) s[t] = softcap * tanhf(s[t] / softcap);
            if (window > 0 && pos <= qpos - window) s[t] = -INFINITY;
            if (s[t] > top) top = s[t];
        }
        t = 0;
#if defined(HAVE_AVX512)
        __m512 sums = _mm512_setzero_ps(); /* summed as they are made: one pass less over the scores */
        for (; t + 16 <= n; t += 16) {
            __m512 v = _mm512_loadu_ps(s + t);
            __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ),
                                           exp16_fma(_mm512_sub_ps(v, _mm512_set1_ps(top))));
            _mm512_storeu_ps(s + t, e);
            sums = _mm512_add_ps(sums, e);
        }
        sum = _mm512_reduce_add_ps(sums);
        for (; t < n; t++) {
            s[t] = s[t] > -INFINITY ? exp_nonpositive(s[t] - top) : 0.f;
            sum += s[t];
        }
#elif defined(HAVE_AVX2_ROWS)
        __m256 sums = _mm256_setzero_ps(); /* exp16_fma's loop 8 lanes at a time */
        for (; t + 8 <= n; t += 8) {
            __m256 v = _mm256_loadu_ps(s + t);
            __m256 e = _mm256_and_ps(_mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ),
                                     exp8_fma(_mm256_sub_ps(v, _mm256_set1_ps(top))));
            _mm256_storeu_ps(s + t, e);
            sums = _mm256_add_ps(sums, e);
        }
        sum = hsum8(sums);
        for (; t < n; t++) {
            s[t] = s[t] > -INFINITY ? exp_nonpositive(s[t] - top) : 0.f;
            sum += s[t];
        }
#else
        for (; t + 16 <= n; t += 16) {
            qv16 v;
            memcpy(&v, s + t, 64);
            qv16 e = exp16_nonpositive(v - top);
            e = select16(v > -INFINITY, e, (qv16){0});
            memcpy(s + t, &e, 64);
        }
        for (; t < n; t++) s[t] = s[t] > -INFINITY ? exp_nonpositive(s[t] - top) : 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) sum += s[t];
#endif
        float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) s[t] *= inv;
    }
}

/* One value row into every query head's sum with weight sc[g * n + t] * rs: code rows into accp (in the permuted
 * order on the fast path), exact rows into acc. */
static inline void add_value_row(int coded, int fast, const float *row, const float *sc, float rs, float *acc,
                                 float *accp, int64_t groups, int64_t n, int64_t t, int64_t d) {
    for (int64_t g = 0; g < groups; g++) {
        float w = sc[g * n + t] * rs;
        if (w == 0.f) continue;
        if (coded && fast) {
            qv16 *a = (qv16 *)(accp + g * d);
            const qv16 *rv = (const qv16 *)row;
            for (int64_t c = 0; c < d / 16; c++) a[c] += w * rv[c];
        } else {
            float *a = (coded ? accp : acc) + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) a[i] += w * row[i];
        }
    }
}

/* One value row's nv vectors `v` into `heads` query heads' sums `a` (registers) with weights sc[(g0 + g) * n + t] *
 * rs, a zero weight's row skipped. */
static inline __attribute__((always_inline)) void row_into_heads(const qv16 *v, const float *sc, float rs, qv16 *a,
                                                                int64_t g0, const int heads, int64_t n, int64_t t,
                                                                const int64_t nv) {
    for (int g = 0; g < heads; g++) {
        float w = sc[(g0 + g) * n + t] * rs;
        if (w == 0.f) continue;
        for (int64_t c = 0; c < nv; c++) a[g * nv + c] += w * v[c];
    }
}

/* Up to 16 value rows already in `tile` (fp32, [rows][d], decoded in the permuted order where they are codes on
 * the fast path) into every query head's sums at once, weights sc[g * n + t + r] * rs[r]: each head's d sums stay in
 * registers across the rows, where one row at a time (add_value_row) loaded, added and stored them again per row.
 * The same products summed in the same order. Needs d % 16 == 0 and d <= 256. Where `codes` is set, its rows
 * (`dp` bytes apart) are widened in registers as they are summed instead (widen: the values decode_row would store
 * in the tile, so the same bits), with no tile written and read back (an int8 or int4 pool's decode attention 8-9%
 * faster at 512 keys on a 2-core Zen 4); head sizes 64 and 128. */
static inline __attribute__((always_inline)) void value_tile_heads(const qv16 *tv, const uint8_t *codes, int scheme,
                                                                  int64_t dp, const float *sc, const float *rs,
                                                                  qv16 *sums, int64_t g0, const int heads, int64_t n,
                                                                  int64_t t, int64_t rows, const int64_t nv) {
    qv16 a[16];
    for (int g = 0; g < heads; g++)
        for (int64_t c = 0; c < nv; c++) a[g * nv + c] = sums[(g0 + g) * nv + c];
    if (codes)
        for (int64_t r = 0; r < rows; r++) {
            qv16 v[8];
            for (int64_t c = 0; c < nv / 2 && c < 4; c++) /* (codes come at nv 4 or 8) */
                widen(scheme, codes + r * dp, c, &v[2 * c], &v[2 * c + 1]);
            row_into_heads(v, sc, rs[r], a, g0, heads, n, t + r, nv);
        }
    else
        for (int64_t r = 0; r < rows; r++) row_into_heads(tv + r * nv, sc, rs[r], a, g0, heads, n, t + r, nv);
    for (int g = 0; g < heads; g++)
        for (int64_t c = 0; c < nv; c++) sums[(g0 + g) * nv + c] = a[g * nv + c];
}

#if defined(HAVE_AVX2_ROWS)
/* Lanes c0 .. c0 + 8 nv8 of one head's sums over the m rows `live` of a tile with weights w: the sums in registers
 * across the rows, each weight broadcast once. */
static inline __attribute__((always_inline)) void value_lanes_avx2(const float *tile, const float *w,
                                                                   const int64_t *live, int64_t m, float *sums,
                                                                   int64_t c0, int64_t d, const int nv8) {
    __m256 a[8];
    for (int v = 0; v < nv8; v++) a[v] = _mm256_loadu_ps(sums + c0 + 8 * v);
    for (int64_t i = 0; i < m; i++) {
        __m256 wv = _mm256_set1_ps(w[i]);
        const float *row = tile + live[i] * d + c0;
        for (int v = 0; v < nv8; v++) a[v] = _mm256_add_ps(a[v], _mm256_mul_ps(wv, _mm256_loadu_ps(row + 8 * v)));
    }
    for (int v = 0; v < nv8; v++) _mm256_storeu_ps(sums + c0 + 8 * v, a[v]);
}

/* value_tile_heads for AVX2 (d a multiple of 32), one head at a time, 64 lanes of its sums (8 registers) at a time:
 * the same products and adds in the same order for every lane, zero weights skipped as there. The generic 16-lane
 * form built each broadcast weight through the stack and kept the sums there (30% of an int8 pool's attention on a
 * Zen 3). */
static inline void value_tile_avx2(const float *tile, const float *sc, const float *rs, float *sums, int64_t groups,
                                   int64_t n, int64_t t, int64_t rows, int64_t d) {
    for (int64_t g = 0; g < groups; g++) {
        float w[16];
        int64_t live[16], m = 0;
        for (int64_t r = 0; r < rows; r++) {
            w[m] = sc[g * n + t + r] * rs[r];
            if (w[m] != 0.f) live[m++] = r;
        }
        int64_t c0 = 0; /* d is a multiple of 32 (the fast path's): 64 lanes at a time, then 32 or none */
        for (; c0 + 64 <= d; c0 += 64) value_lanes_avx2(tile, w, live, m, sums + g * d, c0, d, 8);
        if (d - c0 == 32) value_lanes_avx2(tile, w, live, m, sums + g * d, c0, d, 4);
    }
}
#endif

/* Up to 16 rows of a tile into every query head's sums: by value_tile_avx2 where `avx2` (qattn_avx2_tiles), else
 * value_tile_heads, several heads at once or one (`several`: qattn_value_heads). The same bits every way. `codes`
 * (NULL: none): the rows as codes of `scheme`, `dp` bytes apart, in place of the tile (several heads at once, head
 * size 64 or 128, not AVX2's tiles: qattn_paged's value_registers). */
static inline void add_value_tile(const float *tile, const uint8_t *codes, int scheme, int64_t dp, const float *sc,
                                  const float *rs, float *sums, int64_t groups, int64_t n, int64_t t, int64_t rows,
                                  int64_t d, int several, int avx2) {
#if defined(HAVE_AVX2_ROWS)
    if (avx2) {
        value_tile_avx2(tile, sc, rs, sums, groups, n, t, rows, d);
        return;
    }
#endif
    (void)avx2;
    const qv16 *tv = (const qv16 *)tile;
    qv16 *out = (qv16 *)sums;
    int64_t nv = d / 16, g = 0;
    /* Several heads' sums at once where they fit 16 registers (head sizes 64 and 128): each row's vectors are
     * loaded once for all of them, and their chains of adds overlap (`several`: qattn_value_heads). */
    if (several && nv == 4)
        for (; g < groups; g += 4) {
            int64_t left = groups - g;
            if (left >= 4) value_tile_heads(tv, codes, scheme, dp, sc, rs, out, g, 4, n, t, rows, 4);
            else if (left == 3) value_tile_heads(tv, codes, scheme, dp, sc, rs, out, g, 3, n, t, rows, 4);
            else if (left == 2) value_tile_heads(tv, codes, scheme, dp, sc, rs, out, g, 2, n, t, rows, 4);
            else value_tile_heads(tv, codes, scheme, dp, sc, rs, out, g, 1, n, t, rows, 4);
        }
    else if (several && nv == 8)
        for (; g < groups; g += 2) {
            if (groups - g >= 2) value_tile_heads(tv, codes, scheme, dp, sc, rs, out, g, 2, n, t, rows, 8);
            else value_tile_heads(tv, codes, scheme, dp, sc, rs, out, g, 1, n, t, rows, 8);
        }
    else
        for (; g < groups; g++) value_tile_heads(tv, NULL, scheme, dp, sc, rs, out, g, 1, n, t, rows, nv);
}

/* acc[0 .. 16 nv) += sum_j x[j] * rot[j * d + 0 .. 16 nv) in order of j (rows j with x[j] = 0 skipped), the sums
 * in nv registers, where the plain loop (rotate_back's last branch) kept them in memory, a store and a dependent
 * load a step (at head size 64, ~450 cycles a head, a tenth of an int4 pool's attention). The same products and
 * adds in the same order. */
static inline __attribute__((always_inline)) void rotate_sums(const float *x, const float *rot, float *acc,
                                                              int64_t d, const int nv) {
    qv16 a[8];
    for (int c = 0; c < nv; c++) memcpy(&a[c], acc + 16 * c, 64);
    for (int64_t j = 0; j < d; j++) {
        float xj = x[j];
        if (xj == 0.f) continue;
        for (int c = 0; c < nv; c++) {
            qv16 r;
            memcpy(&r, rot + j * d + 16 * c, 64);
            a[c] += xj * r;
        }
    }
    for (int c = 0; c < nv; c++) memcpy(acc + 16 * c, &a[c], 64);
}

/* acc [d] += x [d] @ rot [d, d], in order of x's rows (those with x[j] = 0 skipped): 128 or 64 columns at a time
 * in registers (rotate_sums) where d allows, else through memory. */
static void rotate_back(const float *x, const float *rot, float *acc, int64_t d) {
    if (d % 128 == 0) {
        for (int64_t c = 0; c < d; c += 128) rotate_sums(x, rot + c, acc + c, d, 8);
    } else if (d == 64) {
        rotate_sums(x, rot, acc, d, 4);
    } else {
        for (int64_t j = 0; j < d; j++) {
            float xj = x[j];
            if (xj == 0.f) continue;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[i] += xj * rot[j * d + i];
        }
    }
}

/* The query heads' outputs, heads first .. first + groups - 1 of `out`: the code rows' sums back in the natural
 * order (fast path, through `row`) and rotated back (v_rot), added to the exact rows' sums, stored. */
static void finish_heads(int dtype, int scheme, int fast, const float *v_rot, const float *accp, float *acc,
                         float *row, int64_t groups, int64_t d, void *out, int64_t first) {
    for (int64_t g = 0; g < groups; g++) {
        const float *code_sum = accp + g * d;
        if (fast) {
            memset(row, 0, sizeof(float) * (size_t)d);
            unpermute_add(scheme, accp + g * d, row, d);
            code_sum = row;
        }
        if (v_rot) /* stored rows were v @ H: the sum of decoded rows times H (symmetric) */
            rotate_back(code_sum, v_rot, acc + g * d, d);
        else
            for (int64_t i = 0; i < d; i++) acc[g * d + i] += code_sum[i];
        store_row(dtype, acc + g * d, (char *)out + (first + g) * d * (dtype == F32 ? 4 : 2), d);
    }
}

/* INFER_QATTN_VALUE_REGISTERS=0: a tile of value codes decoded into memory, then summed (add_value_tile), where by
 * default each row is widened in registers as it is summed (value_tile_heads with its codes): the same bits. */
static int qattn_value_registers(void) { return switched_on("INFER_QATTN_VALUE_REGISTERS"); }

/* INFER_QATTN_TILES=0 scores one key at a time (the plain path, kept as the tiles' check). */
static int qattn_tiles(void) { return switched_on("INFER_QATTN_TILES"); }

/* INFER_QATTN_HEADS_AT_ONCE=0: the paged kernel takes one KV head of a sequence per work item, whatever the batch
 * (the plain order, kept as the check of a sequence's heads taken block by block). */
static int qattn_heads_at_once(void) { return switched_on("INFER_QATTN_HEADS_AT_ONCE"); }

/* INFER_QATTN_VALUE_HEADS=1 / 0: a tile's value rows summed into several query heads at once, or one head at a time
 * (the same arithmetic for each head: the tests hold one to the other bit for bit). By default several where the
 * build has AVX512's 32 registers; one on AVX2, whose 16 half-width registers spilled several heads' sums to the
 * stack (an int8 pool's attention over 560-token sequences 1.15x slower at head size 64 on a Zen 3). */
static int qattn_value_heads(void) {
    const char *v = getenv("INFER_QATTN_VALUE_HEADS");
#if defined(HAVE_AVX512)
    return !(v && v[0] == '0');
#else
    return v && v[0] == '1';
#endif
}

/* INFER_QATTN_AVX2_TILES=0: an AVX2 build scores a tile and sums its value rows in the generic 16-lane forms (as
 * the other builds do: tile_dots, value_tile_heads), where by default it takes tile_dots_avx2 and value_tile_avx2:
 * the same bits, the sums kept in 8-lane registers (the tests hold one form to the other). */
static int qattn_avx2_tiles(void) { return switched_on("INFER_QATTN_AVX2_TILES"); }

/* One thread's scratch for a (sequence, KV head) of the attention kernels, for up to n keys: scores sc [G, n];
 * queries natural qf, scaled qs, permuted qp, split qsplit [G, d]; sums acc (natural), accp (code rows: permuted on
 * the fast path, rotated with v_rot), accsplit (bf16 rows widened in registers: split) [G, d]; one decoded row; a
 * 16-key tile; q . offsets qo [G]. Vectors first, so they stay 64-byte aligned. */
typedef struct {
    float *qp, *accp, *qsplit, *accsplit, *row, *qf, *qs, *acc, *tile, *sc, *qo;
} qattn_scratch;

static float *qattn_alloc(int64_t groups, int64_t d, int64_t n) {
    size_t floats = (size_t)(groups * (7 * d + n + 1) + 17 * d);
    return (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
}

static qattn_scratch qattn_carve(float *buf, int64_t groups, int64_t d, int64_t n) {
    qattn_scratch s;
    s.qp = buf;
    s.accp = s.qp + groups * d;
    s.qsplit = s.accp + groups * d;
    s.accsplit = s.qsplit + groups * d;
    s.row = s.accsplit + groups * d;
    s.qf = s.row + d;
    s.qs = s.qf + groups * d;
    s.acc = s.qs + groups * d;
    s.tile = s.acc + groups * d;
    s.sc = s.tile + 16 * d;
    s.qo = s.sc + groups * n;
    return s;
}

int infer_qattn(int dtype, int scheme, int channel_keys, const void *q, const void *k_sink, const void *v_sink,
                const uint8_t *k_codes, const uint8_t *v_codes, const uint16_t *k_scale, const uint16_t *v_scale,
                const uint16_t *k_offset, const float *v_rot, const void *k_recent, const void *v_recent, void *out, int64_t batch, int64_t heads,
                int64_t kv_heads, int64_t d, int64_t ns, int64_t ns_cap, int64_t nq, int64_t nq_cap,
                int64_t block, int64_t scale_rows, int64_t nr, int64_t ring, int64_t nqv, int64_t nqv_cap,
                int64_t vring, float scale, float softcap, int64_t window, int threads) {
    int64_t esize = dtype == F32 ? 4 : 2, groups = heads / kv_heads, n = ns + nq + nr;
    int64_t dp = scheme == Q_INT8 ? d : d / 2, qpos = ns_cap + nq + nr - 1;
    int fast = d % 32 == 0; /* whole 32-element chunks: the vector path */
    int tiles = qattn_tiles(), several = qattn_value_heads(), avx2 = qattn_avx2_tiles();
    if (ns < ns_cap) qpos = ns - 1; /* everything so far is a sink */
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *buf = qattn_alloc(groups, d, n);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * kv_heads; bh++) {
            if (!buf) continue;
            int64_t b = bh / kv_heads;
            qattn_scratch w = qattn_carve(buf, groups, d, n);
            float *qp = w.qp, *accp = w.accp, *row = w.row, *qf = w.qf, *qs = w.qs, *acc = w.acc, *tile = w.tile;
            float *sc = w.sc, *qo = w.qo;
            for (int64_t g = 0; g < groups; g++)
                for (int64_t i = 0; i < d; i++)
                    qf[g * d + i] = load_scalar(dtype, q, ((b * heads) + bh % kv_heads * groups + g) * d + i) * scale;
            const char *ks = (const char *)k_sink + bh * ns_cap * d * esize;
            const char *kr = (const char *)k_recent + bh * ring * d * esize;
            const uint8_t *kc = k_codes + bh * nq_cap * dp;
            /* scores: sinks, codes, ring */
            for (int64_t t = 0; t < ns; t++) {
                for (int64_t i = 0; i < d; i++) row[i] = load_scalar(dtype, ks, t * d + i);
                for (int64_t g = 0; g < groups; g++) sc[g * n + t] = dot_f32(qf + g * d, row, d);
            }
            for (int64_t t = 0; t < nq; t++) {
                int new_block = channel_keys ? t % block == 0 : t == 0;
                if (new_block)
                    fold_key_scales(scheme, fast, qf, channel_keys ? k_scale + (bh * scale_rows + t / block) * d : 0,
                                    k_offset ? k_offset + (bh * scale_rows + t / block) * d : 0, qs, qp, qo, groups,
                                    d);
                const uint8_t *codes = kc + t * dp;
                const uint16_t *rscale = channel_keys ? 0 : k_scale + bh * nq_cap + t;
                /* 16 keys of one block at once where they fit */
                if (fast && tiles && t + 16 <= nq && (!channel_keys || t % block + 16 <= block)) {
                    score_code_tile(scheme, dp, codes, qp, qo, rscale, tile, sc, groups, n, ns + t, d, avx2);
                    t += 15;
                } else {
                    score_code_row(scheme, fast, codes, qp, qs, qo, rscale ? bf16_to_f32(*rscale) : 1.f, row, sc,
                                   groups, n, ns + t, d);
                }
            }
            for (int64_t t = 0; t < nr; t++) {
                int64_t slot = (nq + t) % ring;
                for (int64_t i = 0; i < d; i++) row[i] = load_scalar(dtype, kr, slot * d + i);
                for (int64_t g = 0; g < groups; g++) sc[g * n + ns + nq + t] = dot_f32(qf + g * d, row, d);
            }
            /* key t: position t for the sinks, then ns_cap + (t - ns) */
            softmax_heads(sc, groups, n, ns, ns_cap - ns, qpos, softcap, window);
            /* values: exact rows into acc, code rows into accp */
            memset(acc, 0, sizeof(float) * (size_t)(groups * d));
            memset(accp, 0, sizeof(float) * (size_t)(groups * d));
            const char *vs = (const char *)v_sink + bh * ns_cap * d * esize;
            const char *vr = (const char *)v_recent + bh * vring * d * esize;
            const uint8_t *vc = v_codes + bh * nqv_cap * dp;
            for (int64_t t = 0; fast && tiles && d <= 256 && t < n;) { /* up to 16 rows of one part at once */
                int coded = t >= ns && t < ns + nqv;
                int64_t end = t < ns ? ns : coded ? ns + nqv : n, rt = end - t < 16 ? end - t : 16;
                float rs[16];
                for (int64_t k = 0; k < rt; k++) {
                    float *dst = tile + k * d;
                    rs[k] = 1.f;
                    if (t + k < ns) {
                        load_row(dtype, vs + (t + k) * d * esize, dst, d);
                    } else if (coded) {
                        decode_row(scheme, fast, vc + (t + k - ns) * dp, dst, d);
                        rs[k] = bf16_to_f32(v_scale[bh * nqv_cap + (t + k - ns)]);
                    } else {
                        load_row(dtype, vr + ((t + k - ns) % vring) * d * esize, dst, d);
                    }
                }
                add_value_tile(tile, NULL, scheme, dp, sc, rs, coded ? accp : acc, groups, n, t, rt, d, several, avx2);
                t += rt;
            }
            for (int64_t t = 0; !(fast && tiles && d <= 256) && t < n; t++) {
                int coded = t >= ns && t < ns + nqv;
                if (t < ns) {
                    for (int64_t i = 0; i < d; i++) row[i] = load_scalar(dtype, vs, t * d + i);
                } else if (coded) {
                    decode_row(scheme, fast, vc + (t - ns) * dp, row, d);
                } else {
                    int64_t slot = (t - ns) % vring;
                    for (int64_t i = 0; i < d; i++) row[i] = load_scalar(dtype, vr, slot * d + i);
                }
                float rs = coded ? bf16_to_f32(v_scale[bh * nqv_cap + (t - ns)]) : 1.f;
                add_value_row(coded, fast, row, sc, rs, acc, accp, groups, n, t, d);
            }
            finish_heads(dtype, scheme, fast, v_rot, accp, acc, row, groups, d, out, b * heads + bh % kv_heads * groups);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* A thread's reads of the pool, in the order it makes them: each of its work items' key blocks, then their value
 * blocks, item after item (an item is a sequence's `hs` KV heads, which lie side by side in a block: one run of
 * bytes, exact rows where staged, else codes). `kv_stream_ahead` prefetches (into L2) the bytes a fixed distance
 * ahead of the reads, a head's worth for each head of a block read, so DRAM works while the tiles are scored instead
 * of after: blocks lie anywhere in the pool, and the hardware's prefetcher restarts at every block (random 8 KB
 * blocks read at 12 GB/s on a 2-core EPYC, 28 with this). */
/* bytes: 32-128 KB measured alike on a Zen 3 (random 8 KB blocks: 4-8 blocks ahead best); on a 2-core Zen 4 a call's
 * first burst of 64 KB stalled on prefetches with nothing to compute (12 layers of 16 sequences, huge pages, caches
 * evicted, builds alternating in one process: 16 KB 1.02-1.10x 64 KB's time at 16-400 keys, 32 KB 0.98-1.05x) */
#define KV_STREAM_AHEAD 16384

typedef struct {
    const int64_t *tables, *lengths, *starts;
    const char *k, *v, *kc, *vc;  /* staged rows [P, Hkv, bs, d], codes [N, Hkv, bs, dp] */
    int64_t nb, bs, num_blocks, stage_bytes, code_bytes, kv_heads, hs, items, end; /* bytes: one head's rows */
    int64_t item, j, phase, off; /* where the prefetches have reached: item, block, keys (0) or values (1), byte */
    const unsigned char *skip;   /* rows another kernel attends (NULL: none), not read */
    /* a block of codes' own rows beside them: keys' channel scales and offsets [N, Hkv, d], values' row scales
     * [N, Hkv, bs] (bf16; NULL: none), prefetched with the block's first bytes (INFER_KV_STREAM_SCALES=0: not) */
    const uint16_t *ks, *ko, *vs;
    int64_t d;
} kv_stream;

/* Where the stream prefetches a block of codes' scales (and offsets) too: on unless INFER_KV_STREAM_SCALES=0. */
static int kv_stream_scales(void) { return switched_on("INFER_KV_STREAM_SCALES"); }

/* hs heads' side rows of `n` bf16 values each from row (id, h0) of `rows`, prefetched (a no-op for NULL). */
static inline void prefetch_side_rows(const uint16_t *rows, int64_t id, int64_t kv_heads, int64_t h0, int64_t hs,
                                      int64_t n) {
    if (!rows) return;
    const char *p = (const char *)(rows + (id * kv_heads + h0) * n);
    for (int64_t off = 0; off < 2 * hs * n; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* One KV head's bytes of block `id`: what the reader advances the stream by for each head it reads. */
static inline int64_t kv_stream_bytes(const kv_stream *s, int64_t id) {
    return id >= s->num_blocks ? s->stage_bytes : s->code_bytes;
}

static inline void kv_stream_ahead(kv_stream *s, int64_t bytes) {
    while (bytes > 0 && s->item < s->end) {
        int64_t b = s->item / s->items, h0 = s->item % s->items * s->hs;
        if (s->skip && s->skip[b]) {
            s->item++, s->j = 0, s->phase = 0, s->off = 0;
            continue;
        }
        int64_t blocks = (s->lengths[b] - s->starts[b] + s->bs - 1) / s->bs;
        if (s->j >= blocks) {
            s->j = 0;
            if (++s->phase == 2) s->phase = 0, s->item++;
            continue;
        }
        int64_t id = s->tables[b * s->nb + s->j], head = kv_stream_bytes(s, id), size = s->hs * head;
        const char *p = id >= s->num_blocks
                            ? (s->phase ? s->v : s->k) + ((id - s->num_blocks) * s->kv_heads + h0) * head
                            : (s->phase ? s->vc : s->kc) + (id * s->kv_heads + h0) * head;
        if (s->off == 0 && id < s->num_blocks) {
            if (s->phase == 0) {
                prefetch_side_rows(s->ks, id, s->kv_heads, h0, s->hs, s->d);
                prefetch_side_rows(s->ko, id, s->kv_heads, h0, s->hs, s->d);
            } else {
                prefetch_side_rows(s->vs, id, s->kv_heads, h0, s->hs, s->bs);
            }
        }
        for (; s->off < size && bytes > 0; s->off += 64, bytes -= 64) __builtin_prefetch(p + s->off, 0, 2);
        if (s->off >= size) s->off = 0, s->j++;
    }
}

#if defined(HAVE_DOT_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
/* ---- AMX tiles (Intel Xeons with AMX-BF16): the tile state, and a prompt chunk's rows on them ----
 * Linux hands a process the tiles' state only when asked (arch_prctl). INFER_AMX=0 turns every use off. */
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

static int amx_permitted(void) {
    static int state = 0; /* 0: not asked yet, 1: granted, -1: refused (an old kernel, a hypervisor hiding it) */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

static int amx_takes(int64_t k) { return k % 32 == 0 && switched_on("INFER_AMX") && amx_permitted(); }

/* Every tile 16 rows of 64 bytes (palette 1): sums 16 x 16 fp32, x 16 x 32 bf16, weights 16 pairs x 16 outputs.
 * A constant in memory: gcc 12 drops the stores of a configuration built on the stack (the tile load is not seen
 * to read them), which faulted once the function was called from two places and no longer inlined. */
static void amx_configure(void) {
    static const struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config __attribute__((aligned(64))) = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
    _tile_loadconfig(&config);
}

#define AMX_RUN_ROWS 8 /* the fewest rows of a run taken on tiles (fewer: a tile of mostly padding) */

/* ---- a prompt chunk's rows on AMX tiles (bf16: exact and quantized pools) ----
 * The in-place kernel takes every token of a prompt chunk as a row of its own (qattn_paged): each reads its keys and
 * values again and scores them by the pair instruction, 30-40 GFLOP/s on a 2-core Xeon, where a chunk's rows are
 * one sequence's consecutive positions over one table. Such a run (chunk_runs) is taken here 16 rows at a time per
 * query head: its keys laid out once per run and KV head as the tiles' weight operand (pairs of a key's values side
 * by side, 16 keys a row: kt) and its values as pairs of keys (vp), the 16 rows' scores one tile product a 16 keys,
 * scaled and softmaxed per row as the row path does (softmax_heads over the row's own keys), and the values summed
 * by tiles against the probabilities split in two bf16 parts (hi + lo, within 2^-16 of the fp32 weights: one bf16
 * rounding would lose 8 bits). A quantized pool's keys and values (codes times scales, exact in fp32) are laid out
 * as two bf16 parts each, which hold them exactly (kl, vl; amx_codes). So each row is its row-path value up to the order of fp32
 * sums (scores over d, values over keys): within a rounding of the bf16 output. Padding rows of a last tile are zero
 * and never stored; keys past a row's own are given weight 0. INFER_AMX=0 turns it off, as the packed products. */
typedef struct {
    uint16_t *kt, *kl, *vp, *vl, *ph, *pl, *qt; /* keys and values (hi, lo), probabilities (hi, lo), queries */
    float *sc, *ct, *row, *acc;                 /* scores, a pass's tiles, a key's decoded row, the rows' sums (x2) */
    unsigned char *coded;                       /* each key: a code row (1) or a staged one (0) */
    int64_t npad;
} amx_attn_buf;

static void amx_attn_free(amx_attn_buf *w) {
    free(w->kt), free(w->kl), free(w->vp), free(w->vl), free(w->ph), free(w->pl), free(w->qt);
    free(w->sc), free(w->ct), free(w->row), free(w->acc), free(w->coded);
}

static int amx_attn_grow(amx_attn_buf *w, int64_t npad, int64_t d) {
    if (npad <= w->npad) return 0;
    amx_attn_free(w);
    w->kt = (uint16_t *)aligned_alloc(64, (size_t)(npad * d * 2));
    w->kl = (uint16_t *)aligned_alloc(64, (size_t)(npad * d * 2));
    w->vp = (uint16_t *)aligned_alloc(64, (size_t)(npad * d * 2));
    w->vl = (uint16_t *)aligned_alloc(64, (size_t)(npad * d * 2));
    w->ph = (uint16_t *)aligned_alloc(64, (size_t)(16 * npad * 2));
    w->pl = (uint16_t *)aligned_alloc(64, (size_t)(16 * npad * 2));
    w->qt = (uint16_t *)aligned_alloc(64, (size_t)(16 * d * 2));
    w->sc = (float *)aligned_alloc(64, (size_t)(16 * npad * 4));
    w->ct = (float *)aligned_alloc(64, (size_t)(4 * 256 * 4));
    w->row = (float *)aligned_alloc(64, (size_t)(2 * d * 4));
    w->acc = (float *)aligned_alloc(64, (size_t)(2 * 16 * d * 4));
    w->coded = (unsigned char *)malloc((size_t)npad);
    w->npad = npad;
    if (w->kt && w->kl && w->vp && w->vl && w->ph && w->pl && w->qt && w->sc && w->ct && w->row && w->acc && w->coded)
        return 0;
    w->npad = 0;
    return -1;
}

/* A quantized pool's keys and values as the tiles read them: a code times its bf16 scale is exact in fp32 (15 bits
 * at most), so its two bf16 parts (hi, and lo the rest) are the value exactly. The 4-bit schemes' key offsets are
 * not added to the keys (the sum would round): q . offsets, one per block and row, is added to the block's scores,
 * as the row kernel adds it. Values stored rotated (v @ H, the 4-bit schemes) are summed apart from the staged
 * rows' and turned back after, as the row kernel does. NULL codes: an exact pool. */
typedef struct {
    const uint8_t *k_codes, *v_codes;
    const uint16_t *k_scale, *v_scale, *k_offset; /* [N, Hkv, d] channel scales, [N, Hkv, bs] row scales, offsets */
    const float *v_rot;                           /* [d, d] or NULL */
    int64_t num_blocks; /* table entries from here on are staged rows (stage slot = entry - this) */
    int scheme;
    int skip_zeros; /* tile products of zeros left out (amx_attn_tile; INFER_AMX_SKIP_ZEROS=0: every one taken) */
} amx_codes;

/* Key t's d keys and values of KV head h as fp32 hi/lo bf16 parts into kh, kl, vh, vl (the run's table, keys from
 * the run's start); zeros past `n`. */
static int amx_key_parts(const uint16_t *ks, const uint16_t *vs, const amx_codes *cq, const int64_t *table, int64_t t,
                         int64_t n, int64_t h, int64_t kv_heads, int64_t bs, int64_t d, uint16_t *kh, uint16_t *kl,
                         uint16_t *vh, uint16_t *vl, float *row) {
    int64_t id = t < n ? table[t / bs] : 0, r = t % bs, dp = cq->scheme == Q_INT8 ? d : d / 2;
    if (t >= n || !cq->k_codes || id >= cq->num_blocks) { /* staged: exact bf16 rows */
        const uint16_t *k = t < n ? ks + (((id - cq->num_blocks) * kv_heads + h) * bs + r) * d : NULL;
        const uint16_t *v = t < n ? vs + (((id - cq->num_blocks) * kv_heads + h) * bs + r) * d : NULL;
        for (int64_t c = 0; c < d; c++) kh[c] = k ? k[c] : 0, vh[c] = v ? v[c] : 0, kl[c] = 0, vl[c] = 0;
        return 0;
    }
    decode_codes(cq->scheme, cq->k_codes + ((id * kv_heads + h) * bs + r) * dp, row, d);
    decode_codes(cq->scheme, cq->v_codes + ((id * kv_heads + h) * bs + r) * dp, row + d, d);
    const uint16_t *ksc = cq->k_scale + (id * kv_heads + h) * d;
    float vsc = bf16_to_f32(cq->v_scale[(id * kv_heads + h) * bs + r]);
    for (int64_t c = 0; c < d; c++) {
        float k = row[c] * bf16_to_f32(ksc[c]), v = row[d + c] * vsc;
        kh[c] = f32_to_bf16(k), kl[c] = f32_to_bf16(k - bf16_to_f32(kh[c]));
        vh[c] = f32_to_bf16(v), vl[c] = f32_to_bf16(v - bf16_to_f32(vh[c]));
    }
    return 1;
}

/* kt (kl): 16 keys x (d / 32) steps, tile (j, s) row p = pair 16s + p of keys 16j .. 16j + 15 (as 32-bit pairs: a
 * 16 x 16 transpose); vp (vl): 32 keys x (d / 16) column groups, tile (j, c) row p = keys 32j + 2p and + 1 side by
 * side for columns 16c .. 16c + 15. Zero past n keys; the lo parts only for a pool of codes. */
static void amx_lay_out_keys(const uint16_t *ks, const uint16_t *vs, const amx_codes *cq, const int64_t *table,
                             int64_t n, int64_t npad, int64_t h, int64_t kv_heads, int64_t bs, int64_t d,
                             amx_attn_buf *w) {
    int64_t steps = d / 32, groups = d / 16;
    uint16_t kh[256], kl[256], vh[256], vl[256];
    for (int64_t t = 0; t < npad; t++) {
        w->coded[t] = (unsigned char)amx_key_parts(ks, vs, cq, table, t, n, h, kv_heads, bs, d, kh, kl, vh, vl, w->row);
        for (int part = 0; part < (cq->k_codes ? 2 : 1); part++) {
            const uint16_t *k = part ? kl : kh, *v = part ? vl : vh;
            uint32_t *kt32 = (uint32_t *)(void *)(part ? w->kl : w->kt);
            for (int64_t s = 0; s < steps; s++)
                for (int p = 0; p < 16; p++) {
                    uint32_t pair;
                    memcpy(&pair, k + 32 * s + 2 * p, 4);
                    kt32[((t / 16 * steps + s) * 16 + p) * 16 + t % 16] = pair;
                }
            for (int64_t c = 0; c < groups; c++) {
                uint16_t *dst = (part ? w->vl : w->vp) + ((t / 32 * groups + c) * 16 + t % 32 / 2) * 32 + t % 2;
                for (int e = 0; e < 16; e++) dst[2 * e] = v[16 * c + e];
            }
        }
    }
}

/* M(0) .. M(nt - 1) for the sums tiles 0 .. 3 (constant indices: the tile instructions take no register operand);
 * sums tile cn zeroed, or stored to ct's 256 floats at cn */
#define AMX_UPTO(nt, M) do { M(0); if ((nt) > 1) M(1); if ((nt) > 2) M(2); if ((nt) > 3) M(3); } while (0)
#define AMX_ZERO(cn) _tile_zero(cn)
#define AMX_STORE(cn) _tile_stored(cn, w->ct + 256 * (cn), 64)

/* One run's rows rt0 .. rt0 + rows - 1 (rows <= 16) for query head qh of KV head h, kt/vp laid out. */
static void amx_attn_tile(const uint16_t *q, uint16_t *out, const int64_t *lengths, int64_t b0, int64_t rt0,
                          int64_t rows, int64_t start, int64_t qh, int64_t heads, int64_t d, float scale, float softcap,
                          int64_t window, const amx_codes *cq, const int64_t *table, int64_t h, int64_t kv_heads,
                          int64_t bs, amx_attn_buf *w) {
    int64_t n = lengths[b0 + rt0 + rows - 1] - start, n16 = (n + 15) / 16 * 16, n32 = (n + 31) / 32 * 32;
    int coded = cq->k_codes != NULL, passes = cq->v_rot ? 2 : 1; /* rotated values: the staged rows, the code rows */
    int skip = cq->skip_zeros; /* tile products of zeros left out */
    int64_t steps = d / 32, groups = d / 16, npad = w->npad;
    for (int64_t r = 0; r < 16; r++) /* the rows' queries, zero past the run */
        if (r < rows) memcpy(w->qt + r * d, q + ((b0 + rt0 + r) * heads + qh) * d, 2 * (size_t)d);
        else memset(w->qt + r * d, 0, 2 * (size_t)d);
    /* scores: 4 key tiles at a time, the query tile of each step loaded once for them */
    for (int64_t j = 0; j < n16 / 16; j += 4) {
        int nt = n16 / 16 - j < 4 ? (int)(n16 / 16 - j) : 4, klo[4] = {0, 0, 0, 0};
        for (int a = 0; coded && a < nt; a++) /* lo parts only where a tile holds code rows (exact rows' are 0) */
            klo[a] = !skip || memchr(w->coded + (j + a) * 16, 1, 16) != NULL;
        AMX_UPTO(nt, AMX_ZERO);
        for (int64_t s = 0; s < steps; s++) {
            const uint16_t *kb = w->kt + ((j * steps + s) * 16) * 32, *klb = w->kl + ((j * steps + s) * 16) * 32;
            _tile_loadd(4, w->qt + 32 * s, 2 * d);
            /* key tile cn into sums cn: its hi part, and a pool of codes' lo part */
#define AMX_KEYS(cn) do { _tile_loadd(6, kb + (cn) * steps * 512, 64); _tile_dpbf16ps(cn, 4, 6); \
                          if (klo[cn]) { _tile_loadd(7, klb + (cn) * steps * 512, 64); _tile_dpbf16ps(cn, 4, 7); } \
                     } while (0)
            AMX_UPTO(nt, AMX_KEYS);
#undef AMX_KEYS
        }
        AMX_UPTO(nt, AMX_STORE);
        for (int a = 0; a < nt; a++)
            for (int r = 0; r < 16; r++) memcpy(w->sc + r * npad + (j + a) * 16, w->ct + a * 256 + r * 16, 64);
    }
    /* a 4-bit pool's code blocks: q . offsets added to each row's scores of the block's keys */
    for (int64_t jb = 0; cq->k_codes && cq->k_offset && jb * bs < n; jb++) {
        int64_t id = table[jb];
        if (id >= cq->num_blocks) continue; /* staged: exact keys */
        const uint16_t *o = cq->k_offset + (id * kv_heads + h) * d;
        for (int64_t r = 0; r < rows; r++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 16)
                a = _mm512_add_ps(a, _mm512_mul_ps(bf16x16_load(w->qt + r * d + c), bf16x16_load(o + c)));
            float qo = _mm512_reduce_add_ps(a);
            for (int64_t t = jb * bs; t < (jb + 1) * bs && t < n; t++) w->sc[r * npad + t] += qo;
        }
    }
    /* each row as the row path: its scores times the scale, softmaxed over its own keys; 0 past them */
    for (int64_t r = 0; r < 16; r++) {
        float *s = w->sc + r * npad;
        int64_t nr = r < rows ? lengths[b0 + rt0 + r] - start : 0;
        for (int64_t t = 0; t < nr; t++) s[t] *= scale;
        if (nr) softmax_heads(s, 1, nr, 0, start, lengths[b0 + rt0 + r] - 1, softcap, window);
        for (int64_t t = nr; t < n32; t++) s[t] = 0.f;
    }
    for (int pass = 0; pass < passes; pass++) {
        for (int64_t r = 0; r < 16; r++) /* the probabilities as hi + lo in bf16 (a pass's keys only where two) */
            for (int64_t t = 0; t < n32; t += 16) {
                __m512 v = _mm512_loadu_ps(w->sc + r * npad + t);
                if (passes == 2)
                    v = _mm512_maskz_mov_ps(_mm_cmpeq_epi8_mask(_mm_loadu_si128((const __m128i *)(w->coded + t)),
                                                                _mm_set1_epi8((char)pass)), v);
                __m256i hi = (__m256i)_mm512_cvtneps_pbh(v);
                __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, bf16x16_widen(hi)));
                _mm256_storeu_si256((__m256i *)(w->ph + r * npad + t), hi);
                _mm256_storeu_si256((__m256i *)(w->pl + r * npad + t), lo);
            }
        /* values: 4 column groups of 16 at a time, each 32 keys' probabilities (hi, lo) loaded once for them */
        for (int64_t c = 0; c < groups; c += 4) {
            int nt = groups - c < 4 ? (int)(groups - c) : 4;
            AMX_UPTO(nt, AMX_ZERO);
            for (int64_t j = 0; j < n32 / 32; j++) {
                /* a rotated pool's pass skips 32 keys with none of its kind (their probabilities are masked to 0), and
                 * the values' lo parts are taken only where code rows are (exact rows' are 0): products of zeros
                 * left out, which change no sum (the sums tiles start at +0 and are never subnormal) */
                if (skip && passes == 2 && !memchr(w->coded + 32 * j, pass, 32)) continue;
                int lo = coded && (!skip || (passes == 2 ? pass == 1 : memchr(w->coded + 32 * j, 1, 32) != NULL));
                const uint16_t *vb = w->vp + ((j * groups + c) * 16) * 32, *vlb = w->vl + ((j * groups + c) * 16) * 32;
                _tile_loadd(4, w->ph + 32 * j, 2 * npad);
                _tile_loadd(5, w->pl + 32 * j, 2 * npad);
                /* column group c + cn into sums cn: both parts of the probabilities against the values' hi part, the
                 * hi probabilities against a pool of codes' lo part (lo times lo is under 2^-16 of the product) */
#define AMX_VALUES(cn) do { _tile_loadd(6, vb + (cn) * 512, 64); _tile_dpbf16ps(cn, 4, 6); _tile_dpbf16ps(cn, 5, 6); \
                            if (lo) { _tile_loadd(7, vlb + (cn) * 512, 64); _tile_dpbf16ps(cn, 4, 7); } \
                       } while (0)
                AMX_UPTO(nt, AMX_VALUES);
#undef AMX_VALUES
            }
            AMX_UPTO(nt, AMX_STORE);
            for (int a = 0; a < nt; a++)
                for (int64_t r = 0; r < rows; r++)
                    memcpy(w->acc + (pass * 16 + r) * d + 16 * (c + a), w->ct + a * 256 + r * 16, 64);
        }
    }
    for (int64_t r = 0; r < rows; r++) { /* the code rows' sums turned back (finish_heads' order), then stored */
        float *o = w->acc + r * d;
        if (passes == 2) rotate_back(w->acc + (16 + r) * d, cq->v_rot, o, d);
        store_row(BF16, o, out + ((b0 + rt0 + r) * heads + qh) * d, d);
    }
}

static int64_t amx_attention_rows = 0; /* rows taken here since the process began (infer_amx_attention_rows) */

/* The runs' rows (run u: rows first[u] .. first[u] + count[u] - 1) over an exact pool (NULL codes) or a quantized
 * one; -1 without memory. */
static int amx_chunk_attention(const uint16_t *q, const uint16_t *ks, const uint16_t *vs, int scheme,
                               const uint8_t *k_codes, const uint8_t *v_codes, const uint16_t *k_scale,
                               const uint16_t *v_scale, const uint16_t *k_offset, const float *v_rot,
                               int64_t num_blocks, const int64_t *tables, const int64_t *lengths, const int64_t *starts,
                               uint16_t *out, int64_t heads, int64_t kv_heads, int64_t d, int64_t bs, int64_t nb,
                               float scale, float softcap, int64_t window, const int64_t *first, const int64_t *count,
                               int64_t runs, int threads) {
    int failed = 0, per = (int)(heads / kv_heads);
    amx_codes cq = {k_codes, v_codes, k_scale, v_scale, k_offset, v_rot, num_blocks, scheme,
                    switched_on("INFER_AMX_SKIP_ZEROS")};
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        amx_attn_buf w = {0};
        amx_configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < runs * kv_heads; unit++) {
            int64_t u = unit / kv_heads, h = unit % kv_heads, b0 = first[u], start = starts[b0];
            int64_t n = lengths[b0 + count[u] - 1] - start, npad = (n + 31) / 32 * 32;
            if (amx_attn_grow(&w, npad, d)) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            /* the run's last row's table: every row's own blocks are a prefix of it (chunk_runs) */
            amx_lay_out_keys(ks, vs, &cq, tables + (b0 + count[u] - 1) * nb, n, npad, h, kv_heads, bs, d, &w);
            for (int64_t rt0 = 0; rt0 < count[u]; rt0 += 16)
                for (int64_t g = 0; g < per; g++)
                    amx_attn_tile(q, out, lengths, b0, rt0, count[u] - rt0 < 16 ? count[u] - rt0 : 16, start,
                                  h * per + g, heads, d, scale, softcap, window, &cq,
                                  tables + (b0 + count[u] - 1) * nb, h, kv_heads, bs, &w);
        }
        _tile_release();
        amx_attn_free(&w);
    }
    for (int64_t u = 0; !failed && u < runs; u++) __atomic_fetch_add(&amx_attention_rows, count[u], __ATOMIC_RELAXED);
    return failed ? -1 : 0;
}

#endif

/* Rows b .. of one prompt chunk: consecutive positions of one sequence (one start, each row's table the next one's
 * over its own blocks), at least AMX_RUN_ROWS of them, as runs (first, count) for amx_chunk_attention; `done` marks
 * their rows. Returns the number of runs. */
static int64_t chunk_runs(const int64_t *tables, const int64_t *lengths, const int64_t *starts, int64_t batch,
                          int64_t nb, int64_t bs, int64_t least, int64_t *first, int64_t *count, unsigned char *done) {
    int64_t runs = 0;
    for (int64_t b = 0; b < batch;) {
        int64_t e = b + 1;
        while (e < batch && starts[e] == starts[b] && lengths[e] == lengths[e - 1] + 1 &&
               memcmp(tables + (e - 1) * nb, tables + e * nb,
                      sizeof(int64_t) * (size_t)((lengths[e - 1] - starts[b] + bs - 1) / bs)) == 0)
            e++;
        if (e - b >= least) {
            first[runs] = b, count[runs] = e - b, runs++;
            memset(done + b, 1, (size_t)(e - b));
        }
        b = e;
    }
    return runs;
}

/* ---- the paged kernel's steps for one row (a query position) and one block of one KV head ----
 * qattn_paged's work items (a row's KV heads) and its prompt chunks' runs (qattn_run_rows: a block at a time for
 * several rows) both take these, so each row's scores and sums are the same operations on the same values either
 * way. `qattn_pool`: what they read of the pool and the call's constants. */
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

typedef struct {
    int dtype, scheme, fast, tiles, split, several, avx2, value_registers;
    const uint8_t *k_codes, *v_codes;
    const uint16_t *k_scale, *v_scale, *k_offset;
    const char *k_stage, *v_stage;
    int64_t kv_heads, groups, d, dp, bs, esize, num_blocks;
    float scale;
} qattn_pool;

/* A tile of decoded code rows read by each row of a run in turn (qattn_run_rows): `src` the codes it holds (NULL:
 * none), `rs` their row scales (values). A row path's call passes NULL: each decodes into its own scratch. */
typedef struct {
    const uint8_t *src;
    float *tile;
    float rs[16];
} shared_tile;

/* Row b's query heads of KV heads h0 .. (`all` of them) into w: natural and scaled (qf), and in the split form
 * (score_bf16_tile's) where bf16 rows are read in registers. */
static inline void load_queries(const qattn_pool *P, const void *q, int64_t b, int64_t heads, int64_t h0,
                                int64_t all, const qattn_scratch *w) {
    int64_t d = P->d;
    load_row(P->dtype, (const char *)q + (b * heads + h0 * P->groups) * d * P->esize, w->qf, all * d);
    for (int64_t i = 0; i < all * d; i++) w->qf[i] *= P->scale;
    for (int64_t g = 0; P->split && g < all; g++)
#if defined(HAVE_DOT_BF16)
        memcpy(w->qsplit + g * d, (const uint16_t *)q + (b * heads + h0 * P->groups + g) * d, 2 * (size_t)d);
#else
        permute(Q_INT4, w->qf + g * d, w->qsplit + g * d, d);
#endif
}

/* Scores of one row's query heads o .. o + groups - 1 (of its item) against block `id`'s keys of KV head h, its
 * keys t0 .. t0 + rows - 1 of n: staged exact rows, or codes (their channel scales folded into the queries). */
static inline void block_scores(const qattn_pool *P, const qattn_scratch *w, int64_t o, int64_t id, int64_t h,
                                int64_t n, int64_t t0, int64_t rows, shared_tile *shared) {
    int64_t groups = P->groups, d = P->d, esize = P->esize;
    float *sch = w->sc + o * n, *qfh = w->qf + o * d;
    if (id >= P->num_blocks) { /* staged: exact rows */
        const char *ks = P->k_stage + ((id - P->num_blocks) * P->kv_heads + h) * P->bs * d * esize;
        int64_t r = 0;
        if (P->split) /* a block's last rows too where it has 16 slots from r to read (the scores past `rows` are
                       * not kept) */
            for (; r < rows && r + 16 <= P->bs; r += 16)
                score_bf16_tile(ks + r * d * esize, w->qsplit + o * d, P->scale, sch, groups, n, t0 + r, d,
                                rows - r < 16 ? rows - r : 16);
        if (P->fast && P->tiles)
            for (; r + 16 <= rows; r += 16)
                score_exact_tile(P->dtype, ks + r * d * esize, esize, qfh, w->tile, sch, groups, n, t0 + r, d,
                                 P->avx2);
        for (; r < rows; r++) {
            load_row(P->dtype, ks + r * d * esize, w->row, d);
            for (int64_t g = 0; g < groups; g++) sch[g * n + t0 + r] = dot_f32(qfh + g * d, w->row, d);
        }
        return;
    }
    fold_key_scales(P->scheme, P->fast, qfh, P->k_scale + (id * P->kv_heads + h) * d,
                    P->k_offset ? P->k_offset + (id * P->kv_heads + h) * d : 0, w->qs, w->qp, w->qo, groups, d);
    const uint8_t *codes = P->k_codes + (id * P->kv_heads + h) * P->bs * P->dp;
    int64_t r = 0;
    if (P->fast && P->tiles)
        for (; r + 16 <= rows; r += 16) {
            const uint8_t *c = codes + r * P->dp;
            float *tile = shared ? shared->tile : w->tile;
            if (!shared || shared->src != c) decode_code_tile(P->scheme, P->dp, c, tile, d);
            if (shared) shared->src = c;
            score_decoded_tile(tile, w->qp, w->qo, NULL, sch, groups, n, t0 + r, d, P->avx2);
        }
    for (; r < rows; r++)
        score_code_row(P->scheme, P->fast, codes + r * P->dp, w->qp, w->qs, w->qo, 1.f, w->row, sch, groups, n,
                       t0 + r, d);
}

/* Block `id`'s values of KV head h (its keys t0 .. t0 + rows - 1 of n) into one row's sums of query heads o ..:
 * exact rows into acc (bf16 ones widened in registers: accsplit), code rows into accp. A shared tile holds every row
 * of a tile of codes (decoded once for the run's rows, each of which reads its first `rt`). */
static inline void block_values(const qattn_pool *P, const qattn_scratch *w, int64_t o, int64_t id, int64_t h,
                                int64_t n, int64_t t0, int64_t rows, shared_tile *shared) {
    int64_t groups = P->groups, d = P->d, esize = P->esize, bs = P->bs, dp = P->dp;
    int coded = id < P->num_blocks;
    float *sch = w->sc + o * n, *acch = w->acc + o * d, *accph = w->accp + o * d;
    const char *vs = coded ? 0 : P->v_stage + ((id - P->num_blocks) * P->kv_heads + h) * bs * d * esize;
    const uint8_t *codes = coded ? P->v_codes + (id * P->kv_heads + h) * bs * dp : 0;
    const uint16_t *vsc = coded ? P->v_scale + (id * P->kv_heads + h) * bs : 0;
    int64_t r = 0;
    if (P->split && !coded)
        for (; r < rows; r += 16)
            add_bf16_value_tile(vs + r * d * esize, sch, w->accsplit + o * d, groups, n, t0 + r,
                                rows - r < 16 ? rows - r : 16, d);
    if (P->fast && P->tiles && d <= 256) /* up to 16 rows at once, the sums in registers */
        for (; r < rows; r += 16) {
            int64_t rt = rows - r < 16 ? rows - r : 16;
            float own[16], *rs = own, *tile = w->tile;
            const uint8_t *in_place = NULL;
            if (coded && shared) {
                if (shared->src != codes + r * dp)
                    for (int64_t k = 0; k < 16 && r + k < bs; k++) {
                        decode_row(P->scheme, P->fast, codes + (r + k) * dp, shared->tile + k * d, d);
                        shared->rs[k] = bf16_to_f32(vsc[r + k]);
                    }
                shared->src = codes + r * dp;
                tile = shared->tile, rs = shared->rs;
            } else if (coded && P->value_registers) { /* no tile: the codes widened as they are summed */
                for (int64_t k = 0; k < rt; k++) rs[k] = bf16_to_f32(vsc[r + k]);
                in_place = codes + r * dp;
            } else {
                for (int64_t k = 0; k < rt; k++) {
                    rs[k] = 1.f;
                    if (coded) {
                        decode_row(P->scheme, P->fast, codes + (r + k) * dp, tile + k * d, d);
                        rs[k] = bf16_to_f32(vsc[r + k]);
                    } else {
                        load_row(P->dtype, vs + (r + k) * d * esize, tile + k * d, d);
                    }
                }
            }
            add_value_tile(tile, in_place, P->scheme, dp, sch, rs, coded ? accph : acch, groups, n, t0 + r, rt, d,
                           P->several, P->avx2);
        }
    for (; r < rows; r++) {
        float rs = 1.f;
        if (coded) {
            decode_row(P->scheme, P->fast, codes + r * dp, w->row, d);
            rs = bf16_to_f32(vsc[r]);
        } else {
            load_row(P->dtype, vs + r * d * esize, w->row, d);
        }
        add_value_row(coded, P->fast, w->row, sch, rs, acch, accph, groups, n, t0 + r, d);
    }
}

/* One row's sums of `all` query heads zeroed before its values. */
static inline void clear_sums(const qattn_pool *P, const qattn_scratch *w, int64_t all) {
    memset(w->acc, 0, sizeof(float) * (size_t)(all * P->d));
    memset(w->accp, 0, sizeof(float) * (size_t)(all * P->d));
    if (P->split) memset(w->accsplit, 0, sizeof(float) * (size_t)(all * P->d));
}

/* One row's `all` query heads finished and stored from out's head `first` on (finish_heads). */
static inline void finish_row(const qattn_pool *P, const float *v_rot, const qattn_scratch *w, int64_t all,
                              void *out, int64_t first) {
    for (int64_t g = 0; P->split && g < all; g++)
        unpermute_add(Q_INT4, w->accsplit + g * P->d, w->acc + g * P->d, P->d);
    /* an exact pool has no code rows: nothing in accp to put back in order */
    finish_heads(P->dtype, P->scheme, P->fast && P->v_codes, v_rot, w->accp, w->acc, w->row, all, P->d, out, first);
}

/* ---- a prompt chunk's rows a run at a time, without AMX ----
 * The work items take each row of a prompt chunk on its own, so each decodes the same code blocks again (an int8
 * pool's 8 x 512-token prompts 1.13x the bf16 pool's time on a 2-core Zen 3, int4's 1.28x). A run of a chunk's rows
 * (chunk_runs, QATTN_RUN_ROWS at a time) is taken here per KV head, a block at a time for all its rows, each tile of
 * codes decoded once into a shared tile that every row then scores or sums as its own (block_scores, block_values):
 * the same operations on the same values as the row path, so the same bits. INFER_QATTN_RUNS=0: each row alone. */
#define QATTN_RUN_ROWS 16

static int qattn_runs(void) { return switched_on("INFER_QATTN_RUNS"); }

static int64_t qattn_run_rows_taken = 0; /* rows taken as runs since the process began (infer_qattn_run_rows) */

/* How many rows of prompt chunks over a quantized pool the paged attention has taken as runs (qattn_run_all) in this
 * process: the tests' witness that a chunk took them. */
int64_t infer_qattn_run_rows(void) { return __atomic_load_n(&qattn_run_rows_taken, __ATOMIC_RELAXED); }

/* Rows b0 .. b0 + rn - 1 (rn <= QATTN_RUN_ROWS) of one run, KV head h; bufs: QATTN_RUN_ROWS qattn_alloc buffers of
 * one head's queries for their keys, `tile` 16 rows of d. */
static void qattn_run_rows(const qattn_pool *P, const void *q, const float *v_rot, const int64_t *tables,
                           const int64_t *lengths, const int64_t *starts, void *out, int64_t b0, int64_t rn, int64_t h,
                           int64_t heads, int64_t nb, float softcap, int64_t window, float *const *bufs, float *tile) {
    qattn_scratch w[QATTN_RUN_ROWS];
    int64_t n[QATTN_RUN_ROWS], groups = P->groups, d = P->d, bs = P->bs;
    const int64_t *table = tables + (b0 + rn - 1) * nb; /* the last row's: every row's blocks are a prefix of it */
    shared_tile sh = {NULL, tile, {0}};
    for (int64_t i = 0; i < rn; i++) {
        n[i] = lengths[b0 + i] - starts[b0 + i];
        w[i] = qattn_carve(bufs[i], groups, d, n[i]);
        load_queries(P, q, b0 + i, heads, h, groups, &w[i]);
    }
    for (int64_t j = 0; j * bs < n[rn - 1]; j++) /* (the rows' keys in this block: up to bs) */
        for (int64_t i = 0; i < rn; i++)
            if (n[i] > j * bs) block_scores(P, &w[i], 0, table[j], h, n[i], j * bs, min64(n[i] - j * bs, bs), &sh);
    sh.src = NULL;
    for (int64_t i = 0; i < rn; i++) {
        softmax_heads(w[i].sc, groups, n[i], 0, starts[b0 + i], lengths[b0 + i] - 1, softcap, window);
        clear_sums(P, &w[i], groups);
    }
    for (int64_t j = 0; j * bs < n[rn - 1]; j++)
        for (int64_t i = 0; i < rn; i++)
            if (n[i] > j * bs) block_values(P, &w[i], 0, table[j], h, n[i], j * bs, min64(n[i] - j * bs, bs), &sh);
    for (int64_t i = 0; i < rn; i++) finish_row(P, v_rot, &w[i], groups, out, (b0 + i) * heads + h * groups);
}

/* The runs (run u: rows first[u] .. first[u] + count[u] - 1) by qattn_run_rows, QATTN_RUN_ROWS rows and one KV head a
 * work item, the longest (the last rows of a run) first; -1 without memory. */
static int qattn_run_all(const qattn_pool *P, const void *q, const float *v_rot, const int64_t *tables,
                         const int64_t *lengths, const int64_t *starts, void *out, int64_t heads, int64_t nb,
                         float softcap, int64_t window, const int64_t *first, const int64_t *count, int64_t runs,
                         int threads) {
    int64_t parts = 0, nmax = 1;
    for (int64_t u = 0; u < runs; u++) {
        parts += (count[u] + QATTN_RUN_ROWS - 1) / QATTN_RUN_ROWS;
        int64_t last = first[u] + count[u] - 1;
        if (lengths[last] - starts[last] > nmax) nmax = lengths[last] - starts[last];
    }
    int64_t *part_b0 = (int64_t *)malloc(2 * sizeof(int64_t) * (size_t)parts), *part_rn = part_b0 + parts;
    if (!part_b0) return -1;
    for (int64_t u = 0, p = 0; u < runs; u++)
        for (int64_t r = 0; r < count[u]; r += QATTN_RUN_ROWS, p++)
            part_b0[p] = first[u] + r, part_rn[p] = min64(count[u] - r, QATTN_RUN_ROWS);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *bufs[QATTN_RUN_ROWS], *tile = (float *)aligned_alloc(64, sizeof(float) * 16 * (size_t)P->d);
        int ok = tile != NULL;
        for (int i = 0; i < QATTN_RUN_ROWS; i++) ok &= (bufs[i] = qattn_alloc(P->groups, P->d, nmax)) != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = parts * P->kv_heads - 1; unit >= 0; unit--)
            if (ok)
                qattn_run_rows(P, q, v_rot, tables, lengths, starts, out, part_b0[unit / P->kv_heads],
                               part_rn[unit / P->kv_heads], unit % P->kv_heads, heads, nb, softcap, window, bufs, tile);
        for (int i = 0; i < QATTN_RUN_ROWS; i++) free(bufs[i]);
        free(tile);
    }
    free(part_b0);
    for (int64_t u = 0; !failed && u < runs; u++) __atomic_fetch_add(&qattn_run_rows_taken, count[u], __ATOMIC_RELAXED);
    return failed ? -1 : 0;
}

/* The engine's quantized pool (infer/cache/paged_quantized.py), one-token queries of B sequences read through
 * their block tables: q [B, H, D]; a full block's codes [N, Hkv, bs, D or D/2] with channel scales (and offsets)
 * [N, Hkv, D] for keys and row scales [N, Hkv, bs] for values (rows stored rotated with v_rot); a table entry
 * >= num_blocks names a staged block, exact in stage [P, Hkv, bs, D] at slot entry - num_blocks. Sequence b's keys
 * are positions starts[b] .. lengths[b] - 1, its table's blocks in order; the query sits at the last. In bf16,
 * a prompt chunk's rows (chunk_runs) take the AMX tiles where the build and the CPU have them (amx_chunk_attention);
 * else, over a quantized pool, runs of them each code tile decoded once (qattn_run_all); the work items below skip
 * the rows either took. */
static int qattn_paged(int dtype, int scheme, const void *q, const uint8_t *k_codes, const uint8_t *v_codes,
                       const uint16_t *k_scale, const uint16_t *v_scale, const uint16_t *k_offset,
                       const float *v_rot, const void *k_stage, const void *v_stage, const int64_t *tables,
                       const int64_t *lengths, const int64_t *starts, void *out, int64_t batch, int64_t heads,
                       int64_t kv_heads, int64_t d, int64_t bs, int64_t nb, int64_t num_blocks, float scale,
                       float softcap, int64_t window, int threads, float *const *scratch) {
    int64_t esize = dtype == F32 ? 4 : 2, groups = heads / kv_heads;
    int64_t dp = scheme == Q_INT8 ? d : d / 2, nmax = 1;
    int fast = d % 32 == 0, tiles = qattn_tiles(), several = qattn_value_heads(), avx2 = qattn_avx2_tiles();
    int side = k_codes && kv_stream_scales();
    /* value codes widened in registers where the tiles would sum several heads at once (not AVX2's register tiles) */
    int value_registers = fast && tiles && several && (d == 64 || d == 128) && qattn_value_registers();
#if defined(HAVE_AVX2_ROWS)
    value_registers = value_registers && !avx2;
#endif
    /* bf16 exact rows widened in registers as they are read (bf16_halves), where the plain tiles copy them */
    int split = tiles && dtype == BF16 && (d == 64 || d == 128);
    /* KV heads per work item: a sequence's every head, block by block, where there are sequences enough for the
     * threads (a block's heads lie next to each other: one run through memory, which streams at twice the rate
     * of one head's rows of every block and overlaps the arithmetic); else one head each, so that a few long
     * sequences still spread over the threads. A caller's scratch is sized for one head's queries. */
    int64_t hs = batch >= 2 * threads && !scratch && qattn_heads_at_once() ? kv_heads : 1, items = kv_heads / hs;
    for (int64_t b = 0; b < batch; b++)
        if (lengths[b] - starts[b] > nmax) nmax = lengths[b] - starts[b];
    qattn_pool P = {dtype, scheme, fast, tiles, split, several, avx2, value_registers, k_codes, v_codes, k_scale,
                    v_scale, k_offset, (const char *)k_stage, (const char *)v_stage, kv_heads, groups, d, dp, bs, esize, num_blocks,
                    scale};
    int failed = 0;
    unsigned char *done = NULL; /* rows of prompt chunks taken on AMX tiles, or as runs (qattn_run_all) */
#if defined(HAVE_AMX)
    if (dtype == BF16 && !scratch && batch >= AMX_RUN_ROWS && d % 32 == 0 && d <= 256 && amx_takes(d)) {
        int64_t *first = (int64_t *)malloc(2 * sizeof(int64_t) * (size_t)batch);
        done = (unsigned char *)calloc((size_t)batch, 1);
        if (!first || !done) {
            free(first), free(done);
            return -1;
        }
        int64_t runs = chunk_runs(tables, lengths, starts, batch, nb, bs, AMX_RUN_ROWS, first, first + batch, done);
        if (runs && amx_chunk_attention((const uint16_t *)q, (const uint16_t *)k_stage, (const uint16_t *)v_stage,
                                        scheme, k_codes, v_codes, k_scale, v_scale, k_offset, v_rot, num_blocks,
                                        tables, lengths, starts,
                                        (uint16_t *)out, heads, kv_heads, d, bs, nb, scale, softcap, window, first,
                                        first + batch, runs, threads))
            failed = 1;
        free(first);
        if (failed || !runs) { /* (no run: the work items below check nothing) */
            free(done);
            done = NULL;
            if (failed) return -1;
        }
    }
#endif
    /* a quantized pool's prompt chunks without AMX: runs of rows, each code tile decoded once for a run */
    if (!done && k_codes && num_blocks > 0 && !scratch && batch >= 2 && fast && tiles && d <= 256 && qattn_runs()) {
        int64_t *first = (int64_t *)malloc(2 * sizeof(int64_t) * (size_t)batch);
        done = (unsigned char *)calloc((size_t)batch, 1);
        int64_t runs = first && done ? chunk_runs(tables, lengths, starts, batch, nb, bs, 2, first, first + batch, done)
                                     : -1;
        if (runs > 0 && qattn_run_all(&P, q, v_rot, tables, lengths, starts, out, heads, nb, softcap, window, first,
                                      first + batch, runs, threads))
            runs = -1;
        free(first);
        if (runs <= 0) {
            free(done);
            done = NULL;
            if (runs < 0) return -1;
        }
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        float *buf = scratch ? scratch[thread] : qattn_alloc(hs * groups, d, nmax);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        /* the pool's reads as one stream (see kv_stream) */
        kv_stream reads = {tables, lengths, starts, (const char *)k_stage, (const char *)v_stage,
                           (const char *)k_codes, (const char *)v_codes, nb, bs, num_blocks, bs * d * esize, bs * dp,
                           kv_heads, hs, items, batch * items, -1, 0, 0, 0, done,
                           side ? k_scale : NULL, side ? k_offset : NULL, side ? v_scale : NULL, d};
#pragma omp for schedule(static)
        for (int64_t item = 0; item < batch * items; item++) {
            if (!buf || (done && done[item / items])) continue;
            int64_t b = item / items, h0 = item % items * hs, n = lengths[b] - starts[b], qpos = lengths[b] - 1;
            if (reads.item < 0) { /* this thread's first item: the stream starts here, its distance ahead */
                reads.item = item;
                kv_stream_ahead(&reads, KV_STREAM_AHEAD);
            }
            int64_t all = hs * groups; /* the item's query heads: KV head h0 + g / groups for query head g */
            qattn_scratch w = qattn_carve(buf, all, d, n);
            const int64_t *table = tables + b * nb;
            load_queries(&P, q, b, heads, h0, all, &w);
            /* scores, block by block, each block's KV heads in turn */
            for (int64_t j = 0; j * bs < n; j++)
                for (int64_t h = h0; h < h0 + hs; h++) {
                    kv_stream_ahead(&reads, kv_stream_bytes(&reads, table[j]));
                    block_scores(&P, &w, (h - h0) * groups, table[j], h, n, j * bs, min64(n - j * bs, bs), NULL);
                }
            softmax_heads(w.sc, all, n, 0, starts[b], qpos, softcap, window); /* key t at position starts[b] + t */
            clear_sums(&P, &w, all);
            for (int64_t j = 0; j * bs < n; j++)
                for (int64_t h = h0; h < h0 + hs; h++) {
                    kv_stream_ahead(&reads, kv_stream_bytes(&reads, table[j]));
                    block_values(&P, &w, (h - h0) * groups, table[j], h, n, j * bs, min64(n - j * bs, bs), NULL);
                }
            finish_row(&P, v_rot, &w, all, out, b * heads + h0 * groups);
        }
        if (!scratch) free(buf);
    }
    free(done);
    return failed ? -1 : 0;
}

/* scratch: NULL, or one qattn_alloc buffer per thread for the longest sequence (the caller's, so nothing here can
 * fail); see qattn_paged. */
int infer_qattn_paged(int dtype, int scheme, const void *q, const uint8_t *k_codes, const uint8_t *v_codes,
                      const uint16_t *k_scale, const uint16_t *v_scale, const uint16_t *k_offset,
                      const float *v_rot, const void *k_stage, const void *v_stage, const int64_t *tables,
                      const int64_t *lengths, const int64_t *starts, void *out, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t d, int64_t bs, int64_t nb, int64_t num_blocks, float scale,
                      float softcap, int64_t window, int threads) {
    return qattn_paged(dtype, scheme, q, k_codes, v_codes, k_scale, v_scale, k_offset, v_rot, k_stage, v_stage, tables,
                       lengths, starts, out, batch, heads, kv_heads, d, bs, nb, num_blocks, scale, softcap, window,
                       threads, NULL);
}

/* ---- a few rows at once: the batched engine's decode steps on bf16 weights ----
 * y[j, r] = sum_i w[r, i] x[j, i] (+ bias[r]) for m rows of x `[m, k]` and n rows of w `[n, k]`, all bf16, each
 * sum in fp32 rounded once. At 2-64 rows ATen's bf16 GEMM reaches a third of the machine's matmul rate (at 16
 * rows it moves the weights at 20 of the 50 GB/s a 2-core EPYC reads: it repacks them on every call). Here each
 * thread streams its own rows of w once, in tiles of 4 weight rows against 4 rows of x: 16 sums in registers, 8
 * loads per 16 pair instructions, x staying in cache across the tiles; the 16 sums are folded at once
 * (sum16x16). Returns -2 where the build has no bf16 pair instruction (nothing written). */
#if defined(HAVE_DOT_BF16)
/* One tile: weight rows wr[0..3] (the first `rt` real; spare ones repeat a row) against every row of x `[m, k]`,
 * into y's columns r..r+rt-1 (+ bias[r + a]). `pf`..`pf_end` (the tile after next's bytes) are prefetched,
 * `per_iter` cache lines per iteration, while this tile runs: into L2, not L1, where x's rows streaming through
 * L1 would evict them before their tile comes (a decode step's weights at 8 rows 1.4x faster, at 16 1.1x, at 32
 * and more ~3%, on a 2-core EPYC; the tile after next rather than the next, ~4% at 4-8 rows). */
static inline void gemm_tile_bf16(const uint16_t *const wr[4], int rt, const uint16_t *x, const uint16_t *bias,
                                  uint16_t *y, int64_t m, int64_t n, int64_t k, int64_t r, const char *pf,
                                  const char *pf_end, int64_t per_iter) {
    for (int64_t j = 0; j < m; j += 4) {
        int jt = m - j < 4 ? (int)(m - j) : 4;
        const uint16_t *xr[4];
        for (int b = 0; b < 4; b++) xr[b] = x + (j + (b < jt ? b : jt - 1)) * k;
        __m512 acc[16];
        for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 32 <= k; i += 32) {
            __m512bh wv[4], xv[4];
            for (int64_t q = 0; q < per_iter && pf < pf_end; q++, pf += 64) __builtin_prefetch(pf, 0, 2);
            for (int a = 0; a < 4; a++) wv[a] = (__m512bh)_mm512_loadu_si512(wr[a] + i);
            for (int b = 0; b < 4; b++) xv[b] = (__m512bh)_mm512_loadu_si512(xr[b] + i);
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++) acc[a * 4 + b] = _mm512_dpbf16_ps(acc[a * 4 + b], wv[a], xv[b]);
        }
        if (i < k) {
            __mmask32 mask = (__mmask32)((1u << (k - i)) - 1);
            __m512bh wv[4], xv[4];
            for (int a = 0; a < 4; a++) wv[a] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[a] + i);
            for (int b = 0; b < 4; b++) xv[b] = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[b] + i);
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++) acc[a * 4 + b] = _mm512_dpbf16_ps(acc[a * 4 + b], wv[a], xv[b]);
        }
        qv16 sums = sum16x16((const qv16 *)acc);
        if (rt == 4) { /* lanes a*4+b to b*4+a: each x row's 4 outputs side by side, rounded and stored at once
                        * (16 scalar roundings and stores cost 15-20% of a tile at k = 768) */
            __m512 t = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                             (__m512)sums);
            if (bias) /* bias[r + a] in lane b*4+a */
                t = _mm512_add_ps(t, bf16x16_widen(_mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(bias + r)))));
            __m256i h = bf16x16_round(t);
            uint64_t out[4];
            memcpy(out, &h, sizeof out);
            for (int b = 0; b < jt; b++) memcpy(y + (j + b) * n + r, &out[b], 8);
            continue;
        }
        for (int a = 0; a < rt; a++)
            for (int b = 0; b < jt; b++) {
                float v = sums[a * 4 + b] + (bias ? bf16_to_f32(bias[r + a]) : 0.f);
                y[(j + b) * n + r + a] = f32_to_bf16(v);
            }
    }
}
#endif

int infer_gemm_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                    int64_t k, int threads) {
#if defined(HAVE_DOT_BF16)
    if (m <= 0 || n <= 0 || k <= 0) return 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t r0, r1;
        thread_rows(n, &r0, &r1);
        /* The tile after next's rows (contiguous) are prefetched while this tile runs over every group of x, spread
         * evenly over its iterations: memory and arithmetic overlap instead of the first group waiting on DRAM. */
        int64_t lines = 4 * k * 2 / 64, iters = ((m + 3) / 4) * ((k + 31) / 32);
        int64_t per_iter = (lines + iters - 1) / iters;
        for (int64_t r = r0; r < r1; r += 4) {
            int rt = r1 - r < 4 ? (int)(r1 - r) : 4;
            const uint16_t *wr[4];
            for (int a = 0; a < 4; a++) wr[a] = w + (r + (a < rt ? a : rt - 1)) * k; /* spare lanes repeat a row */
            const char *pf = (const char *)(w + (r + 8) * k), *pf_end = (const char *)(w + (r1 < r + 12 ? r1 : r + 12) * k);
            gemm_tile_bf16(wr, rt, x, bias, y, m, n, k, r, pf, pf_end, per_iter);
        }
    }
    return 0;
#else
    (void)w, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)threads;
    return -2;
#endif
}

/* ---- the few-row bf16 product on a packed weight: outputs as lanes ----
 * infer_gemm_bf16's tiles hold 16 partial sums of one output per register and fold them at the end of every tile
 * (sum16x16: ~11% of a tile at k = 768). Here the weight is packed once (infer_pack_bf16) in blocks of 16 rows with
 * each row's pairs interleaved, P[b][p][l][e] = W[16b + l][2p + e] (zero past n), so one 64-byte load holds pair p
 * of 16 rows, and the pair instruction against x's pair p broadcast to every lane adds to 16 outputs at once: a
 * lane is an output, its sum runs over k in order and is rounded as it stands, no fold. A tile is 8 input rows by
 * 2 blocks (16 sums in registers, 2 loads of weights and 8 broadcasts a step); every output is still its own row's
 * fp32 sum, so it does not depend on the other rows of the call. Over a 150M Llama's decode-step weights on a
 * 2-core EPYC (Zen 4), from memory: 16 rows 1.36x infer_gemm_bf16, 64 rows 1.39x (and 1.12x oneDNN on its own
 * packed copy), 512 rows level with oneDNN. Needs even k (x's pairs are read whole). */
/* W [n, k] (k even) into `p`: 16 * ceil(n / 16) * k values. */
void infer_pack_bf16(const uint16_t *w, uint16_t *p, int64_t n, int64_t k, int threads) {
    int64_t pairs = k / 2, blocks = (n + 15) / 16;
    const uint32_t *w32 = (const uint32_t *)(const void *)w;
    uint32_t *p32 = (uint32_t *)(void *)p;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int l = 0; l < 16; l++) {
            int64_t r = 16 * b + l;
            uint32_t *dst = p32 + b * pairs * 16 + l;
            if (r >= n) {
                for (int64_t q = 0; q < pairs; q++) dst[q * 16] = 0;
                continue;
            }
            for (int64_t q = 0; q < pairs; q++) memcpy(dst + q * 16, w32 + r * pairs + q, 4);
        }
}

/* Whether the pair instruction's packed tiles (packed_tile_bf16, AVX512-BF16) run their pairs that prefetch as a loop
 * of their own (1, INFER_PREFETCH_LOOPS unset) or test the prefetch range in every pair (0, the first form: the same
 * sums, only the loop differs). AVX2's tiles keep one loop: gcc splits it there itself. */
static int prefetch_loops(void) { return switched_on("INFER_PREFETCH_LOOPS"); }

/* Where a product's sums go: rows of n outputs, fp32 (`f32`: each sum plus the bias) or bf16 (the same, rounded
 * once), the bias (or NULL) in the same dtype. AVX2's codes in the channel form write either: a bf16 model's rows
 * (infer_qgemm_packed), or an fp32 model's (infer_qgemm_packed_f32). */
typedef struct {
    void *y;
    const void *bias;
    int64_t n;
    int f32;
} sums_out;

/* `o` from its row j on. */
static inline sums_out rows_from(sums_out o, int64_t j) {
    o.y = (char *)o.y + j * o.n * (o.f32 ? 4 : 2);
    return o;
}

#if defined(__AVX2__) && defined(__FMA__)
/* 8 sums of columns c .. c + 7 (+ bias) into y's row, masked past n. */
static inline void store_sums_f32(__m256 v, const float *bias, float *row, int64_t c, int64_t n) {
    if (c + 8 <= n) {
        _mm256_storeu_ps(row + c, bias ? _mm256_add_ps(v, _mm256_loadu_ps(bias + c)) : v);
        return;
    }
    float sums[8];
    _mm256_storeu_ps(sums, v);
    for (int l = 0; l < 8 && c + l < n; l++) row[c + l] = sums[l] + (bias ? bias[c + l] : 0.f);
}

/* 8 sums of columns c .. c + 7 (+ bias) rounded into y's row, masked past n. Whole vectors 8 lanes at a time (the
 * same fp32 add and rounding: the scalar loop was 3% of a 16-request decode step on a Zen 3 EPYC). */
static inline void store_sums_bf16(__m256 v, const uint16_t *bias, uint16_t *row, int64_t c, int64_t n) {
#if defined(HAVE_AVX2_ROWS)
    if (c + 8 <= n) {
        if (bias) v = _mm256_add_ps(v, bf16x8_load(bias + c));
        _mm_storeu_si128((__m128i *)(row + c), bf16x8_round(v));
        return;
    }
#endif
    float sums[8];
    _mm256_storeu_ps(sums, v);
    for (int l = 0; l < 8 && c + l < n; l++) row[c + l] = f32_to_bf16(sums[l] + (bias ? bf16_to_f32(bias[c + l]) : 0.0f));
}

/* 8 sums of columns c .. c + 7 into row j of `o`, in its dtype (store_sums_f32 or store_sums_bf16). */
static inline void store_sums(__m256 v, sums_out o, int64_t j, int64_t c) {
    if (o.f32)
        store_sums_f32(v, (const float *)o.bias, (float *)o.y + j * o.n, c, o.n);
    else
        store_sums_bf16(v, (const uint16_t *)o.bias, (uint16_t *)o.y + j * o.n, c, o.n);
}
#endif

#if defined(HAVE_DOT_BF16)
#define HAVE_PACKED_BF16 1
#define PACK_ROWS 8   /* input rows of a tile */
#define PACK_BLOCKS 2 /* weight blocks of 16 rows of a tile */

/* Pair q of a tile (packed_tile_bf16's): its blocks' weights against each row's pair q of x. */
#define PACKED_PAIR_BF16(q)                                                                            \
    do {                                                                                               \
        __m512bh wv[PACK_BLOCKS];                                                                      \
        for (int a = 0; a < PACK_BLOCKS; a++)                                                          \
            wv[a] = (__m512bh)_mm512_loadu_si512(pb + ((a < nb ? a : 0) * pairs + (q)) * 32);          \
        for (int j = 0; j < mr; j++) {                                                                 \
            int32_t pair;                                                                              \
            memcpy(&pair, x + j * k + 2 * (q), 4);                                                     \
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                           \
            for (int a = 0; a < PACK_BLOCKS; a++) acc[a][j] = _mm512_dpbf16_ps(acc[a][j], wv[a], xv); \
        }                                                                                              \
    } while (0)

/* A tile's sums `acc` [block][row] (+ bias) rounded into y's columns c .. c + 16 nb - 1, masked past n. */
#define store_tile_bf16(mr, acc, nb, bias, y, n, c)                                                              \
    do {                                                                                                         \
        for (int a_ = 0; a_ < (nb); a_++) {                                                                      \
            int64_t col = (c) + 16 * a_, left = (n) - col;                                                       \
            __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);                     \
            __m512 bv = (bias) ? bf16x16_widen(_mm256_maskz_loadu_epi16(mask, (bias) + col)) : _mm512_setzero_ps(); \
            for (int j_ = 0; j_ < (mr); j_++)                                                                    \
                _mm256_mask_storeu_epi16((y) + j_ * (n) + col, mask, bf16x16_round(_mm512_add_ps(acc[a_][j_], bv))); \
        }                                                                                                        \
    } while (0)

/* Input rows x[0 .. mr-1] against blocks pb[0 .. nb-1] (spare block lanes repeat block 0), into y's columns
 * c .. c + 16 nb - 1 (+ bias), masked past n. `pf` .. `pf_end`: bytes prefetched into L2 while the tile runs,
 * `per_iter` (1 or 2) lines a pair until they are out. Its first pairs, one line (or two) each, then the rest, as
 * two loops (`loops`): tested in every pair, the range and its count took 19 of the 16-row tile's 51 instructions a
 * pair (gcc kept 6 of its pointers in vector registers), and the product ran at 0.87x from L2 and 0.87-0.91x over
 * a 150M Llama's decode-step weights from DRAM at 16 rows (a 2-core Zen 4 EPYC). */
static inline __attribute__((always_inline)) void packed_tile_bf16(int mr, const uint16_t *pb, int64_t pairs,
                                                                   const uint16_t *x, int64_t k,
                                                                   const uint16_t *bias, uint16_t *y, int64_t n,
                                                                   int64_t c, int nb, const char *pf,
                                                                   const char *pf_end, int64_t per_iter, int loops) {
    __m512 acc[PACK_BLOCKS][PACK_ROWS];
    for (int a = 0; a < PACK_BLOCKS; a++)
        for (int j = 0; j < mr; j++) acc[a][j] = _mm512_setzero_ps();
    int64_t q = 0;
    if (loops) {
        int64_t lines = pf < pf_end ? (pf_end - pf + 63) / 64 : 0;
        int64_t ahead = per_iter == 1 ? lines : lines / 2; /* (two lines a pair: an odd last one below) */
        if (ahead > pairs) ahead = pairs;
        if (per_iter == 1)
            for (; q < ahead; q++, pf += 64) {
                __builtin_prefetch(pf, 0, 2);
                PACKED_PAIR_BF16(q);
            }
        else
            for (; q < ahead; q++, pf += 128) {
                __builtin_prefetch(pf, 0, 2);
                __builtin_prefetch(pf + 64, 0, 2);
                PACKED_PAIR_BF16(q);
            }
        if (pf < pf_end && q < pairs) {
            __builtin_prefetch(pf, 0, 2);
            PACKED_PAIR_BF16(q);
            q++;
        }
        for (; q < pairs; q++) PACKED_PAIR_BF16(q);
    } else {
        for (; q < pairs; q++) {
            for (int64_t t = 0; t < per_iter && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
            PACKED_PAIR_BF16(q);
        }
    }
    store_tile_bf16(mr, acc, nb, bias, y, n, c);
}

typedef uint16_t packed_x; /* the tiles read x as it is, bf16 pairs for the pair instruction */
#elif defined(__AVX2__) && defined(__FMA__)
/* Without the pair instruction (AVX2 + FMA, e.g. a Zen 3 EPYC), the same layout and loop by fp32 FMAs: one 32-byte
 * load holds pair p of 8 rows, widened to the even inputs' weights by a shift and the odd ones' by a mask (bf16 is
 * fp32's high half), each against x's value broadcast from a copy of x widened once per call. A tile is 6 input rows
 * by one block: 12 sums, so 12 chains of fused multiply-adds cover the FMA latency (a 4-row tile's 8 just did, and
 * ran at 0.87-0.97x at 16 rows of a 150M Llama's products on a 2-core Zen 3 EPYC); each output's sum still runs over
 * k in order in fp32 (the even input first) and is rounded once. */
#define HAVE_PACKED_BF16 1
#define PACK_ROWS 6
#define PACK_BLOCKS 1
typedef float packed_x;

/* The odd inputs' weights: the high halves of a pair's 32-bit lanes. */
static const uint32_t odd_halves[8] __attribute__((aligned(32))) = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
                                                                    0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};

/* Six rows' input at byte offset OFF (0: the even input, 4: the odd one) broadcast into ymm13, times the weights in
 * ymm14 (outputs 0-7) and ymm15 (8-15), added into each row's two sums. */
#define SIX_ROWS_FMA(OFF)                                                                                              \
    "vbroadcastss " OFF "(%[x]), %%ymm13\n\t"                                                                        \
    "vfmadd231ps %%ymm14, %%ymm13, %[a00]\n\t"                                                                       \
    "vfmadd231ps %%ymm15, %%ymm13, %[a01]\n\t"                                                                       \
    "vbroadcastss " OFF "(%[x],%[s]), %%ymm13\n\t"                                                                   \
    "vfmadd231ps %%ymm14, %%ymm13, %[a10]\n\t"                                                                       \
    "vfmadd231ps %%ymm15, %%ymm13, %[a11]\n\t"                                                                       \
    "vbroadcastss " OFF "(%[x],%[s],2), %%ymm13\n\t"                                                                 \
    "vfmadd231ps %%ymm14, %%ymm13, %[a20]\n\t"                                                                       \
    "vfmadd231ps %%ymm15, %%ymm13, %[a21]\n\t"                                                                       \
    "vbroadcastss " OFF "(%[x3]), %%ymm13\n\t"                                                                       \
    "vfmadd231ps %%ymm14, %%ymm13, %[a30]\n\t"                                                                       \
    "vfmadd231ps %%ymm15, %%ymm13, %[a31]\n\t"                                                                       \
    "vbroadcastss " OFF "(%[x3],%[s]), %%ymm13\n\t"                                                                  \
    "vfmadd231ps %%ymm14, %%ymm13, %[a40]\n\t"                                                                       \
    "vfmadd231ps %%ymm15, %%ymm13, %[a41]\n\t"                                                                       \
    "vbroadcastss " OFF "(%[x3],%[s],2), %%ymm13\n\t"                                                                \
    "vfmadd231ps %%ymm14, %%ymm13, %[a50]\n\t"                                                                       \
    "vfmadd231ps %%ymm15, %%ymm13, %[a51]\n\t"

/* Pair q of a 6-row tile (inputs 2q, 2q + 1; x at input 2q, rows `row_bytes` apart): packed_tile_bf16's loop body
 * below, the same instructions in the same order, written out so that the 12 sums stay in registers. 12 sums, 2
 * weights and a broadcast leave one of the 16 registers; left to gcc, the loop kept the mask there and spilled a
 * sum, a store and a reload in its chain every pair (0.8x at 16 and 64 rows of a 150M Llama's products on a
 * 2-core Zen 3 EPYC), and which loops spilled moved with unrelated changes (a helper inlined, a parameter added).
 * No switch turns it off: a run-time one in the tile moved gcc's allocation back to the spill (0.998x). Each of
 * its rows is held bit for bit to that row alone, which the C loop's 1-row tile computes (the tests). */
static inline __attribute__((always_inline)) void packed_pair_six_rows(const uint16_t *w, const float *x,
                                                                       int64_t row_bytes, __m256 acc[PACK_ROWS][2]) {
    const float *x3 = (const float *)(const void *)((const char *)x + 3 * row_bytes);
    __asm__("vmovdqu (%[w]), %%ymm14\n\t"
            "vmovdqu 32(%[w]), %%ymm15\n\t"
            "vpslld $16, %%ymm14, %%ymm14\n\t"
            "vpslld $16, %%ymm15, %%ymm15\n\t"
            SIX_ROWS_FMA("0")
            "vmovdqu (%[w]), %%ymm14\n\t"
            "vmovdqu 32(%[w]), %%ymm15\n\t"
            "vpand %[high], %%ymm14, %%ymm14\n\t"
            "vpand %[high], %%ymm15, %%ymm15\n\t"
            SIX_ROWS_FMA("4")
            : [a00] "+x"(acc[0][0]), [a01] "+x"(acc[0][1]),
              [a10] "+x"(acc[1][0]), [a11] "+x"(acc[1][1]),
              [a20] "+x"(acc[2][0]), [a21] "+x"(acc[2][1]),
              [a30] "+x"(acc[3][0]), [a31] "+x"(acc[3][1]),
              [a40] "+x"(acc[4][0]), [a41] "+x"(acc[4][1]),
              [a50] "+x"(acc[5][0]), [a51] "+x"(acc[5][1])
            : [w] "r"(w), [x] "r"(x), [x3] "r"(x3), [s] "r"(row_bytes),
              [high] "m"(*(const __m256i *)(const void *)odd_halves)
            : "xmm13", "xmm14", "xmm15", "memory");
}
#undef SIX_ROWS_FMA

static inline __attribute__((always_inline)) void packed_tile_bf16(int mr, const uint16_t *pb, int64_t pairs,
                                                                   const float *x, int64_t k,
                                                                   const uint16_t *bias, uint16_t *y, int64_t n,
                                                                   int64_t c, int nb, const char *pf,
                                                                   const char *pf_end, int64_t per_iter, int loops) {
    (void)nb, (void)loops;
    __m256 acc[PACK_ROWS][2];
    for (int j = 0; j < mr; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t q = 0; q < pairs; q++) {
        for (int64_t t = 0; t < per_iter && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
        if (mr == 6) {
            packed_pair_six_rows(pb + q * 32, x + 2 * q, 4 * k, acc);
            continue;
        }
        const __m256i *w = (const __m256i *)(const void *)(pb + q * 32);
        /* the even inputs' weights against every row, then the odd ones' (loaded again: 12 sums, 2 weights, a
         * broadcast and the mask fill the 16 registers) */
        __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w), 16));
        __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w + 1), 16));
#pragma GCC unroll 6
        for (int j = 0; j < mr; j++) {
            __m256 x0 = _mm256_broadcast_ss(x + j * k + 2 * q);
            acc[j][0] = _mm256_fmadd_ps(w0, x0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(w1, x0, acc[j][1]);
        }
        w0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w), high));
        w1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w + 1), high));
#pragma GCC unroll 6
        for (int j = 0; j < mr; j++) {
            __m256 x1 = _mm256_broadcast_ss(x + j * k + 2 * q + 1);
            acc[j][0] = _mm256_fmadd_ps(w0, x1, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(w1, x1, acc[j][1]);
        }
    }
#pragma GCC unroll 6
    for (int j = 0; j < mr; j++) {
        store_sums_bf16(acc[j][0], bias, y + j * n, c, n);
        store_sums_bf16(acc[j][1], bias, y + j * n, c + 8, n);
    }
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
/* ---- codes in the channel form (pack_codes(channels=True)): AVX2's tiles, in AVX2 builds for bf16 and fp32 rows,
 * in AVX512-BF16 builds for fp32 rows (an fp32 model's products; their bf16 rows take codes in the pairs form) ---- */
#define HAVE_CHANNEL_CODES 1
#define CHANNEL_ROWS 6 /* input rows of a tile: 12 sums of 8 outputs */

/* Few rows of codes in the channel form (a mixed workload's last decode steps, one request or two) take several
 * blocks a tile (few_rows_blocks): a tile of one row by one block has two sums, each a chain of fused multiply-adds
 * waiting on the last (4 cycles on a Zen 3), and at one row q8 codes streamed at 14.0 GB/s where bf16 weights
 * stream at 19-22 from DRAM (a 2-core Zen 3 EPYC, 24 products of 6144 x 768 in turn). q8: four blocks at one row
 * (8 chains) 1.27-1.66x, two at two rows 1.32x; q4, whose weights are also scaled in the tile, two blocks at one row
 * 1.08-1.10x; q4 by group sums (Q4_SUMS_ROWS), widened in the tile as q8 is, four blocks at one row 1.05-1.2x
 * two. Slower where the sums and the blocks' scales outgrow the 16 registers: the scaled q4 at two rows (0.90x),
 * either at three (0.72-0.89x): a block a tile there. Each output is the same sums in the same order as in a tile of
 * one block (bit for bit). INFER_FEW_ROWS_BLOCKS=0: a block a tile (the check). */
#define FEW_ROWS_Q8_ONE 4      /* blocks a tile: q8 codes at one row, */
#define FEW_ROWS_Q8_TWO 2      /* q8 at two rows, */
#define FEW_ROWS_Q4_ONE 2      /* q4 at one row by the scaled form, */
#define FEW_ROWS_Q4_SUMS_ONE 4 /* q4 at one row by group sums */
#define FEW_ROWS_BLOCKS 4 /* (the most) */

/* A tile's 16 sums of each row x[0 .. mr-1] finished: the mins' term (each group's min times the row's group sum of
 * x, `xsums` [mr][groups], added in group order) where there are mins, then the bias, rounded into y's columns
 * c .. c + 15. */
static inline __attribute__((always_inline)) void finish_sums(int mr, __m256 sum[CHANNEL_ROWS][2], int64_t groups,
                                                                const float *mins, const float *xsums, sums_out o,
                                                                int64_t c) {
    if (mins)
        for (int64_t g = 0; g < groups; g++) {
            __m256 m0 = _mm256_loadu_ps(mins + 16 * g), m1 = _mm256_loadu_ps(mins + 16 * g + 8);
#pragma GCC unroll 6
            for (int j = 0; j < mr; j++) {
                __m256 xs = _mm256_broadcast_ss(xsums + j * groups + g);
                sum[j][0] = _mm256_add_ps(sum[j][0], _mm256_mul_ps(m0, xs));
                sum[j][1] = _mm256_add_ps(sum[j][1], _mm256_mul_ps(m1, xs));
            }
        }
#pragma GCC unroll 6
    for (int j = 0; j < mr; j++) {
        store_sums(sum[j][0], o, j, c);
        store_sums(sum[j][1], o, j, c + 8);
    }
}

/* The same tile on q8 codes in the channel form (infer_qgemm_packed's Q8C: pack_codes(channels=True)), the scales
 * after the sums: each block's codes input-major (input i's 16 codes side by side), each widened to fp32 in
 * registers, exact (a byte's sign extension and a conversion, two operations for 8 weights, as a bf16 weight's shift
 * or mask is one for 8 weights and its wider load), never rounded to bf16 as dequantizing into the pairs form rounds
 * every weight. Each group's fp32 sums over its inputs in order, times the group's scale, are added into the row's
 * totals in group order (the first group's product is the total), each product and add rounded once (no fused
 * multiply-add: the test's torch formula rounds the same), then the bias, rounded once to bf16. One group a row (int8
 * per output channel) keeps the totals in registers: scale * sum_i q_i x_i, the codes kernel's (infer_qgemv's) sum;
 * at 16 rows of a 150M Llama's products on a 2-core Zen 3 EPYC, 1.0-1.1x the bf16 packed product (0.9-1.0x at 64)
 * and 1.2-1.5x the dequantizing path. Grouped codes keep them on the stack, in L1: a group's end costs a few
 * operations a row against its 16 pairs of multiply-adds. q4 codes (`q4`: 8 bytes an input, both nibbles widened
 * from one zero extension) take the same tile up to Q4_SUMS_ROWS rows, their mins' term added by finish_sums;
 * past them scaled_tile below. */
static inline __attribute__((always_inline)) void channel_tile(int one_group, int q4, int mr, int bk, int nb,
                                                               const uint8_t *pb, int64_t pairs, const float *x,
                                                               int64_t k, int64_t group, const float *scales,
                                                               const float *mins, const float *xsums, sums_out o,
                                                               int64_t c, const char *pf, const char *pf_end,
                                                               int64_t per_iter) {
    /* bk blocks side by side (FEW_ROWS_BLOCKS), nb of them real: a spare one repeats the first, never stored */
    int64_t per_group = one_group ? pairs : group / 2, groups = pairs / per_group, block_bytes = (q4 ? 8 : 16) * k;
    __m256 tot[FEW_ROWS_BLOCKS * CHANNEL_ROWS][2];
    for (int64_t g = 0; g < groups; g++) {
        __m256 acc[FEW_ROWS_BLOCKS * CHANNEL_ROWS][2];
        for (int s = 0; s < bk * mr; s++) acc[s][0] = acc[s][1] = _mm256_setzero_ps();
        for (int64_t q = g * per_group; q < (g + 1) * per_group; q++) { /* inputs 2q and 2q + 1: 32 codes */
            for (int64_t t = 0; t < per_iter && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
            for (int e = 0; e < 2; e++)
#pragma GCC unroll 4
                for (int a = 0; a < bk; a++) {
                    __m256 w0, w1;
                    if (q4) { /* input 2q + e's 16 codes in 8 bytes: rows 0-7 low nibbles, 8-15 high */
                        const uint8_t *w = pb + (a < nb ? a : 0) * block_bytes + q * 16 + 8 * e;
                        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)w));
                        w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f)));
                        w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                    } else {
                        const int8_t *w = (const int8_t *)pb + (a < nb ? a : 0) * block_bytes + q * 32 + 16 * e;
                        w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
                        w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 8))));
                    }
                    /* (each row's x broadcast as its sums take it: 6 rows' broadcasts held across the blocks spilled
                     * the 6-row tile's sums, 0.5x) */
#pragma GCC unroll 6
                    for (int j = 0; j < mr; j++) {
                        __m256 xv = _mm256_broadcast_ss(x + j * k + 2 * q + e);
                        acc[a * mr + j][0] = _mm256_fmadd_ps(w0, xv, acc[a * mr + j][0]);
                        acc[a * mr + j][1] = _mm256_fmadd_ps(w1, xv, acc[a * mr + j][1]);
                    }
                }
        }
#pragma GCC unroll 4
        for (int a = 0; a < bk; a++) {
            const float *sa = scales + (a < nb ? a : 0) * groups * 16 + 16 * g;
            __m256 s0 = _mm256_loadu_ps(sa), s1 = _mm256_loadu_ps(sa + 8);
#pragma GCC unroll 6 /* (every loop over the sums unrolled: one left rolled keeps them in memory, 0.7x) */
            for (int j = 0; j < mr; j++) {
                __m256 a0 = _mm256_mul_ps(acc[a * mr + j][0], s0), a1 = _mm256_mul_ps(acc[a * mr + j][1], s1);
                tot[a * mr + j][0] = g ? _mm256_add_ps(tot[a * mr + j][0], a0) : a0;
                tot[a * mr + j][1] = g ? _mm256_add_ps(tot[a * mr + j][1], a1) : a1;
            }
        }
    }
#pragma GCC unroll 4
    for (int a = 0; a < nb; a++)
        finish_sums(mr, tot + a * mr, groups, mins ? mins + a * groups * 16 : NULL, xsums, o, c + 16 * a);
}

/* x's sums over each group of `group` inputs, in order in fp32, into this calling thread's buffer ([m][k / group]:
 * the mins' term of codes in the channel form); NULL without memory. */
static const float *group_sums(const float *x, int64_t m, int64_t k, int64_t group) {
    static _Thread_local float *sums = NULL;
    static _Thread_local int64_t sums_len = 0;
    int64_t groups = k / group;
    if (m * groups > sums_len) {
        float *grown = (float *)realloc(sums, (size_t)(m * groups) * sizeof(float));
        if (!grown) return NULL;
        sums = grown;
        sums_len = m * groups;
    }
    /* eight groups' chains side by side (each still summed in order): one chain at a time waits on each add */
    int64_t j = 0;
    for (; j + 8 <= m * groups; j += 8) {
        float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int64_t i = 0; i < group; i++)
            for (int t = 0; t < 8; t++) s[t] += x[(j + t) * group + i];
        for (int t = 0; t < 8; t++) sums[j + t] = s[t];
    }
    for (; j < m * groups; j++) {
        float s = 0.f;
        for (int64_t i = 0; i < group; i++) s += x[j * group + i];
        sums[j] = s;
    }
    return sums;
}
/* q4 codes in the channel form up to this many rows of x (three tiles) take channel_tile's group sums (each code
 * widened in the tile, each group's sums times its scale at the group's end, then the mins' term); past it the
 * scaled form below, whose buffer widens and scales a block's codes once for every tile. Alternating in one process
 * on a 2-core Zen 3 EPYC (2304 x 576 int4 in groups of 32, fp32 rows), the group sums' time against the scaled
 * form's: 0.85x at 1 row, 0.89x at 2, 0.91-0.98x at 4-12, 0.99x at 18; 1.03x at 24, 1.13x at 32, 1.14x at 64. */
#define Q4_SUMS_ROWS (3 * CHANNEL_ROWS)

/* q4 codes in the channel form (Q4C: input i's 16 codes in 8 bytes, rows 0-7 in the low nibbles, 8-15 in the high
 * ones), scaled before the sums: each weight's fp32 value scale * code (exact for scales from float16: a 4-bit code
 * times an 11-bit significand, or Q4_K's 17-bit factored ones), multiplied by x's inputs in order over the whole row
 * by fused multiply-adds (each step rounded once), then with mins each group's min times x's sum over the group
 * (`xsums`) added in group order, each product and add rounded once, then the bias, rounded once to bf16. No group
 * ends: a block's weights are scaled SCALED_INPUTS inputs at a time into a buffer in L1 (16 KiB; the 6 rows of x a
 * tile reads beside it) that every tile of rows then reads with two loads an input, so a tile's inner loop is the
 * bf16 tile's without its shift or mask, and the scaling (a zero extension, a mask or a shift, a conversion and a
 * multiply for 8 weights) runs once per block whatever the rows. The group sums' form (each group's sums times its
 * scale added into totals on the stack, the q8 tile's) ran 0.80-0.96x the bf16 packed product at 16 and 64 rows of
 * int4 in groups of 32 on a 2-core Zen 3 EPYC: the widening in every tile and the groups' ends. Since the q8 tile
 * kept its 12 sums in registers, that form wins up to three tiles (Q4_SUMS_ROWS): this one runs past them. */
#define SCALED_INPUTS 256

/* One input's 16 q4 codes (8 bytes: rows 0-7 in the low nibbles, 8-15 in the high ones) times their scales s0
 * (rows 0-7) and s1 (rows 8-15), in fp32: w[0] rows 0-7, w[1] rows 8-15. */
static inline __attribute__((always_inline)) void scale_input_q4c(const uint8_t *c, __m256 s0, __m256 s1,
                                                                  __m256 w[2]) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    w[0] = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f))));
    w[1] = _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
}

/* Inputs i0 .. i1 - 1 of a q4 block's codes times their groups' scales: out[16 (i - i0) + l] = scale[l] * q[l][i]. */
static void scale_codes_q4c(const uint8_t *codes, const float *scales, float *out, int64_t i0, int64_t i1,
                            int64_t group) {
    for (int64_t i = i0; i < i1;) {
        int64_t g = i / group, end = (g + 1) * group < i1 ? (g + 1) * group : i1;
        __m256 s0 = _mm256_loadu_ps(scales + 16 * g), s1 = _mm256_loadu_ps(scales + 16 * g + 8);
        for (; i < end; i++) {
            __m256 w[2];
            scale_input_q4c(codes + i * 8, s0, s1, w);
            _mm256_storeu_ps(out + 16 * (i - i0), w[0]);
            _mm256_storeu_ps(out + 16 * (i - i0) + 8, w[1]);
        }
    }
}

/* One tile alone (the call's rows fit one): the codes scaled in registers as it runs, the whole row at once (the
 * same weights and sums as the buffer's; a mask or shift, a conversion and a multiply for 8 weights in the tile).
 * bk blocks side by side (FEW_ROWS_BLOCKS; `codes`, `scales` and `mins` block b's, the rest following it), nb of them
 * real: a spare one repeats the first, never stored. */
static inline __attribute__((always_inline)) void scaled_tile_codes(int mr, int bk, int nb, const uint8_t *codes,
                                                                    const float *scales, int64_t group, const float *x,
                                                                    int64_t k, const float *mins, const float *xsums,
                                                                    sums_out o, int64_t c, const char *pf,
                                                                    const char *pf_end, int64_t per_iter) {
    int64_t groups = k / group;
    __m256 acc[FEW_ROWS_BLOCKS * CHANNEL_ROWS][2];
    for (int s = 0; s < bk * mr; s++) acc[s][0] = acc[s][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 s[FEW_ROWS_BLOCKS][2];
#pragma GCC unroll 4
        for (int a = 0; a < bk; a++) {
            const float *sa = scales + ((a < nb ? a : 0) * groups + g) * 16;
            s[a][0] = _mm256_loadu_ps(sa);
            s[a][1] = _mm256_loadu_ps(sa + 8);
        }
        for (int64_t i = g * group; i < (g + 1) * group; i += 2) { /* (a pair a prefetch, as the other tiles) */
            for (int64_t t = 0; t < per_iter && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
                for (int a = 0; a < bk; a++) {
                    __m256 w[2];
                    scale_input_q4c(codes + (a < nb ? a : 0) * 8 * k + (i + h) * 8, s[a][0], s[a][1], w);
#pragma GCC unroll 6 /* (each row's x broadcast as its sums take it, as channel_tile's) */
                    for (int j = 0; j < mr; j++) {
                        __m256 xv = _mm256_broadcast_ss(x + j * k + i + h);
                        acc[a * mr + j][0] = _mm256_fmadd_ps(w[0], xv, acc[a * mr + j][0]);
                        acc[a * mr + j][1] = _mm256_fmadd_ps(w[1], xv, acc[a * mr + j][1]);
                    }
                }
        }
    }
#pragma GCC unroll 4
    for (int a = 0; a < nb; a++)
        finish_sums(mr, acc + a * mr, groups, mins ? mins + a * groups * 16 : NULL, xsums, o, c + 16 * a);
}

/* `len` scaled inputs `w` (scale_codes_q4c's) against rows x[0 .. mr-1] (x at the first of them, rows k apart): the
 * 16 sums of each row start at zero (`first`) or from `sums` (16 a row), and go back there unless this is the
 * row's `last` stretch, which finishes them (finish_sums). */
static inline __attribute__((always_inline)) void scaled_tile(int mr, const float *w, int64_t len, const float *x,
                                                              int64_t k, float *sums, int first, int last,
                                                              int64_t groups, const float *mins, const float *xsums,
                                                              sums_out o, int64_t c, const char *pf,
                                                              const char *pf_end, int64_t per_iter) {
    __m256 acc[CHANNEL_ROWS][2];
    for (int j = 0; j < mr; j++) {
        acc[j][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + 16 * j);
        acc[j][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + 16 * j + 8);
    }
    for (int64_t i = 0; i < len; i += 2) {
        for (int64_t t = 0; t < per_iter && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
        for (int e = 0; e < 2; e++) {
            __m256 w0 = _mm256_loadu_ps(w + 16 * (i + e)), w1 = _mm256_loadu_ps(w + 16 * (i + e) + 8);
            __asm__("" : "+x"(w0), "+x"(w1)); /* held in registers: gcc folds them into each FMA as a load, 0.5x */
#pragma GCC unroll 6
            for (int j = 0; j < mr; j++) {
                __m256 xv = _mm256_broadcast_ss(x + j * k + i + e);
                acc[j][0] = _mm256_fmadd_ps(w0, xv, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(w1, xv, acc[j][1]);
            }
        }
    }
    if (last) {
        finish_sums(mr, acc, groups, mins, xsums, o, c);
        return;
    }
#pragma GCC unroll 6
    for (int j = 0; j < mr; j++) {
        _mm256_storeu_ps(sums + 16 * j, acc[j][0]);
        _mm256_storeu_ps(sums + 16 * j + 8, acc[j][1]);
    }
}

/* Block b's q4 codes (scales, mins: its [groups][16]) against rows x [m, k] (their group sums `xsums` [m][groups]
 * where there are mins), SCALED_INPUTS inputs at a time: scaled into `w`, then every tile of rows over them, each
 * tile's sums kept in `sums` (16 a row) between stretches; `pf` .. `pf_end` prefetched into L2 meanwhile. */
static void scaled_block(const uint8_t *codes, const float *scales, const float *mins, int64_t group,
                         const float *xsums, const float *x, int64_t m, int64_t k, sums_out o, int64_t b, float *w,
                         float *sums, const char *pf, const char *pf_end, int64_t per_iter) {
    int64_t groups = k / group, tiles = (m + CHANNEL_ROWS - 1) / CHANNEL_ROWS;
    if (tiles == 1) { /* no buffer to share, so none to fill (at 6 rows, filling it cost 0.85x) */
        switch (m) {
#define CODES_TILE(M)                                                                                          \
    case M:                                                                                                    \
        scaled_tile_codes(M, 1, 1, codes, scales, group, x, k, mins, xsums, o, 16 * b, pf, pf_end, per_iter); \
        break;
            CODES_TILE(1) CODES_TILE(2) CODES_TILE(3) CODES_TILE(4) CODES_TILE(5) CODES_TILE(6)
#undef CODES_TILE
        }
        return;
    }
    int64_t stretches = (k + SCALED_INPUTS - 1) / SCALED_INPUTS;
    int64_t chunk = ((pf_end - pf + tiles * stretches - 1) / (tiles * stretches) + 63) / 64 * 64;
    for (int64_t i0 = 0; i0 < k; i0 += SCALED_INPUTS) {
        int64_t i1 = i0 + SCALED_INPUTS < k ? i0 + SCALED_INPUTS : k;
        int first = i0 == 0, last = i1 == k;
        scale_codes_q4c(codes, scales, w, i0, i1, group);
        for (int64_t t = 0, j = 0; t < tiles; t++) { /* the rows shared evenly over the tiles, as packed_pass */
            int mr = (int)(m / tiles + (t < m % tiles));
            const char *end = pf + chunk < pf_end ? pf + chunk : pf_end;
            const float *xs = xsums ? xsums + j * groups : NULL;
            switch (mr) {
#define SCALED_TILE(M)                                                                                             \
    case M:                                                                                                        \
        scaled_tile(M, w, i1 - i0, x + j * k + i0, k, sums + 16 * j, first, last, groups, mins, xs, rows_from(o, j), \
                    16 * b, pf, end, per_iter);                                                                    \
        break;
                SCALED_TILE(1) SCALED_TILE(2) SCALED_TILE(3) SCALED_TILE(4) SCALED_TILE(5) SCALED_TILE(6)
#undef SCALED_TILE
            }
            pf = end;
            j += mr;
        }
    }
}
#endif

#if defined(HAVE_CHANNEL_CODES)
/* Blocks a tile for m rows of codes in the channel form (q4: `q4`, by the scaled form: `scaled`): FEW_ROWS_BLOCKS
 * above; 1 where none is taken (few_rows_pass runs the rest). */
static int few_rows_blocks(int q4, int scaled, int64_t m) {
    if (m > 2 || (q4 && m == 2) || !switched_on("INFER_FEW_ROWS_BLOCKS")) return 1;
    return scaled ? FEW_ROWS_Q4_ONE : q4 ? FEW_ROWS_Q4_SUMS_ONE : m == 1 ? FEW_ROWS_Q8_ONE : FEW_ROWS_Q8_TWO;
}

/* Blocks b .. b + nb - 1 of codes in the channel form (q8, or q4: `q4`, by the scaled form: `scaled`) against m rows
 * of x, as many blocks a tile as few_rows_blocks takes for them. */
static void few_rows_pass(int q4, int scaled, int nb, const uint8_t *codes, const float *scales, const float *mins,
                          int64_t group, const float *xsums, const float *x, int64_t m, int64_t k, sums_out o,
                          int64_t b, const char *pf, const char *pf_end, int64_t per_iter) {
    int64_t c = 16 * b;
    int one = group == k; /* (int8 per channel: one group a row) */
    if (q4 && !scaled)
        channel_tile(0, 1, 1, FEW_ROWS_Q4_SUMS_ONE, nb, codes, k / 2, x, k, group, scales, mins, xsums, o, c, pf, pf_end,
                     per_iter);
    else if (scaled)
        scaled_tile_codes(1, FEW_ROWS_Q4_ONE, nb, codes, scales, group, x, k, mins, xsums, o, c, pf, pf_end, per_iter);
    else if (m == 1 && one)
        channel_tile(1, 0, 1, FEW_ROWS_Q8_ONE, nb, codes, k / 2, x, k, k, scales, NULL, NULL, o, c, pf, pf_end,
                     per_iter);
    else if (m == 1)
        channel_tile(0, 0, 1, FEW_ROWS_Q8_ONE, nb, codes, k / 2, x, k, group, scales, NULL, NULL, o, c, pf, pf_end,
                     per_iter);
    else if (one)
        channel_tile(1, 0, 2, FEW_ROWS_Q8_TWO, nb, codes, k / 2, x, k, k, scales, NULL, NULL, o, c, pf, pf_end,
                     per_iter);
    else
        channel_tile(0, 0, 2, FEW_ROWS_Q8_TWO, nb, codes, k / 2, x, k, group, scales, NULL, NULL, o, c, pf, pf_end,
                     per_iter);
}
#endif

#if defined(HAVE_CHANNEL_CODES)
/* A block of codes in the channel form: their group and the block's scales [groups][16] (q4: also mins). */
typedef struct {
    int64_t group;
    const float *scales;
    int q4;                     /* q4 codes (8 bytes an input) */
    const float *mins, *xsums; /* q4's mins [groups][16] and the rows' group sums [m][groups], or NULL */
} channel_block;

/* A tile of mr rows of x (from row `row` of the call's, for q4's group sums) on one block of codes in the channel
 * form: the tile for its form, inlined. */
static inline __attribute__((always_inline)) void channel_pass_tile(int mr, const uint8_t *codes,
                                                                    const channel_block *cb, int64_t row,
                                                                    int64_t pairs, const float *x, int64_t k,
                                                                    sums_out o, int64_t c, const char *pf,
                                                                    const char *pf_end, int64_t per_iter) {
    const float *xs = cb->xsums ? cb->xsums + row * (k / cb->group) : NULL;
    if (cb->q4)
        channel_tile(0, 1, mr, 1, 1, codes, pairs, x, k, cb->group, cb->scales, cb->mins, xs, o, c, pf, pf_end,
                     per_iter);
    else if (cb->group == k)
        channel_tile(1, 0, mr, 1, 1, codes, pairs, x, k, k, cb->scales, NULL, NULL, o, c, pf, pf_end, per_iter);
    else
        channel_tile(0, 0, mr, 1, 1, codes, pairs, x, k, cb->group, cb->scales, NULL, NULL, o, c, pf, pf_end,
                     per_iter);
}

/* Block b of codes in the channel form (`codes`, `cb` its scales) against every tile of x [m, k], the bytes `pf` ..
 * `pf_end` prefetched into L2 meanwhile, each tile its share; the rows shared evenly over the tiles (16 rows: 6, 5,
 * 5, not 6, 6, 4): no tile short of FMA chains. */
static void channel_pass(const uint8_t *codes, const channel_block *cb, int64_t pairs, const float *x, int64_t m,
                         int64_t k, sums_out o, int64_t b, const char *pf, const char *pf_end, int64_t per_iter) {
    int64_t tiles = (m + CHANNEL_ROWS - 1) / CHANNEL_ROWS;
    int64_t chunk = ((pf_end - pf + tiles - 1) / tiles + 63) / 64 * 64;
    for (int64_t t = 0, j = 0; t < tiles; t++) {
        int mr = (int)(m / tiles + (t < m % tiles));
        const char *end = pf + chunk < pf_end ? pf + chunk : pf_end;
        switch (mr) { /* each row count its own unrolled tile */
#define CHANNEL_TILE(M)                                                                                         \
    case M:                                                                                                     \
        channel_pass_tile(M, codes, cb, j, pairs, x + j * k, k, rows_from(o, j), 16 * b, pf, end, per_iter); \
        break;
            CHANNEL_TILE(1) CHANNEL_TILE(2) CHANNEL_TILE(3) CHANNEL_TILE(4) CHANNEL_TILE(5) CHANNEL_TILE(6)
#undef CHANNEL_TILE
        }
        pf = end;
        j += mr;
    }
}

/* x [m, k] bf16 widened to fp32 once per call, into this calling thread's buffer (kept: the steps call the products
 * thousands of times, and a fresh allocation of a 512-row x would map and fault its pages every time); NULL without
 * memory. The OpenMP threads each have their own buffer: they are handed the caller's. */
static const float *widened_rows(const uint16_t *x, int64_t m, int64_t k, int threads) {
    static _Thread_local float *wide = NULL;
    static _Thread_local int64_t wide_len = 0;
    if (m * k > wide_len) {
        float *grown = (float *)realloc(wide, (size_t)(m * k) * sizeof(float));
        if (!grown) return NULL;
        wide = grown;
        wide_len = m * k;
    }
    float *buf = wide;
#pragma omp parallel for num_threads(threads) if (threads > 1 && m * k >= 65536) schedule(static)
    for (int64_t i = 0; i < m * k; i++) buf[i] = bf16_to_f32(x[i]);
    return buf;
}

/* Many rows (a prefill chunk) pass the weights in groups whose widened rows stay in L2 (192 KiB), not all at once:
 * 512 rows of k = 768 (1.5 MiB) streamed from L3 once per block ran at 0.7x oneDNN on a Zen 3 EPYC. */
static int64_t rows_in_l2(int64_t k) {
    int64_t rows = (192 * 1024 / (4 * k)) / CHANNEL_ROWS * CHANNEL_ROWS;
    return rows < CHANNEL_ROWS ? CHANNEL_ROWS : rows;
}
#endif

#if defined(HAVE_PACKED_BF16)
/* Blocks b, b + 1 (nb of them) of bf16 weights packed at `pb` against every tile of x, the bytes `pf` .. `pf_end`
 * prefetched into L2 meanwhile, each tile its share (the rows shared evenly, as channel_pass shares them).
 * `loops`: prefetch_loops(). */
static void packed_pass(const uint16_t *pb, int64_t pairs, const packed_x *x, int64_t m, int64_t k, sums_out o,
                        int64_t b, int nb, const char *pf, const char *pf_end, int64_t per_iter, int loops) {
    int64_t tiles = (m + PACK_ROWS - 1) / PACK_ROWS;
    int64_t chunk = ((pf_end - pf + tiles - 1) / tiles + 63) / 64 * 64;
    for (int64_t t = 0, j = 0; t < tiles; t++) {
        int mr = (int)(m / tiles + (t < m % tiles));
        const char *end = pf + chunk < pf_end ? pf + chunk : pf_end;
        switch (mr) { /* each row count its own unrolled tile */
#define PACKED_TILE(M)                                                                                            \
    case M:                                                                                                       \
        packed_tile_bf16(M, pb, pairs, x + j * k, k, (const uint16_t *)o.bias, (uint16_t *)o.y + j * o.n, o.n,  \
                         16 * b, nb, pf, end, per_iter, loops);                                                   \
        break;
            PACKED_TILE(1) PACKED_TILE(2) PACKED_TILE(3) PACKED_TILE(4)
#if PACK_ROWS > 4
            PACKED_TILE(5) PACKED_TILE(6)
#endif
#if PACK_ROWS > 6
            PACKED_TILE(7) PACKED_TILE(8)
#endif
#undef PACKED_TILE
        }
        pf = end;
        j += mr;
    }
}
#endif

#if defined(HAVE_AMX)
/* ---- the packed product on AMX tiles (Intel Xeons with AMX-BF16) ----
 * The packed layout is AMX's own B operand: pair p of a block's 16 rows is one 64-byte row of a tile, so 16 pairs
 * (32 inputs) of a block are one 1 KiB tile of weights, loaded as they lie. x is laid out once per call as tiles of
 * 16 rows by 32 inputs (amx_rows_as_tiles). A pass is 32 input rows by 2 blocks: four 16 x 16 tiles of fp32 sums
 * (tmm0-3), two of x (tmm4-5), two of weights (tmm6-7), and each pair instruction multiplies 16 rows by 16 outputs
 * by 32 inputs (vdpbf16ps: 16 outputs by 2 inputs of one row). Every output is still its own row's fp32 sum over k
 * in order (the tile instruction's rounding and order, not vdpbf16ps's: within the same rounding of the formula),
 * rounded once with the bias as the pair instruction's tile does, and never depends on the other rows of the call:
 * a last tile of fewer than 16 rows is zero-padded, so every row takes the same instructions.
 * k a multiple of 32 (whole tiles of inputs; every real model's): other k keep the pair instruction's tiles.
 * INFER_AMX=0 turns it off (the check). */
/* x [m, k] laid out as the tiles read it: tile (g, s), rows 16g .. 16g + 15 by inputs 32s .. 32s + 31, 1 KiB at
 * (g * k / 32 + s) * 512, rows past m zero (so a last tile of fewer rows takes the same instructions). A tile's rows
 * as x holds them lie 2k bytes apart (k = 3072: 6 KiB, two L1 sets for all 16 lines); as tiles, in one 1 KiB run.
 * This calling thread's buffer, kept as widened_rows keeps its own; NULL without memory. */
static const uint16_t *amx_rows_as_tiles(const uint16_t *x, int64_t m, int64_t k, int threads) {
    static _Thread_local uint16_t *tiles = NULL;
    static _Thread_local int64_t tiles_len = 0;
    int64_t groups = (m + 15) / 16, steps = k / 32, len = groups * 16 * k;
    if (len > tiles_len) {
        uint16_t *grown = (uint16_t *)realloc(tiles, (size_t)len * sizeof(uint16_t));
        if (!grown) return NULL;
        tiles = grown;
        tiles_len = len;
    }
    uint16_t *out = tiles;
#pragma omp parallel for num_threads(threads) if (threads > 1 && m * k >= 65536) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < 16; r++)
            for (int64_t st = 0; st < steps; st++) {
                uint16_t *dst = out + ((g * steps + st) * 16 + r) * 32;
                if (16 * g + r < m) memcpy(dst, x + (16 * g + r) * k + 32 * st, 64);
                else memset(dst, 0, 64);
            }
    return out;
}

/* One 16 x 16 tile of sums (this row tile's `rows`, this block's columns c ..) with the bias, rounded into y. */
static inline void amx_store(const float *sums, int rows, const uint16_t *bias, uint16_t *y, int64_t n, int64_t c) {
    int64_t left = n - c;
    __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    __m512 bv = bias ? bf16x16_widen(_mm256_maskz_loadu_epi16(mask, bias + c)) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + 16 * r), bv);
        /* (the conversion instruction where no lane is subnormal: the formula's rounding was up to 25% of a pass
         * at k = 768) */
        _mm256_mask_storeu_epi16(y + r * n + c, mask, bf16x16_round(v));
    }
}

/* Block b packed at `pb` against 17-48 rows of x laid out as tiles (`xt`): each weight tile loaded once and multiplied
 * by every row tile (tmm0-2 the sums, tmm4 the weights, tmm5-7 the rows), the bytes `pf` .. `pf_end` prefetched into
 * L2 meanwhile. At 17-48 rows it streamed 1.06-1.22x faster than two blocks by two row tiles (amx_pass: two weight
 * tiles a step and the rows' tiles each read once) on a 2-core Emerald Rapids Xeon, and at 49-64 rows, as two passes
 * (32 rows, then the rest), 1.1-1.25x; at 16 rows and fewer no faster, and past 64 rows 0.95-1.1x. The same tile
 * instructions on each row tile in the same order of k, so the same sums bit for bit. */
static void amx_pass_tall(const uint16_t *pb, int64_t pairs, const uint16_t *xt, int64_t m, const uint16_t *bias,
                          uint16_t *y, int64_t n, int64_t b, const char *pf, const char *pf_end) {
    int64_t steps = pairs / 16, tiles = (m + 15) / 16;
    int64_t per_step = ((pf_end - pf) / 64 + steps - 1) / steps;
    float sums[3][256];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t s = 0; s < steps; s++) {
        for (int64_t t = 0; t < per_step && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
        if (s + 1 < steps)
            for (int l = 0; l < 1024; l += 64) __builtin_prefetch((const char *)(pb + (s + 1) * 512) + l, 0, 3);
        _tile_loadd(4, pb + s * 512, 64);
        _tile_loadd(5, xt + s * 512, 64);
        _tile_dpbf16ps(0, 5, 4);
        _tile_loadd(6, xt + (steps + s) * 512, 64);
        _tile_dpbf16ps(1, 6, 4);
        if (tiles > 2) {
            _tile_loadd(7, xt + (2 * steps + s) * 512, 64);
            _tile_dpbf16ps(2, 7, 4);
        }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (tiles > 2) _tile_stored(2, sums[2], 64);
    for (int64_t t = 0; t < tiles; t++)
        amx_store(sums[t], m - 16 * t < 16 ? (int)(m - 16 * t) : 16, bias, y + 16 * t * n, n, 16 * b);
}

/* Blocks b, b + 1 (nb of them) packed at `pb` against every row of x laid out as tiles (`xt`, amx_rows_as_tiles),
 * the bytes `pf` .. `pf_end` prefetched into L2 meanwhile, spread over the pass's steps. The tiles configured.
 * 17-64 rows: a block at a time (amx_pass_tall), unless INFER_AMX_TALL=0. */
static void amx_pass(const uint16_t *pb, int64_t pairs, const uint16_t *xt, int64_t m, int64_t k,
                     const uint16_t *bias, uint16_t *y, int64_t n, int64_t b, int nb, const char *pf,
                     const char *pf_end, int tall) {
    if (m > 16 && m <= 64 && tall) {
        /* (49-64 rows: 32 rows, then the rest over the block's weights again, from cache) */
        const char *mid = pf + (pf_end - pf) / 2;
        int64_t steps = pairs / 16, rows = m <= 48 ? m : 32;
        for (int a = 0; a < nb; a++) {
            /* each block prefetches its half of the range ahead, in its first pass */
            const char *from = a ? mid : pf, *to = a || nb == 1 ? pf_end : mid;
            for (int64_t j = 0; j < m; j += rows)
                amx_pass_tall(pb + a * pairs * 32, pairs, xt + (j / 16) * steps * 512, m - j < rows ? m - j : rows,
                              bias, y + j * n, n, b + a, j ? to : from, to);
        }
        return;
    }
    const uint16_t *w0 = pb, *w1 = pb + (nb > 1 ? pairs * 32 : 0); /* (a lone block twice, the spare never stored) */
    int64_t steps = pairs / 16, groups = (m + 31) / 32;
    int64_t per_step = ((pf_end - pf) / 64 + groups * steps - 1) / (groups * steps);
    float sums[4][256];
    for (int64_t j = 0; j < m; j += 32) {
        int two = j + 16 < m; /* a second row tile */
        const uint16_t *a0 = xt + (j / 16) * steps * 512, *a1 = a0 + steps * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++) {
            for (int64_t t = 0; t < per_step && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
            /* the next step's four tiles into L1: a tile load waits on its lines, and the tiles are too few to
             * load one step while the last multiplies (1.1-1.4x at 16 rows of a 150M Llama's products) */
            if (s + 1 < steps)
                for (int l = 0; l < 1024; l += 64) {
                    __builtin_prefetch((const char *)(w0 + (s + 1) * 512) + l, 0, 3);
                    __builtin_prefetch((const char *)(w1 + (s + 1) * 512) + l, 0, 3);
                    __builtin_prefetch((const char *)(a0 + (s + 1) * 512) + l, 0, 3);
                    if (two) __builtin_prefetch((const char *)(a1 + (s + 1) * 512) + l, 0, 3);
                }
            _tile_loadd(6, w0 + s * 512, 64);
            _tile_loadd(7, w1 + s * 512, 64);
            _tile_loadd(4, a0 + s * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, a1 + s * 512, 64);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        int rows0 = m - j < 16 ? (int)(m - j) : 16, rows1 = two ? (m - j - 16 < 16 ? (int)(m - j - 16) : 16) : 0;
        for (int a = 0; a < nb; a++) {
            amx_store(sums[a], rows0, bias, y + j * n, n, 16 * (b + a));
            if (two) amx_store(sums[2 + a], rows1, bias, y + (j + 16) * n, n, 16 * (b + a));
        }
    }
}

#endif

/* How many rows of prompt chunks the paged attention has taken on AMX tiles in this process (amx_chunk_attention;
 * 0 where the build has none): the tests' witness that a chunk took them. */
int64_t infer_amx_attention_rows(void) {
#if defined(HAVE_AMX)
    return __atomic_load_n(&amx_attention_rows, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

/* Whether the packed products of inner size k run on AMX tiles here (built for them, the process granted them,
 * INFER_AMX not 0, k a multiple of 32). */
int infer_amx_takes(int64_t k) {
#if defined(HAVE_AMX)
    return amx_takes(k);
#else
    (void)k;
    return 0;
#endif
}

/* How far ahead of its pass infer_gemm_bf16_packed prefetches: the next pair of blocks (1) or the pair after next
 * (2). A process-wide setting, as prefetch_level; the same results either way. At 16 rows of a 150M Llama's decode
 * steps the pair after next ran 1.4x faster than no prefetch on a 2-core Zen 4 EPYC, the next pair 1.07x faster
 * than the pair after next on a 2-core Zen 5 one: infer.tuning.choose_packed_ahead times them on the machine. */
static int packed_ahead = 2;

void infer_set_packed_ahead(int pairs) { packed_ahead = pairs == 1 ? 1 : 2; }

int infer_packed_ahead(void) { return packed_ahead; }

/* y [m, n] = x [m, k] W^T (+ bias) for W packed by infer_pack_bf16; every thread a contiguous range of blocks,
 * streamed once: each pair of blocks runs over every tile of x while a pair ahead (packed_ahead) is prefetched into
 * L2. Returns -2 without the pair instruction, -3 for odd k. */
int infer_gemm_bf16_packed(const uint16_t *p, const uint16_t *x_in, const uint16_t *bias, uint16_t *y, int64_t m,
                           int64_t n, int64_t k, int threads) {
#if defined(HAVE_PACKED_BF16)
    if (k % 2) return -3;
    if (m <= 0 || n <= 0 || k <= 0) return 0;
    int64_t pairs = k / 2;
#if defined(HAVE_DOT_BF16)
    const packed_x *x = x_in;
    int64_t rows_at_once = m;
#if defined(HAVE_AMX)
    int amx = amx_takes(k), tall = amx && switched_on("INFER_AMX_TALL");
    const uint16_t *xt = amx ? amx_rows_as_tiles(x_in, m, k, threads) : NULL;
    if (amx && !xt) return -4;
    /* (AMX: the rows in groups of 512 KiB, which stay in L2 while the weights pass) */
    if (amx) rows_at_once = (512 * 1024 / (2 * k)) / 32 * 32 > 32 ? (512 * 1024 / (2 * k)) / 32 * 32 : 32;
#endif
#else
    const packed_x *x = widened_rows(x_in, m, k, threads);
    if (!x) return -4;
    int64_t rows_at_once = rows_in_l2(k);
#endif
    /* pairs of blocks shared by the threads (work_range), a set of ranges for each group of rows */
    int64_t blocks = (n + 15) / 16, items = (blocks + PACK_BLOCKS - 1) / PACK_BLOCKS;
    int nr = threads > 1 ? threads : 1, balance = work_balance(), loops = prefetch_loops();
    work_range *ranges = work_ranges((m + rows_at_once - 1) / rows_at_once, nr, items);
    if (!ranges) return -4;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#if defined(HAVE_AMX)
        if (amx) amx_configure();
#endif
        for (int64_t j0 = 0; j0 < m; j0 += rows_at_once) {
            int64_t mc = m - j0 < rows_at_once ? m - j0 : rows_at_once, tiles = (mc + PACK_ROWS - 1) / PACK_ROWS;
            int64_t per_iter = (PACK_BLOCKS + tiles - 1) / tiles, ahead = packed_ahead; /* a block: a line a pair */
            work_walk walk = work_start(ranges + j0 / rows_at_once * nr, nr, items, balance);
            for (int64_t item; (item = work_next(&walk)) >= 0;) {
                int64_t b = item * PACK_BLOCKS;
                int nb = blocks - b < PACK_BLOCKS ? (int)(blocks - b) : PACK_BLOCKS;
                int64_t from, to; /* the pair `ahead` further along the walk, prefetched into L2 */
                work_ahead(&walk, item, ahead, PACK_BLOCKS, blocks, &from, &to);
                const char *pf = (const char *)(p + from * pairs * 32), *pf_end = (const char *)(p + to * pairs * 32);
#if defined(HAVE_AMX)
                if (amx) {
                    amx_pass(p + b * pairs * 32, pairs, xt + j0 * k, mc, k, bias, y + j0 * n, n, b, nb, pf,
                             pf_end, tall);
                    continue;
                }
#endif
                sums_out o = {y + j0 * n, bias, n, 0};
                packed_pass(p + b * pairs * 32, pairs, x + j0 * k, mc, k, o, b, nb, pf, pf_end, per_iter, loops);
            }
        }
#if defined(HAVE_AMX)
        if (amx) _tile_release();
#endif
    }
    free(ranges);
    return 0;
#else
    (void)p, (void)x_in, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)threads;
    return -2;
#endif
}

/* ---- the fp32 packed product (an fp32 model's batched products) ----
 * F.linear on fp32 weights at the engine's 16-64 rows ran at 40-70 GFLOP/s on a 2-core Zen 3 EPYC (oneDNN's GEMM
 * packs the weight on every call), where the FMA units give ~150. The weight is packed once in blocks of 16 rows,
 * input-major, P[b][i][l] = W[16b + l][i] (zero past n): input i's 16 weights of a block are one 64-byte line, and a
 * tile of up to 6 input rows keeps each row's 16 sums in two registers, adding w * x[j][i] by fused multiply-adds
 * (12 chains, as the bf16 tile's AVX2 form; the weights need no widening here). Every output is its own row's fp32
 * sum over k in order, then the bias added (one rounding): it never depends on the other rows of the call. */
/* W [n, k] into `p`: 16 * ceil(n / 16) * k values. */
void infer_pack_f32(const float *w, float *p, int64_t n, int64_t k, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < (n + 15) / 16; b++)
        for (int l = 0; l < 16; l++) {
            int64_t r = 16 * b + l;
            float *dst = p + b * 16 * k + l;
            for (int64_t i = 0; i < k; i++) dst[16 * i] = r < n ? w[r * k + i] : 0.f;
        }
}

#if defined(__AVX2__) && defined(__FMA__)
#define F32_TILE_ROWS 6

/* Rows x[0 .. mr-1] (k apart) against block `pb`, into y's columns c .. c + 15 (+ bias), masked past n. `pf`: the
 * next block, one line of it prefetched into L2 an input (NULL: none). */
static inline __attribute__((always_inline)) void f32_tile(int mr, const float *pb, const float *x, int64_t k,
                                                           const float *bias, float *y, int64_t n, int64_t c,
                                                           const char *pf) {
    __m256 acc[F32_TILE_ROWS][2];
    for (int j = 0; j < mr; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        if (pf) __builtin_prefetch(pf + 64 * i, 0, 2);
        __m256 lo = _mm256_loadu_ps(pb + 16 * i), hi = _mm256_loadu_ps(pb + 16 * i + 8); /* outputs 0-7, 8-15 */
#pragma GCC unroll 6
        for (int j = 0; j < mr; j++) {
            __m256 xj = _mm256_broadcast_ss(x + j * k + i);
            acc[j][0] = _mm256_fmadd_ps(lo, xj, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(hi, xj, acc[j][1]);
        }
    }
#pragma GCC unroll 6
    for (int j = 0; j < mr; j++) { /* (each half by value: an indexed acc[j][h] kept every sum on the stack, 0.4x) */
        store_sums_f32(acc[j][0], bias, y + j * n, c, n);
        store_sums_f32(acc[j][1], bias, y + j * n, c + 8, n);
    }
}

/* Block b against rows x[0 .. m-1], the rows shared evenly over tiles of up to 6 (as packed_pass shares them); the
 * first tile prefetches the next block (`pf`, NULL past the last). */
static void f32_pass(const float *pb, const float *x, int64_t m, int64_t k, const float *bias, float *y, int64_t n,
                     int64_t b, const char *pf) {
    int64_t tiles = (m + F32_TILE_ROWS - 1) / F32_TILE_ROWS;
    for (int64_t t = 0, j = 0; t < tiles; t++) {
        int mr = (int)(m / tiles + (t < m % tiles));
        const char *ahead = t == 0 ? pf : NULL;
        switch (mr) {
#define F32_TILE(M)                                                                    \
    case M:                                                                            \
        if (ahead) f32_tile(M, pb, x + j * k, k, bias, y + j * n, n, 16 * b, ahead);   \
        else f32_tile(M, pb, x + j * k, k, bias, y + j * n, n, 16 * b, NULL);          \
        break;
            F32_TILE(1) F32_TILE(2) F32_TILE(3) F32_TILE(4) F32_TILE(5) F32_TILE(6)
#undef F32_TILE
        }
        j += mr;
    }
}
#endif

/* y [m, n] = x [m, k] W^T (+ bias), all fp32, for W packed by infer_pack_f32: every thread a contiguous range of
 * blocks, each block over every tile of a group of rows that stays in L2 (192 KiB: 64 rows at k = 768). Returns -2
 * without AVX2 and FMA. */
int infer_gemm_f32_packed(const float *p, const float *x, const float *bias, float *y, int64_t m, int64_t n,
                          int64_t k, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (m <= 0 || n <= 0 || k <= 0) return 0;
    int64_t blocks = (n + 15) / 16, rows_at_once = (192 * 1024 / (4 * k)) / F32_TILE_ROWS * F32_TILE_ROWS;
    if (rows_at_once < F32_TILE_ROWS) rows_at_once = F32_TILE_ROWS;
    for (int64_t j0 = 0; j0 < m; j0 += rows_at_once) {
        int64_t mc = m - j0 < rows_at_once ? m - j0 : rows_at_once;
        const float *xg = x + j0 * k; /* this group's rows, and their outputs */
        float *yg = y + j0 * n;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            f32_pass(p + b * 16 * k, xg, mc, k, bias, yg, n, b,
                     b + 1 < blocks ? (const char *)(p + (b + 1) * 16 * k) : NULL);
    }
    return 0;
#else
    (void)p, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)threads;
    return -2;
#endif
}

/* ---- quantized weights (infer/quant_weights.py): y = W x with W stored as codes ----
 * q8: int8 codes, w = scale * q; q4: 4-bit codes, two a byte (per run of 32: byte j's low nibble is element j,
 * its high nibble element j + 16), w = scale * q + min. One scale (and min) per group of `group` inputs, float16
 * or float32. A row's sum is sum_g scale_g * (sum_{i in g} q_i x_i) + sum_g min_g * (sum_{i in g} x_i): the codes
 * are read once, widened to fp32 in registers and multiplied by x in fp32; the mins' part uses the group sums
 * of x, formed once per call. Rows of x are taken four at a time, so a batch of rows (the engine's decode
 * steps, short prefill chunks) reads each weight row once per four. The codes stream like infer_gemv's
 * weights: one contiguous range of rows per thread, prefetched ahead. */

/* Q6: q8 codes known to lie in -32..31 (Q6_K's), groups of 16; Q8C / Q4C: q8 / q4 codes in the packed product's
 * channel form */
enum { Q8 = 0, Q4 = 1, Q6 = 2, Q8C = 3, Q4C = 4 };
/* Set in the format of codes in the channel form whose scales and mins are float16 (pack_codes keeps them so where
 * each is a float16 exactly: Q4_0's, Q4_1's, Q8_0's, int4's): widened to float32 a block at a time as a thread takes
 * it, the same values; a Q4_0 block of 16 rows then streams 20 bytes a run of 32 inputs where float32 took 24. */
#define HALF_SCALES 8
/* Set in infer_qgemv's format for q4 codes whose every min is -8 x its group's scale (GGUF's Q4_0, `d (q - 8)`):
 * the kernel forms the mins' share from the scales instead of reading the mins (INFER_QGEMV_FORMED_MINS not 0). */
#define MINS_EIGHT_SCALES 16
#define QCHUNK 32

/* A scale or min (float16 or float32): by the F16C instruction where the CPU has it (once per 32 weights, the
 * software conversion's branches cost as much as the run's arithmetic). */
static inline float load_scale(int sdtype, const void *p, int64_t i) {
#if defined(__F16C__)
    if (sdtype == F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
#endif
    return load_scalar(sdtype, p, i);
}

/* The 32 weights' codes of one run as floats (generic path, and the dequantizer). */
static inline void codes_chunk(int fmt, const uint8_t *c, float out[QCHUNK]) {
    if (fmt == Q8) {
        for (int i = 0; i < QCHUNK; i++) out[i] = (float)(int8_t)c[i];
    } else {
        for (int i = 0; i < QCHUNK / 2; i++) {
            out[i] = (float)(c[i] & 0x0f);
            out[i + QCHUNK / 2] = (float)(c[i] >> 4);
        }
    }
}

#if defined(HAVE_AVX512)
#define QLANES 16
typedef __m512 qvec;
static inline qvec qzero(void) { return _mm512_setzero_ps(); }
static inline qvec qset1(float v) { return _mm512_set1_ps(v); }
static inline qvec qload(const float *p) { return _mm512_loadu_ps(p); }
static inline qvec qfma(qvec a, qvec b, qvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float qsum(qvec v) { return _mm512_reduce_add_ps(v); }
/* w[0..1]: the run's 32 codes as floats, 16 a vector. */
static inline void qcodes(int fmt, const uint8_t *c, qvec w[2]) {
    __m128i a = _mm_loadu_si128((const __m128i *)c);
    if (fmt == Q8) {
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
    } else {
        __m128i low = _mm_set1_epi8(0x0f);
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(a, low)));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(a, 4), low)));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define QLANES 8
/* INFER_Q4_WIDEN_BYTES=0: q4 codes split into nibbles in bytes before widening (qcodes' check) */
static int q4_widen_bytes = 1;
__attribute__((constructor)) static void read_q4_widen_bytes(void) { q4_widen_bytes = switched_on("INFER_Q4_WIDEN_BYTES"); }
typedef __m256 qvec;
static inline qvec qzero(void) { return _mm256_setzero_ps(); }
static inline qvec qset1(float v) { return _mm256_set1_ps(v); }
static inline qvec qload(const float *p) { return _mm256_loadu_ps(p); }
static inline qvec qfma(qvec a, qvec b, qvec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float qsum(qvec v) { return hsum8(v); }
static inline void qcodes(int fmt, const uint8_t *c, qvec w[4]) {
    if (fmt == Q8) {
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * j))));
    } else if (q4_widen_bytes) {
        /* each half's 8 bytes widened once (a load and one shuffle), then both nibbles from the 32-bit lanes: two
         * shuffles a run, where splitting the nibbles in bytes first took six (Zen 3's shuffle pipes the bound) */
        __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8))), low = _mm256_set1_epi32(0x0f);
        w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low));
        w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
        w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
        w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    } else {
        __m128i a = _mm_loadu_si128((const __m128i *)c), low = _mm_set1_epi8(0x0f);
        __m128i lo = _mm_and_si128(a, low), hi = _mm_and_si128(_mm_srli_epi16(a, 4), low);
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    }
}
#endif

/* Scales and mins stored factored (FK, a k-quant's own form): per row, one int8 multiplier per group, then one
 * float16 super-scale per 256 inputs; a group's scale is super * multiplier in fp32, the product llama.cpp forms
 * (exact: 11 + 8 significant bits). Q4_K's sc and m under d and -dmin, Q6_K's int8 sc under d: 0.58 and 1.07
 * bytes a weight with the codes, where float32 scales per group took 0.75 and 1.25. */
enum { FK = 3 };

/* A row's scales or mins as they are stored: float16, float32, or factored (`super`, the row's super-scales;
 * `base`, the row's group this one starts at; 1 << `shift` groups per super-scale: 8 for Q4_K, 16 for Q6_K). */
typedef struct {
    int dtype;
    const void *p;
    const uint16_t *super;
    int64_t base;
    int shift;
} scale_row;

/* Bytes of one row's scales (or mins). */
static inline int64_t scale_row_bytes(int sdtype, int64_t groups, int64_t k) {
    return sdtype == FK ? groups + 2 * (k / 256) : groups * (sdtype == F32 ? 4 : 2);
}

/* Row r's scales (or mins) of a matrix's `all`. */
static inline scale_row scale_row_of(int sdtype, const void *all, int64_t r, int64_t groups, int64_t k) {
    const char *row = all ? (const char *)all + r * scale_row_bytes(sdtype, groups, k) : NULL;
    scale_row s = {sdtype, row, row ? (const uint16_t *)(row + groups) : NULL, 0, 0};
    if (sdtype == FK && k >= 256)
        while ((1 << s.shift) < groups / (k / 256)) s.shift++;
    return s;
}

/* A factored row's `groups` scales as float32 into `out` (then read as an F32 row: every fast path takes it);
 * 16 at a time where the build has AVX512 (a super-scale covers 8 or 16 groups, so 16 groups meet one or two). */
static inline scale_row expand_scale_row(scale_row s, int64_t groups, float *out) {
    int64_t g = 0;
#if defined(HAVE_AVX512)
    if (s.shift >= 3)
        for (; g + 16 <= groups; g += 16) {
            __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)s.p + g))));
            __m512 d = _mm512_set1_ps(load_scale(F16, s.super, g >> s.shift));
            if (s.shift == 3) d = _mm512_mask_mov_ps(d, 0xFF00, _mm512_set1_ps(load_scale(F16, s.super, (g >> 3) + 1)));
            _mm512_storeu_ps(out + g, _mm512_mul_ps(d, m));
        }
#endif
    for (; g < groups; g++) out[g] = load_scale(F16, s.super, g >> s.shift) * (float)((const int8_t *)s.p)[g];
    scale_row e = {F32, out, NULL, 0, 0};
    return e;
}

/* A float16 row's `groups` scales as float32 into `out` (q8 codes in groups of 32, Q8_0's: one conversion per
 * run on the widening path cost ~12% of the product). */
static inline scale_row widen_scale_row(scale_row s, int64_t groups, float *out) {
    int64_t g = 0;
#if defined(HAVE_AVX512)
    for (; g + 16 <= groups; g += 16)
        _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s.p + g))));
#elif defined(__F16C__) && defined(__AVX__)
    for (; g + 8 <= groups; g += 8)
        _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s.p + g))));
#endif
    for (; g < groups; g++) out[g] = load_scale(F16, s.p, g);
    scale_row e = {F32, out, NULL, 0, 0};
    return e;
}

/* The same row from its group g on. */
static inline scale_row scale_row_from(scale_row s, int64_t g) {
    if (s.dtype == FK) s.base += g;
    else s.p = (const char *)s.p + g * (s.dtype == F32 ? 4 : 2);
    return s;
}

static inline __attribute__((always_inline)) float scale_at(scale_row s, int64_t g) {
    if (s.dtype == FK) {
        int64_t i = s.base + g;
        return load_scale(F16, s.super, i >> s.shift) * (float)((const int8_t *)s.p)[i];
    }
    return load_scale(s.dtype, s.p, g);
}

/* Shapes the quantized kernels take: k whole runs of 32; groups of whole runs dividing k, or (q8) of 16, half a
 * run (Q6_K's sub-blocks: a vector's 16 codes, or two AVX2 vectors', share a scale). */
static int qshape_ok(int fmt, int64_t k, int64_t group) {
    return (fmt == Q8 || fmt == Q4) && k > 0 && group > 0 && k % QCHUNK == 0 && k % group == 0 &&
           (group % QCHUNK == 0 || (fmt == Q8 && group == QCHUNK / 2));
}

/* out[j] = sum_g scale_g * sum_{i in g} q_i x_j[i] for the `mt` (1..4) rows x_j = x + j * k of fp32 inputs. */
static inline __attribute__((always_inline)) void qrow_dot(int fmt, const uint8_t *codes, scale_row scales,
                                                           int64_t k, int64_t group, const float *x, int mt,
                                                           float *out) {
    int64_t run_bytes = fmt == Q8 ? QCHUNK : QCHUNK / 2;
#if defined(QLANES)
    enum { V = QCHUNK / QLANES };
    qvec total[4], acc[4], w[V];
    for (int j = 0; j < 4; j++) total[j] = qzero();
    if (group < QCHUNK) { /* groups of 16: each vector's codes times its group's scale, then into the sums */
        for (int64_t i = 0; i < k; i += QCHUNK) {
            const uint8_t *c = codes + i / QCHUNK * run_bytes;
            prefetch(c + PREFETCH_BYTES);
            qcodes(fmt, c, w);
            for (int v = 0; v < V; v++) {
                qvec ws = w[v] * qset1(scale_at(scales, (i + v * QLANES) / group));
                for (int j = 0; j < mt; j++) total[j] = qfma(ws, qload(x + j * k + i + v * QLANES), total[j]);
            }
        }
        for (int j = 0; j < mt; j++) out[j] = qsum(total[j]);
        return;
    }
    for (int64_t g = 0; g < k / group; g++) {
        for (int j = 0; j < 4; j++) acc[j] = qzero();
        for (int64_t i = g * group; i < (g + 1) * group; i += QCHUNK) {
            const uint8_t *c = codes + i / QCHUNK * run_bytes;
            prefetch(c + PREFETCH_BYTES);
            qcodes(fmt, c, w);
            for (int j = 0; j < mt; j++)
                for (int v = 0; v < V; v++) acc[j] = qfma(w[v], qload(x + j * k + i + v * QLANES), acc[j]);
        }
        qvec s = qset1(scale_at(scales, g));
        for (int j = 0; j < mt; j++) total[j] = qfma(s, acc[j], total[j]);
    }
    for (int j = 0; j < mt; j++) out[j] = qsum(total[j]);
#else
    float w[QCHUNK];
    for (int j = 0; j < mt; j++) out[j] = 0.f;
    if (group < QCHUNK) { /* groups of 16 */
        for (int64_t i = 0; i < k; i += QCHUNK) {
            codes_chunk(fmt, codes + i / QCHUNK * run_bytes, w);
            for (int j = 0; j < mt; j++)
                for (int h = 0; h < QCHUNK; h += group) {
                    float acc = 0.f;
                    for (int t = h; t < h + group; t++) acc += w[t] * x[j * k + i + t];
                    out[j] += scale_at(scales, (i + h) / group) * acc;
                }
        }
        return;
    }
    for (int64_t g = 0; g < k / group; g++) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t i = g * group; i < (g + 1) * group; i += QCHUNK) {
            codes_chunk(fmt, codes + i / QCHUNK * run_bytes, w);
            for (int j = 0; j < mt; j++)
                for (int t = 0; t < QCHUNK; t++) acc[j] += w[t] * x[j * k + i + t];
        }
        for (int j = 0; j < mt; j++) out[j] += scale_at(scales, g) * acc[j];
    }
#endif
}

/* qrow_dot for one row of x (decode), two runs in flight on separate sums: one sum per vector of a run held a row
 * to the FMA's latency (4 cycles per run; ~4 weights a cycle per core, compute-bound at half the read bandwidth
 * on a 2-core EPYC). Each group's sums are added, scaled and summed into two totals by group parity. */
static inline __attribute__((always_inline)) float qrow_dot1(int fmt, const uint8_t *codes, scale_row scales,
                                                             int64_t k, int64_t group, const float *x) {
#if defined(QLANES)
    int64_t run_bytes = fmt == Q8 ? QCHUNK : QCHUNK / 2;
    enum { V = QCHUNK / QLANES };
    qvec even = qzero(), odd = qzero(), a0[V], a1[V], w[V];
    if (group < QCHUNK) { /* groups of 16: each vector's codes times its group's scale, two sums by vector parity */
        for (int64_t i = 0; i < k; i += QCHUNK) {
            const uint8_t *c = codes + i / QCHUNK * run_bytes;
            prefetch(c + PREFETCH_BYTES);
            qcodes(fmt, c, w);
            for (int v = 0; v < V; v++) {
                qvec ws = w[v] * qset1(scale_at(scales, (i + v * QLANES) / group));
                if (v & 1) odd = qfma(ws, qload(x + i + v * QLANES), odd);
                else even = qfma(ws, qload(x + i + v * QLANES), even);
            }
        }
        return qsum(even + odd);
    }
    if (group == QCHUNK) { /* a scale per run: each run's sum formed fresh, scaled into the totals by parity */
        int64_t r = 0, runs = k / QCHUNK;
        for (; r + 2 <= runs; r += 2) { /* (two runs an iteration: the parity a register's, not a branch) */
            const uint8_t *c = codes + r * run_bytes;
            prefetch(c + PREFETCH_BYTES);
            qvec w1[V];
            qcodes(fmt, c, w);
            qcodes(fmt, c + run_bytes, w1);
            qvec a = w[0] * qload(x + r * QCHUNK), b = w1[0] * qload(x + (r + 1) * QCHUNK);
            for (int v = 1; v < V; v++) {
                a = qfma(w[v], qload(x + r * QCHUNK + v * QLANES), a);
                b = qfma(w1[v], qload(x + (r + 1) * QCHUNK + v * QLANES), b);
            }
            even = qfma(qset1(scale_at(scales, r)), a, even);
            odd = qfma(qset1(scale_at(scales, r + 1)), b, odd);
        }
        if (r < runs) {
            qcodes(fmt, codes + r * run_bytes, w);
            qvec a = w[0] * qload(x + r * QCHUNK);
            for (int v = 1; v < V; v++) a = qfma(w[v], qload(x + r * QCHUNK + v * QLANES), a);
            even = qfma(qset1(scale_at(scales, r)), a, even);
        }
        return qsum(even + odd);
    }
    for (int64_t g = 0; g < k / group; g++) {
        for (int v = 0; v < V; v++) a0[v] = a1[v] = qzero();
        int64_t i = g * group, end = (g + 1) * group;
        for (; i + 2 * QCHUNK <= end; i += 2 * QCHUNK) {
            const uint8_t *c = codes + i / QCHUNK * run_bytes;
            prefetch(c + PREFETCH_BYTES);
            qcodes(fmt, c, w);
            for (int v = 0; v < V; v++) a0[v] = qfma(w[v], qload(x + i + v * QLANES), a0[v]);
            qcodes(fmt, c + run_bytes, w);
            for (int v = 0; v < V; v++) a1[v] = qfma(w[v], qload(x + i + QCHUNK + v * QLANES), a1[v]);
        }
        if (i < end) {
            const uint8_t *c = codes + i / QCHUNK * run_bytes;
            prefetch(c + PREFETCH_BYTES);
            qcodes(fmt, c, w);
            for (int v = 0; v < V; v++) a0[v] = qfma(w[v], qload(x + i + v * QLANES), a0[v]);
        }
        qvec a = a0[0] + a1[0];
        for (int v = 1; v < V; v++) a += a0[v] + a1[v];
        if (g & 1) odd = qfma(qset1(scale_at(scales, g)), a, odd);
        else even = qfma(qset1(scale_at(scales, g)), a, even);
    }
    return qsum(even + odd);
#else
    float out;
    qrow_dot(fmt, codes, scales, k, group, x, 1, &out);
    return out;
#endif
}

#if defined(QLANES) && QLANES == 8
/* AVX2's one-row products, a scale per run (int4 in groups of 32; Q4_0, Q4_1 and Q8_0 files): qrow_dot1 over
 * QROWS rows of codes at once, each row's sums in its order exactly (the same multiplies and adds per row, so
 * every output is bit for bit qrow_dot1's), their chains interleaved. One row's run is a multiply and three
 * dependent multiply-adds: alone it held a Zen 3 core to that latency (q4 codes at 1.4 weights a cycle, in L2).
 * `scales`: each row's scales as float32 (widened once per row by the caller). */
enum { QROWS = 4 }; /* (the mins' sums below take the four rows in one 128-bit vector) */
_Static_assert(QROWS == 4, "infer_qgemv sums the four rows' mins in one __m128");
static inline __attribute__((always_inline)) void qrows_dot1_runs(int fmt, const uint8_t *codes, int64_t row_bytes,
                                                                  const float *const *scales, int64_t k,
                                                                  const float *x, float *out) {
    int64_t run_bytes = fmt == Q8 ? QCHUNK : QCHUNK / 2, runs = k / QCHUNK, r = 0;
    qvec even[QROWS], odd[QROWS], w[4];
    for (int j = 0; j < QROWS; j++) even[j] = odd[j] = qzero();
#define QROWS_RUN(R, TOTAL)                                                                                       \
    for (int j = 0; j < QROWS; j++) {                                                                             \
        const uint8_t *c = codes + j * row_bytes + (R) * run_bytes;                                               \
        prefetch(c + PREFETCH_BYTES);                                                                             \
        qcodes(fmt, c, w);                                                                                        \
        qvec a = w[0] * qload(x + (R) * QCHUNK);                                                                  \
        for (int v = 1; v < 4; v++) a = qfma(w[v], qload(x + (R) * QCHUNK + v * QLANES), a);                     \
        TOTAL[j] = qfma(qset1(scales[j][R]), a, TOTAL[j]);                                                        \
    }
    for (; r + 2 <= runs; r += 2) { /* runs by parity, as qrow_dot1 sums them: even runs, then odd */
        QROWS_RUN(r, even)
        QROWS_RUN(r + 1, odd)
    }
    if (r < runs) {
        QROWS_RUN(r, even)
    }
#undef QROWS_RUN
    for (int j = 0; j < QROWS; j++) out[j] = qsum(even[j] + odd[j]);
}
#endif

#if defined(HAVE_DOT_BF16)
/* q4 against bf16 inputs by the bf16 pair instruction: a code q is exact as the bf16 of 128 + q (bits 0x4300 | q:
 * exponent 7, q in the 7-bit mantissa), so one OR makes 32 weights' operands; the products are exact and sum in
 * fp32, and the caller subtracts the 128 * scale * sum(x) this adds. out[j] as qrow_dot's, plus that term. */
static inline __attribute__((always_inline)) void q4row_dot_bf16(const uint8_t *codes, scale_row scales, int64_t k,
                                                                 int64_t group, const uint16_t *x, int64_t ldx,
                                                                 int mt, float *out) {
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m512i bias = _mm512_set1_epi16(0x4300);
    __m512 total[4], acc[4];
    for (int j = 0; j < 4; j++) total[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / group; g++) {
        for (int j = 0; j < 4; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += QCHUNK) {
            const uint8_t *c = codes + i / 2;
            prefetch(c + PREFETCH_BYTES);
            __m128i a = _mm_loadu_si128((const __m128i *)c);
            __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(a, 4), low), _mm_and_si128(a, low));
            __m512bh w = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(both), bias);
            for (int j = 0; j < mt; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], w, (__m512bh)_mm512_loadu_si512(x + j * ldx + i));
        }
        __m512 s = _mm512_set1_ps(scale_at(scales, g));
        for (int j = 0; j < mt; j++) total[j] = _mm512_fmadd_ps(s, acc[j], total[j]);
    }
    for (int j = 0; j < mt; j++) out[j] = _mm512_reduce_add_ps(total[j]);
}

/* The scales of the four runs of 128 codes starting at run `run`, each repeated over its run's 4 fp32 lanes. */
static inline __m512 four_run_scales(scale_row scales, int64_t run, int64_t group) {
    if (group >= 128) return _mm512_set1_ps(scale_at(scales, run * QCHUNK / group));
    __m128 v;
    if (group == 32) {
        v = scales.dtype == F32 ? _mm_loadu_ps((const float *)scales.p + run)
                                : _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)scales.p + run)));
        return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                     _mm512_castps128_ps512(v));
    }
    float two[4] = {scale_at(scales, run / 2), scale_at(scales, run / 2 + 1), 0.f, 0.f}; /* group 64 */
    v = _mm_loadu_ps(two);
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(v));
}

/* Block b's 128 codes (64 bytes at `c`) as four registers of bf16 operands, 0x4300 | q, lane L of each run L's. */
static inline __attribute__((always_inline)) void q4_block_operands(const uint8_t *c, __m512bh w[4]) {
    const __m512i low = _mm512_set1_epi8(0x0f), exponent = _mm512_set1_epi8(0x43);
    __m512i v = _mm512_loadu_si512(c);
    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    w[0] = (__m512bh)_mm512_unpacklo_epi8(lo, exponent), w[1] = (__m512bh)_mm512_unpackhi_epi8(lo, exponent);
    w[2] = (__m512bh)_mm512_unpacklo_epi8(hi, exponent), w[3] = (__m512bh)_mm512_unpackhi_epi8(hi, exponent);
}

/* One block's four registers `w` against x's 128 permuted elements at xj, scaled by `s` into `total`. */
static inline __attribute__((always_inline)) __m512 q4_block_sum(const __m512bh w[4], __m512 s, const uint16_t *xj,
                                                                 __m512 total) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), w[0], (__m512bh)_mm512_loadu_si512(xj));
    __m512 other = _mm512_dpbf16_ps(_mm512_setzero_ps(), w[1], (__m512bh)_mm512_loadu_si512(xj + 32));
    acc = _mm512_dpbf16_ps(acc, w[2], (__m512bh)_mm512_loadu_si512(xj + 64));
    other = _mm512_dpbf16_ps(other, w[3], (__m512bh)_mm512_loadu_si512(xj + 96));
    return _mm512_fmadd_ps(s, _mm512_add_ps(acc, other), total);
}

/* The codes past the last whole 128 (from `done`): a last 64 (k = 576) the same way in 256-bit registers, into
 * `total`; a last 32, q4row_dot_bf16's way, into `tail`. */
static inline __attribute__((always_inline)) void q4row_rest_bf16(const uint8_t *codes, scale_row scales, int64_t k,
                                                                  int64_t group, const uint16_t *xp,
                                                                  const uint16_t *x, int mt, int64_t done,
                                                                  __m512 total[4], float tail[4]) {
    if (k - done >= 64 && group <= 64) { /* two runs the same way in 256-bit registers (k = 576: its last 64) */
        const __m256i low2 = _mm256_set1_epi8(0x0f), exponent2 = _mm256_set1_epi8(0x43);
        __m256i v = _mm256_loadu_si256((const __m256i *)(codes + done / 2));
        __m256i lo = _mm256_and_si256(v, low2), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low2);
        __m256bh w0 = (__m256bh)_mm256_unpacklo_epi8(lo, exponent2), w1 = (__m256bh)_mm256_unpackhi_epi8(lo, exponent2);
        __m256bh w2 = (__m256bh)_mm256_unpacklo_epi8(hi, exponent2), w3 = (__m256bh)_mm256_unpackhi_epi8(hi, exponent2);
        int64_t run = done / QCHUNK;
        __m256 s = group == 32 ? _mm256_setr_m128(_mm_set1_ps(scale_at(scales, run)), _mm_set1_ps(scale_at(scales, run + 1)))
                               : _mm256_set1_ps(scale_at(scales, run / 2));
        for (int j = 0; j < mt; j++) {
            const uint16_t *xj = xp + j * k + done;
            __m256 acc = _mm256_dpbf16_ps(_mm256_setzero_ps(), w0, (__m256bh)_mm256_loadu_si256((const __m256i *)xj));
            acc = _mm256_dpbf16_ps(acc, w1, (__m256bh)_mm256_loadu_si256((const __m256i *)(xj + 16)));
            acc = _mm256_dpbf16_ps(acc, w2, (__m256bh)_mm256_loadu_si256((const __m256i *)(xj + 32)));
            acc = _mm256_dpbf16_ps(acc, w3, (__m256bh)_mm256_loadu_si256((const __m256i *)(xj + 48)));
            total[j] = _mm512_add_ps(total[j], _mm512_zextps256_ps512(_mm256_mul_ps(s, acc)));
        }
        done += 64;
    }
    for (int j = 0; j < mt; j++) tail[j] = 0.f;
    if (done < k) { /* the tail starts on a group boundary: the caller checked that group divides it */
        scale_row rest = scale_row_from(scales, done / group);
        q4row_dot_bf16(codes + done / 2, rest, k - done, group, x + done, k, mt, tail);
    }
}

/* The same sums four runs (128 codes, 64 bytes) at a time, with no widening at all: the low and high nibbles,
 * byte-interleaved with 0x43 (unpack within each 128-bit lane), are 16-bit lanes 0x4300 | q, four registers of
 * bf16 operands; lane L of each holds run L's codes, so fp32 lanes 4L..4L+3 of the products are run L's sums and
 * one vector of the four runs' scales scales them. x comes permuted to match (`permute_x_q4`, once per call).
 * A last 64 codes (k = 576) go the same way in 256-bit registers; a last 32, q4row_dot_bf16's way. */
static inline __attribute__((always_inline)) void q4row_dot_bf16x4(const uint8_t *codes, scale_row scales, int64_t k,
                                                                   int64_t group, const uint16_t *xp,
                                                                   const uint16_t *x, int mt, float *out) {
    __m512 total[4];
    for (int j = 0; j < mt; j++) total[j] = _mm512_setzero_ps();
    int64_t blocks = k / 128;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *c = codes + b * 64;
        prefetch(c + PREFETCH_BYTES);
        __m512bh w[4];
        q4_block_operands(c, w);
        __m512 s = four_run_scales(scales, b * 4, group);
        for (int j = 0; j < mt; j++) total[j] = q4_block_sum(w, s, xp + j * k + b * 128, total[j]);
    }
    float tail[4];
    q4row_rest_bf16(codes, scales, k, group, xp, x, mt, blocks * 128, total, tail);
    for (int j = 0; j < mt; j++) out[j] = _mm512_reduce_add_ps(total[j]) + tail[j];
}

/* The same for two rows of codes (`codes`, `codes + row_bytes`) against one row of x, their blocks interleaved:
 * one row's chain of a block's products, its sum and its scaling held a Zen 4 core to their latency (~6 weights a
 * cycle); two independent chains fill the pipes (int4 [3072, 768] on one thread of a 2-core Zen 4 EPYC, from L3:
 * 123 -> 82 us; four rows at once spilled, 0.75x). Each row's sums are q4row_dot_bf16x4's, in its order: the same
 * bits. */
static inline __attribute__((always_inline)) void q4rows2_dot_bf16x4(const uint8_t *codes, int64_t row_bytes,
                                                                     const scale_row scales[2], int64_t k,
                                                                     int64_t group, const uint16_t *xp,
                                                                     const uint16_t *x, float out[2]) {
    __m512 total0[4] = {_mm512_setzero_ps()}, total1[4] = {_mm512_setzero_ps()}; /* (q4row_rest_bf16's form) */
    const uint8_t *c1 = codes + row_bytes;
    int64_t blocks = k / 128;
    for (int64_t b = 0; b < blocks; b++) { /* (the two rows spelled out: an array of their sums went to the stack) */
        __m512bh w0[4], w1[4];
        prefetch(codes + b * 64 + PREFETCH_BYTES);
        prefetch(c1 + b * 64 + PREFETCH_BYTES);
        q4_block_operands(codes + b * 64, w0);
        q4_block_operands(c1 + b * 64, w1);
        total0[0] = q4_block_sum(w0, four_run_scales(scales[0], b * 4, group), xp + b * 128, total0[0]);
        total1[0] = q4_block_sum(w1, four_run_scales(scales[1], b * 4, group), xp + b * 128, total1[0]);
    }
    float tail0[4], tail1[4];
    q4row_rest_bf16(codes, scales[0], k, group, xp, x, 1, blocks * 128, total0, tail0);
    q4row_rest_bf16(c1, scales[1], k, group, xp, x, 1, blocks * 128, total1, tail1);
    out[0] = _mm512_reduce_add_ps(total0[0]) + tail0[0];
    out[1] = _mm512_reduce_add_ps(total1[0]) + tail1[0];
}

/* Q6_K's codes c (-32..31, groups of 16) against bf16 inputs by the pair instruction: 160 + c is exact as a bf16
 * (bits 0x4300 | (c + 32)), so an add and a widening make a run's 32 operands with no conversion to fp32; the pairs
 * sum into 16 lanes, lanes 0-7 one group and 8-15 the next, scaled by a vector of the two groups' scales. The
 * caller subtracts the 160 * sum_g scale_g * sum(x in g) this adds. */
static inline __attribute__((always_inline)) float q6row_dot_bf16(const uint8_t *codes, scale_row scales, int64_t k,
                                                                  const uint16_t *x) {
    const __m256i offset = _mm256_set1_epi8(32);
    const __m512i exponent = _mm512_set1_epi16(0x4300);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int64_t r = 0; r < k / QCHUNK; r++) {
        const uint8_t *c = codes + r * QCHUNK;
        prefetch(c + PREFETCH_BYTES);
        __m256i u = _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)c), offset);
        __m512bh w = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(u), exponent);
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, (__m512bh)_mm512_loadu_si512(x + r * QCHUNK));
        __m512 s = _mm512_insertf32x8(_mm512_set1_ps(scale_at(scales, 2 * r)), _mm256_set1_ps(scale_at(scales, 2 * r + 1)),
                                      1);
        if (r & 1) odd = _mm512_fmadd_ps(s, a, odd);
        else even = _mm512_fmadd_ps(s, a, even);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
}

/* A run's 32 int8 codes as bf16 operands of the pair instruction, in order (each code exact). */
static inline __attribute__((always_inline)) __m512bh q8_operands(const uint8_t *c) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* q8 codes against bf16 inputs by the pair instruction: an int8 code is exact as a bf16 (8 significant bits), so
 * a run's 32 codes widen to fp32 and pack into one register of bf16 operands, in order; the products are exact and
 * sum in fp32, as the widening path's, with half its multiply-adds and x read as bf16 (1.4-1.5x the widening
 * path's rate on a 2-core EPYC, where both are compute-bound). Two sums per row of x, by run parity within a
 * group, then each group's scale; out[j] as qrow_dot's. Groups of whole pairs of runs. */
static inline __attribute__((always_inline)) void q8row_dot_bf16(const uint8_t *codes, scale_row scales, int64_t k,
                                                                 int64_t group, const uint16_t *x, int64_t ldx,
                                                                 int mt, float *out) {
    __m512 even[4], odd[4], a0[4], a1[4];
    for (int j = 0; j < 4; j++) even[j] = odd[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / group; g++) {
        for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm512_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += 2 * QCHUNK) {
            prefetch(codes + i + PREFETCH_BYTES);
            __m512bh w0 = q8_operands(codes + i), w1 = q8_operands(codes + i + QCHUNK);
            for (int j = 0; j < mt; j++) {
                a0[j] = _mm512_dpbf16_ps(a0[j], w0, (__m512bh)_mm512_loadu_si512(x + j * ldx + i));
                a1[j] = _mm512_dpbf16_ps(a1[j], w1, (__m512bh)_mm512_loadu_si512(x + j * ldx + i + QCHUNK));
            }
        }
        __m512 s = _mm512_set1_ps(scale_at(scales, g));
        for (int j = 0; j < mt; j++) {
            if (g & 1) odd[j] = _mm512_fmadd_ps(s, _mm512_add_ps(a0[j], a1[j]), odd[j]);
            else even[j] = _mm512_fmadd_ps(s, _mm512_add_ps(a0[j], a1[j]), even[j]);
        }
    }
    for (int j = 0; j < mt; j++) out[j] = _mm512_reduce_add_ps(_mm512_add_ps(even[j], odd[j]));
}

/* x `[m, k]` (bf16) in q4row_dot_bf16x4's order: per 128 elements, elements 0-7 of each of the four runs, then
 * 8-15, 16-23 and 24-31; the elements past the last whole 128 are not needed there. */
static void permute_x_q4(const uint16_t *x, uint16_t *xp, int64_t m, int64_t k) {
    for (int64_t j = 0; j < m; j++) {
        int64_t b = 0;
        for (; b + 128 <= k; b += 128)
            for (int part = 0; part < 4; part++)
                for (int run = 0; run < 4; run++)
                    memcpy(xp + j * k + b + part * 32 + run * 8, x + j * k + b + run * 32 + part * 8, 16);
        if (b + 64 <= k) /* the two-run tail: the same order over two runs */
            for (int part = 0; part < 4; part++)
                for (int run = 0; run < 2; run++)
                    memcpy(xp + j * k + b + part * 16 + run * 8, x + j * k + b + run * 32 + part * 8, 16);
    }
}
#endif

#if defined(HAVE_AVX512)
/* Groups g .. g + 15 of a row's scales or mins (float16 or float32) as float32, those past `mask` 0. */
static inline __m512 scales_masked(scale_row v, int64_t g, __mmask16 mask) {
    return v.dtype == F32 ? _mm512_maskz_loadu_ps(mask, (const float *)v.p + g)
                          : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)v.p + g));
}
#endif

/* sum_g (min_g - offset * scale_g) * xsum[g] over a row's `groups` mins (none where mins.p is NULL) and scales
 * (float16 or float32): the terms a q4 or Q6_K row's products leave out (its mins' share, and what the bf16 pair
 * paths' codes carry above q). One pass, 16 groups a vector, the last ones under a mask: a pass for the mins and
 * one for the scales, each with a scalar tail (8 of the 24 groups at k = 768), had cost a fifth of the product
 * (int4 [3072, 768], one thread of a 2-core Zen 4 EPYC: 142 -> 115 us). */
static inline float offset_dot(scale_row mins, scale_row scales, float offset, const float *xsum, int64_t groups) {
#if defined(HAVE_AVX512)
    __m512 acc = _mm512_setzero_ps(), neg = _mm512_set1_ps(-offset);
    for (int64_t g = 0; g < groups; g += 16) {
        __mmask16 mask = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
        __m512 c = mins.p ? scales_masked(mins, g, mask) : _mm512_setzero_ps();
        if (offset != 0.f) c = _mm512_fmadd_ps(neg, scales_masked(scales, g, mask), c);
        acc = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(mask, xsum + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float sum = 0.f; /* (a multiply, then an add, in group order: AVX2's rows of codes four at once sum so too) */
    for (int64_t g = 0; g < groups; g++)
        sum += ((mins.p ? scale_at(mins, g) : 0.f) - (offset != 0.f ? offset * scale_at(scales, g) : 0.f)) * xsum[g];
    return sum;
#endif
}

/* y[j, r] = sum_i W[r, i] x[j, i] (+ bias[r]) for m rows of x `[m, k]` and n rows of W, x, bias and y of `dtype`,
 * scales and mins `[n, k / group]` of `sdtype` (mins NULL for q8). k and group are multiples of 32, group divides
 * k. Returns 0, -1 where the fp32 copy of x could not be allocated, -2 on a bad shape (nothing written).
 * INFER_QGEMV_FOUR_RUNS=0 turns the four-run bf16 path off (its check); INFER_QGEMV_Q8_PAIRS=0 and
 * INFER_QGEMV_Q6_PAIRS=0 the q8 and Q6_K pair paths; INFER_QGEMV_WIDEN_SCALES=0 Q8_0's float32 row of scales. */
int infer_qgemv(int fmt, const uint8_t *codes, int sdtype, const void *scales, const void *mins, int dtype,
                const void *x, const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group,
                int threads) {
    /* Q4_0's mins, -8 x the scales, formed, not read: a thread streams 18 bytes a run of 32 weights where it read
     * 20 (codes, scales, mins); -8 x a float16 or float32 scale is exact, so every min is the one stored */
    int formed = (fmt & MINS_EIGHT_SCALES) && switched_on("INFER_QGEMV_FORMED_MINS");
    if ((fmt & MINS_EIGHT_SCALES) && ((fmt & ~MINS_EIGHT_SCALES) != Q4 || !mins)) return -2;
    fmt &= ~MINS_EIGHT_SCALES;
    if (formed) mins = NULL;
    int narrow = fmt == Q6; /* q8 everywhere but the bf16 path below */
    if (narrow) fmt = Q8;
    if (!qshape_ok(fmt, k, group)) return -2;
    if (sdtype == FK && k % 256) return -2;
    int64_t groups = k / group, row_bytes = fmt == Q8 ? k : k / 2;
    float *xf = (float *)malloc((size_t)(m * k + m * groups) * sizeof(float));
    if (!xf) return -1;
    float *xsum = xf + m * k;
    for (int64_t j = 0; j < m; j++)
        for (int64_t g = 0; g < groups; g++) {
            int64_t i = g * group, end = (g + 1) * group;
            float s = 0.f;
#if defined(HAVE_AVX512)
            if (dtype == BF16 || dtype == F32) { /* 16 lanes (a group is whole 16s), then across: one add after
                                                  * another, a 3072-input row took ~3 us of each call while its
                                                  * threads waited */
                __m512 acc = _mm512_setzero_ps();
                for (; i < end; i += 16) {
                    const void *at = dtype == F32 ? (const void *)((const float *)x + j * k + i)
                                                  : (const void *)((const uint16_t *)x + j * k + i);
                    __m512 v = dtype == F32 ? _mm512_loadu_ps(at)
                                            : _mm512_castsi512_ps(_mm512_slli_epi32(
                                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at)), 16));
                    _mm512_storeu_ps(xf + j * k + i, v);
                    acc = _mm512_add_ps(acc, v);
                }
                s = _mm512_reduce_add_ps(acc);
            }
#endif
            for (; i < end; i++) s += (xf[j * k + i] = load_scalar(dtype, x, j * k + i));
            xsum[j * groups + g] = s;
        }
    int bf16_q4 = 0, four_runs = 0; /* q4 codes against bf16 inputs by the pair instruction (codes carry +128) */
    /* factored scales, and float16 ones of q8 runs: each row's made float32 once, in a buffer per thread */
    int expand = sdtype == FK ||
                 (sdtype == F16 && fmt == Q8 && group == QCHUNK && switched_on("INFER_QGEMV_WIDEN_SCALES"));
    int failed = 0;
    int bf16_q6 = 0;                 /* Q6_K's codes the same way (codes carry +160) */
    int several_rows = switched_on("INFER_QGEMV_ROWS"); /* AVX2: rows of codes QROWS at once (qrows_dot1_runs) */
#if defined(QLANES) && QLANES == 8
    q4_widen_bytes = switched_on("INFER_Q4_WIDEN_BYTES"); /* (read again here: a process can A/B it) */
#endif
    int bf16_q8 = 0;                 /* q8 codes the same way, in groups of two or more runs */
    int row_pairs = 0;               /* q4 rows of codes two at once against one row of x (below) */
    uint16_t *xp = NULL;
    (void)narrow;
    (void)several_rows;
    (void)row_pairs;
#if defined(HAVE_DOT_BF16)
    bf16_q4 = fmt == Q4 && dtype == BF16;
    bf16_q6 = narrow && group == QCHUNK / 2 && dtype == BF16 && switched_on("INFER_QGEMV_Q6_PAIRS");
    /* groups of one run (Q8_0, the int8 head) stay on the widening path: a pair sum per run and its scale cost as
     * much as widening (measured slower), where two or more runs to a scale share one sum */
    bf16_q8 = fmt == Q8 && group % (2 * QCHUNK) == 0 && dtype == BF16 && switched_on("INFER_QGEMV_Q8_PAIRS");
    four_runs = bf16_q4 && k >= 128 && (group <= 64 || group % 128 == 0) && (k % 128) % group == 0 &&
                switched_on("INFER_QGEMV_FOUR_RUNS");
    if (four_runs) {
        xp = (uint16_t *)malloc((size_t)(m * k) * sizeof(uint16_t));
        if (!xp) {
            free(xf);
            return -1;
        }
        permute_x_q4((const uint16_t *)x, xp, m, k);
    }
    /* one row of x (a decode step's): rows of codes two at once (q4rows2_dot_bf16x4), INFER_QGEMV_ROW_PAIRS not 0;
     * scales made float32 row by row (factored ones) stay on the row-by-row path */
    row_pairs = four_runs && m == 1 && !expand && switched_on("INFER_QGEMV_ROW_PAIRS");
#endif
    row_blocks rb = share_row_blocks(n, threads);
    if (!rb.ranges) {
        free(xp);
        free(xf);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *expanded = expand ? (float *)malloc((size_t)(2 * groups) * sizeof(float)) : NULL;
        if (expand && !expanded) { /* no memory: this thread computes nothing (reported below) */
#pragma omp atomic write
            failed = 1;
        }
#if defined(QLANES) && QLANES == 8
        /* one row of x, a scale per run: QROWS rows of codes at once (qrows_dot1_runs), their scales widened first */
        float *wide = m == 1 && group == QCHUNK && several_rows
                          ? (float *)malloc((size_t)(2 * QROWS * groups) * sizeof(float)) /* scales, then mins */
                          : NULL;
#endif
        work_walk walk = work_start(rb.ranges, rb.nr, rb.items, rb.balance);
        for (int64_t item; !(expand && !expanded) && (item = work_next(&walk)) >= 0;) {
            int64_t r = 16 * item, r1 = r + 16 < n ? r + 16 : n;
#if defined(QLANES) && QLANES == 8
            for (; wide && r + QROWS <= r1; r += QROWS) {
                const float *sr[QROWS];
                float out[QROWS];
                for (int j = 0; j < QROWS; j++) { /* (float16 and factored scales made float32: the values scale_at reads) */
                    scale_row rs = scale_row_of(sdtype, scales, r + j, groups, k);
                    sr[j] = sdtype == F32 ? (const float *)rs.p
                            : (const float *)(sdtype == F16 ? widen_scale_row(rs, groups, wide + j * groups)
                                                            : expand_scale_row(rs, groups, wide + j * groups)).p;
                }
                if (fmt == Q4) qrows_dot1_runs(Q4, codes + r * row_bytes, row_bytes, sr, k, xf, out);
                else qrows_dot1_runs(Q8, codes + r * row_bytes, row_bytes, sr, k, xf, out);
                if (mins || formed) { /* each row's sum over its groups in offset_dot's order (a multiply, then an
                                       * add), the four rows' sums in the lanes of one vector: their mins made float32
                                       * (or formed) and laid out group-major */
                    float *mt = wide + QROWS * groups;
                    for (int j = 0; j < QROWS; j++) {
                        scale_row rm = scale_row_of(sdtype, mins, r + j, groups, k);
                        for (int64_t g = 0; g < groups; g++)
                            mt[g * QROWS + j] = formed ? -8.f * sr[j][g] : scale_at(rm, g);
                    }
                    __m128 msum = _mm_setzero_ps();
                    for (int64_t g = 0; g < groups; g++)
                        msum = _mm_add_ps(msum, _mm_mul_ps(_mm_loadu_ps(mt + g * QROWS), _mm_set1_ps(xsum[g])));
                    float ms[QROWS];
                    _mm_storeu_ps(ms, msum);
                    for (int j = 0; j < QROWS; j++) out[j] += ms[j];
                }
                for (int j = 0; j < QROWS; j++) {
                    float v = out[j];
                    v += bias ? load_scalar(dtype, bias, r + j) : 0.f;
                    store_scalar(dtype, y, r + j, v);
                }
            }
#endif
#if defined(HAVE_DOT_BF16)
            for (; row_pairs && r + 2 <= r1; r += 2) { /* one row of x: rows of codes two at once */
                scale_row rs[2] = {scale_row_of(sdtype, scales, r, groups, k),
                                   scale_row_of(sdtype, scales, r + 1, groups, k)};
                float out[2];
                q4rows2_dot_bf16x4(codes + r * row_bytes, row_bytes, rs, k, group, xp, (const uint16_t *)x, out);
                for (int t = 0; t < 2; t++) {
                    float v = out[t] + offset_dot(scale_row_of(sdtype, mins, r + t, groups, k), rs[t],
                                                  formed ? 136.f : 128.f, xsum, groups);
                    v += bias ? load_scalar(dtype, bias, r + t) : 0.f;
                    store_scalar(dtype, y, r + t, v);
                }
            }
#endif
            for (; r < r1; r++) {
                const uint8_t *row = codes + r * row_bytes;
                scale_row rs = scale_row_of(sdtype, scales, r, groups, k);
                scale_row rm = scale_row_of(sdtype, mins, r, groups, k);
                if (expand && sdtype == F16) {
                    rs = widen_scale_row(rs, groups, expanded);
                } else if (expand) {
                    rs = expand_scale_row(rs, groups, expanded);
                    if (mins) rm = expand_scale_row(rm, groups, expanded + groups);
                }
                for (int64_t j0 = 0; j0 < m; j0 += 4) {
                    float out[4];
                    int mt = m - j0 < 4 ? (int)(m - j0) : 4;
#if defined(HAVE_DOT_BF16)
                    const uint16_t *xb = (const uint16_t *)x + j0 * k;
                    if (bf16_q6) {
                        for (int j = 0; j < mt; j++) out[j] = q6row_dot_bf16(row, rs, k, xb + j * k);
                    } else if (bf16_q8) {
                        q8row_dot_bf16(row, rs, k, group, xb, k, mt, out);
                    } else if (four_runs) {
                        if (mt == 4) q4row_dot_bf16x4(row, rs, k, group, xp + j0 * k, xb, 4, out);
                        else for (int j = 0; j < mt; j++)
                            q4row_dot_bf16x4(row, rs, k, group, xp + (j0 + j) * k, xb + j * k, 1, out + j);
                    } else if (bf16_q4) {
                        if (mt == 4) q4row_dot_bf16(row, rs, k, group, xb, k, 4, out);
                        else for (int j = 0; j < mt; j++) q4row_dot_bf16(row, rs, k, group, xb + j * k, k, 1, out + j);
                    } else
#endif
                    if (mt == 4) qrow_dot(fmt, row, rs, k, group, xf + j0 * k, 4, out);
                    else for (int j = 0; j < mt; j++) out[j] = qrow_dot1(fmt, row, rs, k, group, xf + (j0 + j) * k);
                    for (int j = 0; j < mt; j++) {
                        float v = out[j];
                        if (mins || formed || bf16_q4 || bf16_q6) /* the mins' share (formed: -8 x the scales'),
                                                                   * less what the pair paths' codes carry */
                            v += offset_dot(rm, rs, (bf16_q4 ? 128.f : bf16_q6 ? 160.f : 0.f) + (formed ? 8.f : 0.f),
                                            xsum + (j0 + j) * groups, groups);
                        v += bias ? load_scalar(dtype, bias, r) : 0.f;
                        store_scalar(dtype, y, (j0 + j) * n + r, v);
                    }
                }
            }
        }
#if defined(QLANES) && QLANES == 8
        free(wide);
#endif
        free(expanded);
    }
    free(rb.ranges);
    free(xp);
    free(xf);
    return failed ? -1 : 0;
}

/* ---- int8 activations (opt-in, lossy): one row of x quantized as llama.cpp quantizes it for its Q8_0 products ----
 * Each run of 32 inputs gets d = max |x| / 127 (fp32) and codes round(x / d) (half to even) in -127..127; the
 * codes then multiply the weight's codes as integers (AVX512-VNNI's vpdpbusd, 64 a instruction; AVX2's vpmaddubsw;
 * plain C elsewhere), each run's integer sum times d times the group's scale in fp32. The mins' part (q4) keeps x's
 * exact group sums. The formula, in fp32 with another order of sums: infer.quant_weights.int8_activation_product. */
static void quantize_runs(const float *xf, int64_t k, int8_t *q, float *d) {
    int64_t r = 0;
#if defined(HAVE_AVX512)
    /* (the same divisions and rounding, 16 at a time) */
    for (; r < k / QCHUNK; r++) {
        __m512 v0 = _mm512_loadu_ps(xf + r * QCHUNK), v1 = _mm512_loadu_ps(xf + r * QCHUNK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float dr = amax / 127.f;
        d[r] = dr;
        if (!(dr > 0.f)) {
            memset(q + r * QCHUNK, 0, QCHUNK);
            continue;
        }
        __m512 dv = _mm512_set1_ps(dr), lim = _mm512_set1_ps(127.f);
        __m512 c0 = _mm512_roundscale_ps(_mm512_div_ps(v0, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 c1 = _mm512_roundscale_ps(_mm512_div_ps(v1, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c0 = _mm512_max_ps(_mm512_min_ps(c0, lim), _mm512_set1_ps(-127.f));
        c1 = _mm512_max_ps(_mm512_min_ps(c1, lim), _mm512_set1_ps(-127.f));
        _mm_storeu_si128((__m128i *)(q + r * QCHUNK), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c0)));
        _mm_storeu_si128((__m128i *)(q + r * QCHUNK + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c1)));
    }
#endif
    for (; r < k / QCHUNK; r++) {
        const float *v = xf + r * QCHUNK;
        float amax = 0.f;
        for (int i = 0; i < QCHUNK; i++) amax = fmaxf(amax, fabsf(v[i]));
        float dr = amax / 127.f;
        d[r] = dr;
        for (int i = 0; i < QCHUNK; i++) {
            float c = dr > 0.f ? nearbyintf(v[i] / dr) : 0.f;
            q[r * QCHUNK + i] = (int8_t)(c > 127.f ? 127 : c < -127.f ? -127 : c);
        }
    }
}

/* One row's sum over runs [r0, r1) of codes against the quantized x, each run's integer sum times cw[run] (its d
 * times its group's scale): the portable form (and every build's odd last run). */
static float a8_runs_plain(int fmt, const uint8_t *row, const int8_t *qa, const float *cw, int64_t r0, int64_t r1) {
    float sum = 0.f;
    for (int64_t r = r0; r < r1; r++) {
        int32_t isum = 0;
        for (int i = 0; i < QCHUNK; i++) {
            int w = fmt == Q8 ? ((const int8_t *)row)[r * QCHUNK + i]
                              : (row[r * 16 + (i & 15)] >> (i < 16 ? 0 : 4)) & 15;
            isum += w * qa[r * QCHUNK + i];
        }
        sum += (float)isum * cw[r];
    }
    return sum;
}

#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
#define A8_PAIRS 1 /* runs two at a time, 64 codes a vpdpbusd */
/* Pair p's 64 x codes in the order its weight vector holds its codes (q4: both runs' low nibbles, then both runs'
 * high ones; q8: as stored) and (q8: its codes carry +128) 128 times each lane's four x codes. */
static void a8_lay_out_pairs(int fmt, const int8_t *qa, int64_t pairs, int8_t *ap, int32_t *corr) {
    for (int64_t p = 0; p < pairs; p++) {
        const int8_t *a0 = qa + 2 * p * QCHUNK, *a1 = a0 + QCHUNK;
        int8_t *o = ap + p * 64;
        if (fmt == Q4) {
            memcpy(o, a0, 16), memcpy(o + 16, a1, 16), memcpy(o + 32, a0 + 16, 16), memcpy(o + 48, a1 + 16, 16);
        } else {
            memcpy(o, a0, 64);
        }
        for (int lane = 0; fmt == Q8 && lane < 16; lane++) {
            int32_t s = 0;
            for (int i = 0; i < 4; i++) s += o[lane * 4 + i];
            corr[p * 16 + lane] = 128 * s;
        }
    }
}

/* Pair p's 16 lanes of integer sums. */
static inline __attribute__((always_inline)) __m512i a8_pair(int fmt, const uint8_t *row, const int8_t *ap,
                                                             const int32_t *corr, int64_t p) {
    __m512i a = _mm512_loadu_si512((const void *)(ap + p * 64));
    if (fmt == Q4) {
        __m256i c = _mm256_loadu_si256((const __m256i *)(row + p * 32)), m = _mm256_set1_epi8(15);
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(c, m)),
                                       _mm256_and_si256(_mm256_srli_epi16(c, 4), m), 1);
        return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
    }
    __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void *)(row + p * 64)), _mm512_set1_epi8((char)0x80));
    return _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a),
                            _mm512_loadu_si512((const void *)(corr + p * 16)));
}

/* Which of a pair's two runs each lane of its sums belongs to (q4's lanes: runs 0, 1, 0, 1 by fours; q8's: 0, 1 by
 * eights): the index of the permute that picks each lane's factor. */
static inline __m512i a8_lanes(int fmt) {
    return fmt == Q4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                     : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
}

/* Pair p's 16 lanes' factors: each lane's run's d times its group's scale (`cw`, a row's per run), by one permute. */
static inline __attribute__((always_inline)) __m512 a8_factors(__m512i lanes, const float *cw, int64_t p) {
    return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(cw + 2 * p)))));
}

/* Rows r and r + 1 (`row` and `row + row_bytes`) over their pairs of runs at once: x's codes loaded once for both,
 * two sums in flight; each row as a8_row computes it. */
static inline __attribute__((always_inline)) void a8_rows2(int fmt, const uint8_t *row, int64_t row_bytes,
                                                           const int8_t *ap, const int32_t *corr, const float *cw0,
                                                           const float *cw1, int64_t pairs, __m512 acc0, __m512 acc1,
                                                           float out[2]) {
    const __m512i lanes = a8_lanes(fmt);
    const int64_t pair_bytes = fmt == Q4 ? 32 : 64;
    const uint8_t *row1 = row + row_bytes;
    for (int64_t p = 0; p < pairs; p++) {
        if ((p & 1) == 0) {
            prefetch(row + p * pair_bytes + PREFETCH_BYTES);
            prefetch(row1 + p * pair_bytes + PREFETCH_BYTES);
        }
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a8_pair(fmt, row, ap, corr, p)), a8_factors(lanes, cw0, p), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a8_pair(fmt, row1, ap, corr, p)), a8_factors(lanes, cw1, p), acc1);
    }
    out[0] = _mm512_reduce_add_ps(acc0);
    out[1] = _mm512_reduce_add_ps(acc1);
}

/* One row's sum over its pairs of runs (`cw`: each run's d times its group's scale), two sums in turn; `acc1` starts
 * the second (the mins' part, or zero). */
static inline __attribute__((always_inline)) float a8_row(int fmt, const uint8_t *row, const int8_t *ap,
                                                          const int32_t *corr, const float *cw, int64_t pairs,
                                                          __m512 acc1) {
    const __m512i lanes = a8_lanes(fmt);
    __m512 acc0 = _mm512_setzero_ps();
    int64_t p = 0;
    const int64_t pair_bytes = fmt == Q4 ? 32 : 64;
    for (; p + 2 <= pairs; p += 2) {
        /* each cache line PREFETCH_BYTES ahead of its load (past the row's end: the next row's) */
        prefetch(row + p * pair_bytes + PREFETCH_BYTES);
        if (fmt == Q8) prefetch(row + p * pair_bytes + 64 + PREFETCH_BYTES);
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a8_pair(fmt, row, ap, corr, p)), a8_factors(lanes, cw, p), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a8_pair(fmt, row, ap, corr, p + 1)), a8_factors(lanes, cw, p + 1), acc1);
    }
    if (p < pairs) acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a8_pair(fmt, row, ap, corr, p)), a8_factors(lanes, cw, p), acc0);
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* One run's 8 lanes of integer sums (vpmaddubsw: unsigned codes by signed x; q8: |w| by x signed as w). */
static inline __attribute__((always_inline)) __m256i a8_run_avx2(int fmt, const uint8_t *row, const int8_t *qa,
                                                                 int64_t r) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(qa + r * QCHUNK)), p16;
    if (fmt == Q4) {
        __m128i c = _mm_loadu_si128((const __m128i *)(row + r * 16)), m = _mm_set1_epi8(15);
        __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), m), _mm_and_si128(c, m));
        p16 = _mm256_maddubs_epi16(w, a);
    } else {
        __m256i w = _mm256_loadu_si256((const __m256i *)(row + r * QCHUNK));
        p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
    }
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
#endif

/* sum_i a[i] b[i] in fp32 (the mins' part: a row's mins by x's group sums). */
static inline float a8_dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#if defined(HAVE_AVX512)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y = W x (+ bias) for one row x of `dtype` (fp32 or bf16) with x quantized to int8 per run of 32 (above); W's codes
 * q8 or q4 in groups of whole runs, scales and mins as infer_qgemv reads them. Per row, each run's d times its
 * group's scale is formed once (a vector of k / 32), and the mins' part is their dot with x's group sums. Returns 0,
 * -1 where a buffer could not be allocated, -2 on a shape these products do not take (nothing written). */
int infer_qgemv_a8(int fmt, const uint8_t *codes, int sdtype, const void *scales, const void *mins, int dtype,
                   const void *x, const void *bias, void *y, int64_t n, int64_t k, int64_t group, int threads) {
    if ((fmt != Q8 && fmt != Q4) || k <= 0 || group <= 0 || k % group || group % QCHUNK ||
        (sdtype == FK && k % 256))
        return -2;
    int64_t runs = k / QCHUNK, groups = k / group, per = group / QCHUNK, row_bytes = fmt == Q8 ? k : k / 2;
    int64_t pairs = 0;
    size_t bytes = (size_t)(k + runs + groups) * sizeof(float) + (size_t)k;
#if defined(A8_PAIRS)
    pairs = runs / 2;
    bytes += (size_t)pairs * (64 + 16 * sizeof(int32_t));
#endif
    char *buf = (char *)malloc(bytes);
    if (!buf) return -1;
    float *xf = (float *)buf, *d = xf + k, *xsum = d + runs;
    int8_t *qa = (int8_t *)(xsum + groups);
    for (int64_t i = 0; i < k; i++) xf[i] = load_scalar(dtype, x, i);
    for (int64_t g = 0; g < groups; g++) {
        float s = 0.f;
        for (int64_t i = g * group; i < (g + 1) * group; i++) s += xf[i];
        xsum[g] = s;
    }
    quantize_runs(xf, k, qa, d);
#if defined(A8_PAIRS)
    int32_t *corr = (int32_t *)(qa + k);
    int8_t *ap = (int8_t *)(corr + pairs * 16);
    a8_lay_out_pairs(fmt, qa, pairs, ap, corr);
#endif
    int failed = 0;
#if defined(A8_PAIRS)
    int a8_two_rows = switched_on("INFER_A8_TWO_ROWS");
#endif
    row_blocks rb = share_row_blocks(n, threads);
    if (!rb.ranges) {
        free(buf);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *wide = (float *)malloc((size_t)(2 * groups + 2 * runs) * sizeof(float)); /* scales, mins, cw (2 rows) */
        if (!wide) {
#pragma omp atomic write
            failed = 1;
        }
        work_walk walk = work_start(rb.ranges, rb.nr, rb.items, rb.balance);
        for (int64_t item; wide && (item = work_next(&walk)) >= 0;)
            for (int64_t r = 16 * item, r1 = r + 16 < n ? r + 16 : n; r < r1; r++) {
                const uint8_t *row = codes + r * row_bytes;
                float *cw = wide + 2 * groups;
#if defined(A8_PAIRS)
                if (per == 1 && sdtype == F16) { /* (Q4_0, Q4_1, Q8_0, Q5_0, int4 in 32s) 16 runs' factors a vector */
                    int two = r + 1 < r1 && a8_two_rows; /* rows two at a time (INFER_A8_TWO_ROWS=0: one) */
                    __m512 macc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* the mins' part, beside the codes' */
                    for (int j = 0; j <= two; j++) {
                        const uint16_t *s16 = (const uint16_t *)scales + (r + j) * groups;
                        const uint16_t *m16 = mins ? (const uint16_t *)mins + (r + j) * groups : NULL;
                        float *cwj = cw + j * runs;
                        for (int64_t g = 0; g < runs; g += 16) {
                            __mmask16 m = runs - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (runs - g)) - 1);
                            _mm512_mask_storeu_ps(cwj + g, m, _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s16 + g)),
                                                                            _mm512_maskz_loadu_ps(m, d + g)));
                            if (mins)
                                macc[j] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, m16 + g)),
                                                          _mm512_maskz_loadu_ps(m, xsum + g), macc[j]);
                        }
                    }
                    float v[2];
                    if (two) a8_rows2(fmt, row, row_bytes, ap, corr, cw, cw + runs, pairs, macc[0], macc[1], v);
                    else v[0] = a8_row(fmt, row, ap, corr, cw, pairs, macc[0]);
                    for (int j = 0; j <= two; j++) {
                        float vj = v[j] + a8_runs_plain(fmt, row + j * row_bytes, qa, cw + j * runs, 2 * pairs, runs);
                        store_scalar(dtype, y, r + j, bias ? vj + load_scalar(dtype, bias, r + j) : vj);
                    }
                    r += two;
                    continue;
                }
#endif
                scale_row rs = scale_row_of(sdtype, scales, r, groups, k);
                const float *sw = sdtype == F32 ? (const float *)rs.p
                                  : (const float *)(sdtype == F16 ? widen_scale_row(rs, groups, wide)
                                                                  : expand_scale_row(rs, groups, wide)).p;
                if (per == 1)
                    for (int64_t rr = 0; rr < runs; rr++) cw[rr] = d[rr] * sw[rr];
                else
                    for (int64_t g = 0; g < groups; g++)
                        for (int64_t j = g * per; j < (g + 1) * per; j++) cw[j] = d[j] * sw[g];
                float v;
#if defined(A8_PAIRS)
                v = a8_row(fmt, row, ap, corr, cw, pairs, _mm512_setzero_ps()) + a8_runs_plain(fmt, row, qa, cw, 2 * pairs, runs);
#elif defined(__AVX2__) && defined(__FMA__)
                __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
                int64_t rr = 0;
                for (; rr + 2 <= runs; rr += 2) {
                    prefetch(row + rr * (fmt == Q4 ? 16 : 32) + PREFETCH_BYTES);
                    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a8_run_avx2(fmt, row, qa, rr)), _mm256_set1_ps(cw[rr]), acc0);
                    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a8_run_avx2(fmt, row, qa, rr + 1)), _mm256_set1_ps(cw[rr + 1]),
                                           acc1);
                }
                if (rr < runs)
                    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a8_run_avx2(fmt, row, qa, rr)), _mm256_set1_ps(cw[rr]), acc0);
                v = hsum8(_mm256_add_ps(acc0, acc1));
#else
                v = a8_runs_plain(fmt, row, qa, cw, 0, runs);
#endif
                if (mins) {
                    scale_row rm = scale_row_of(sdtype, mins, r, groups, k);
                    const float *mw = sdtype == F32 ? (const float *)rm.p
                                      : (const float *)(sdtype == F16 ? widen_scale_row(rm, groups, wide + groups)
                                                                      : expand_scale_row(rm, groups, wide + groups)).p;
                    v += a8_dot(mw, xsum, groups);
                }
                store_scalar(dtype, y, r, bias ? v + load_scalar(dtype, bias, r) : v);
            }
        free(wide);
    }
    free(rb.ranges);
    free(buf);
    return failed ? -1 : 0;
}

/* The dense `[n, k]` weight in `dtype`: scale * q (+ min) in fp32 (two roundings, as infer/quant_weights.py's
 * dequantize), rounded once to dtype. For multi-row products through the GEMM. Returns -2 on a bad shape. */
#if defined(HAVE_AVX512)
/* 16 fp32 values stored as fp32 or bf16, rounded as store_scalar rounds (nearest even, NaN kept quiet). */
static inline void store16(int dtype, void *out, int64_t i, __m512 v) {
    if (dtype == F32) {
        _mm512_storeu_ps((float *)out + i, v);
        return;
    }
    __m512i u = _mm512_castps_si512(v), high = _mm512_srli_epi32(u, 16);
    __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(r));
}
#endif

/* The dense `[n, k]` weight in `dtype`: scale * q (+ min) in fp32 (two roundings, as infer/quant_weights.py's
 * dequantize), rounded once to dtype. For multi-row products through the GEMM: 16 weights a vector where the
 * build has AVX512 and dtype is fp32 or bf16 (the prefill of a quantized model waits on it), else one at a time.
 * Returns -2 on a bad shape. */
/* One row of `k` codes dequantized into `out` (`dtype`): scale * q (+ min) in fp32, rounded once. */
static void dequant_row(int fmt, const uint8_t *codes, scale_row rs, scale_row rm, int has_mins, int dtype, void *out,
                        int64_t k, int64_t group) {
    int64_t run_bytes = fmt == Q8 ? QCHUNK : QCHUNK / 2;
#if defined(HAVE_AVX512)
    if (dtype != F16) {
        for (int64_t i = 0; i < k; i += QCHUNK) {
            __m512 w[2];
            qcodes(fmt, codes + i / QCHUNK * run_bytes, w);
            for (int v = 0; v < 2; v++) { /* a vector's 16 codes share a group (groups are 16 or whole runs) */
                int64_t g = (i + 16 * v) / group;
                __m512 s = _mm512_set1_ps(scale_at(rs, g));
                __m512 lo = _mm512_set1_ps(has_mins ? scale_at(rm, g) : 0.f);
                __m512 x = _mm512_mul_ps(s, w[v]);
                if (has_mins) x = _mm512_add_ps(x, lo);
                store16(dtype, out, i + 16 * v, x);
            }
        }
        return;
    }
#endif
    float w[QCHUNK];
    for (int64_t i = 0; i < k; i += QCHUNK) {
        codes_chunk(fmt, codes + i / QCHUNK * run_bytes, w);
        for (int t = 0; t < QCHUNK; t++) {
            int64_t g = (i + t) / group;
            float s = scale_at(rs, g), lo = has_mins ? scale_at(rm, g) : 0.f;
            float v = s * w[t];
            if (has_mins) v = v + lo;
            store_scalar(dtype, out, i + t, v);
        }
    }
}

int infer_qdequant(int fmt, const uint8_t *codes, int sdtype, const void *scales, const void *mins, int dtype,
                   void *out, int64_t n, int64_t k, int64_t group, int threads) {
    if (fmt == Q6) fmt = Q8;
    if (!qshape_ok(fmt, k, group) || (sdtype == FK && k % 256)) return -2;
    int64_t groups = k / group, row_bytes = fmt == Q8 ? k : k / 2, esize = dtype == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < n; r++)
        dequant_row(fmt, codes + r * row_bytes, scale_row_of(sdtype, scales, r, groups, k),
                    scale_row_of(sdtype, mins, r, groups, k), mins != NULL, dtype, (char *)out + r * k * esize, k,
                    group);
    return 0;
}

#if defined(HAVE_DOT_BF16)
/* dequant_row into bf16 for the tile kernel: the same products and sums (scale * q, then + min: two roundings in
 * fp32), rounded to bf16 by the conversion instruction, 32 values at a time (it rounds to nearest even as
 * store16 does; only fp32 denormals, far below any weight's magnitude, would differ: it flushes them). */
static void dequant_row_bf16(int fmt, const uint8_t *codes, scale_row rs, scale_row rm, int has_mins, uint16_t *out,
                             int64_t k, int64_t group) {
    int64_t run_bytes = fmt == Q8 ? QCHUNK : QCHUNK / 2;
    for (int64_t i = 0; i < k; i += QCHUNK) {
        __m512 w[2];
        qcodes(fmt, codes + i / QCHUNK * run_bytes, w);
        int64_t g0 = i / group, g1 = (i + 16) / group; /* the same group unless groups are 16 (Q6_K) */
        __m512 lo = _mm512_mul_ps(_mm512_set1_ps(scale_at(rs, g0)), w[0]);
        __m512 hi = _mm512_mul_ps(_mm512_set1_ps(scale_at(rs, g1)), w[1]);
        if (has_mins) {
            lo = _mm512_add_ps(lo, _mm512_set1_ps(scale_at(rm, g0)));
            hi = _mm512_add_ps(hi, _mm512_set1_ps(scale_at(rm, g1)));
        }
        _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}
#endif

/* y = x W^T (+ bias) for a few bf16 rows x `[m, k]` and quantized W (the batched engine's decode steps): each
 * tile of 4 weight rows is dequantized once into a bf16 buffer the thread keeps in cache (the numbers the
 * dequantize-then-GEMM path multiplies: scale * q (+ min) rounded once to bf16), then multiplied as
 * infer_gemm_bf16's tiles are; the weight is never written out whole. Returns -2 on a bad shape or a build without
 * the bf16 pair instruction, -1 without memory (nothing written). */
int infer_qgemm_bf16(int fmt, const uint8_t *codes, int sdtype, const void *scales, const void *mins,
                     const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n, int64_t k,
                     int64_t group, int threads) {
#if defined(HAVE_DOT_BF16)
    if (fmt == Q6) fmt = Q8;
    if (!qshape_ok(fmt, k, group) || (sdtype == FK && k % 256)) return -2;
    if (m <= 0 || n <= 0) return 0;
    int64_t groups = k / group, row_bytes = fmt == Q8 ? k : k / 2;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t first, last;
        thread_rows(n, &first, &last);
        uint16_t *tile = (uint16_t *)malloc((size_t)(4 * k) * sizeof(uint16_t));
        if (!tile) {
            last = first;
#pragma omp atomic write
            failed = 1;
        }
        int64_t lines = 4 * row_bytes / 64, iters = ((m + 3) / 4) * ((k + 31) / 32);
        int64_t per_iter = (lines + iters - 1) / iters;
        for (int64_t t = first; t < last; t += 4) {
            int rows = last - t < 4 ? (int)(last - t) : 4;
            const uint16_t *wr[4];
            for (int a = 0; a < 4; a++) {
                int64_t r = t + a;
                wr[a] = tile + (a < rows ? a : rows - 1) * k; /* spare lanes repeat a row */
                if (a < rows)
                    dequant_row_bf16(fmt, codes + r * row_bytes, scale_row_of(sdtype, scales, r, groups, k),
                                     scale_row_of(sdtype, mins, r, groups, k), mins != NULL, tile + a * k, k, group);
            }
            const char *pf = (const char *)(codes + (t + 8) * row_bytes);
            const char *pf_end = (const char *)(codes + (last < t + 12 ? last : t + 12) * row_bytes);
            gemm_tile_bf16(wr, rows, x, bias, y, m, n, k, t, pf, pf_end, per_iter);
        }
        free(tile);
    }
    return failed ? -1 : 0;
#else
    (void)fmt, (void)codes, (void)sdtype, (void)scales, (void)mins, (void)x, (void)bias, (void)y, (void)m, (void)n;
    (void)k, (void)group, (void)threads;
    return -2;
#endif
}

/* ---- the packed product on quantized weights: the batched engine's steps on a quantized model ----
 * The codes laid out as infer_pack_bf16 lays out a bf16 weight (infer/quant_weights.py's pack_for_packed_product:
 * blocks of 16 rows, each row's pairs of inputs interleaved, C[b][p][l][e] = q[16b + l][2p + e], zero rows filling the
 * last block; q4: pairs 2j and 2j + 1 of a block share 32 bytes, as low and high nibbles), the scales (and mins) as
 * float32 [blocks][groups][16]. Each pair of blocks is dequantized once into a bf16 buffer the thread keeps in cache,
 * in infer_pack_bf16's layout: scale * q (+ min) in fp32, rounded once (dequantize(bf16)'s numbers, as
 * dequant_row_bf16's), then multiplied by every row of x as infer_gemm_bf16_packed multiplies its blocks: bit for bit
 * infer_gemm_bf16_packed on the dequantized weight packed, at a quarter (q8) or an eighth (q4) of the weight's bytes
 * plus the dequantizing (once per block, whatever the rows). */
#if defined(HAVE_DOT_BF16)
/* One block's `pairs` pairs of codes into `out` (32 bf16 values a pair: 16 rows' pair, side by side). A q4 code's
 * scale * q + min takes one fused multiply-add, the same number as a multiply and an add: every q4 scale has at most
 * 20 significant bits (float16's 11; Q4_K's d * sc 17; pack_codes refuses others) and q at most 4, so scale * q is
 * exact in fp32 and only the sum rounds. With its two nibbles taken from one widened dword (2 widenings for 64
 * codes, not 4), a 16-row block of q4 codes at k = 768 dequantized in 600 ns against 800 on a 2-core Zen 4 EPYC
 * (a multiply, an add and 4 widenings: 15 cycles a 64 codes, where 16 rows' tiles take 32 pair instructions). */
/* A group's 16 per-row values (scales or mins) as a pair's lanes take them: rows 0-7 (`lo`) and 8-15 (`hi`), each
 * twice. */
static inline void rows_twice(__m512 v, __m512 *lo, __m512 *hi) {
    *lo = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), v);
    *hi = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), v);
}

/* Pairs q and q + 1 of a block's q4 codes (`c` at the block) as bf16 weights w[0], w[1]: scale * q (+ min) with
 * `s_lo`/`s_hi` (`z_lo`/`z_hi`) the group's scales (mins) of rows 0-7 and 8-15, each twice. */
static inline __attribute__((always_inline)) void q4_pairs(int with_mins, const uint8_t *c, int64_t q, __m512 s_lo,
                                                           __m512 s_hi, __m512 z_lo, __m512 z_hi, __m512bh w[2]) {
    /* bytes 0-15, 16-31 widened once: each a dword holding pair q's code and pair q + 1's */
    const __m512i low = _mm512_set1_epi32(0x0f);
    __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * q)));
    __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * q + 16)));
    __m512 v[4] = {_mm512_cvtepi32_ps(_mm512_and_si512(d0, low)), _mm512_cvtepi32_ps(_mm512_and_si512(d1, low)),
                   _mm512_cvtepi32_ps(_mm512_srli_epi32(d0, 4)), _mm512_cvtepi32_ps(_mm512_srli_epi32(d1, 4))};
    for (int p = 0; p < 2; p++) { /* pair q + p: rows 0-7 then 8-15 */
        if (with_mins) /* scale * q + min in one rounding: scale * q is exact (see above) */
            w[p] = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(s_hi, v[2 * p + 1], z_hi), _mm512_fmadd_ps(s_lo, v[2 * p], z_lo));
        else
            w[p] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(s_hi, v[2 * p + 1]), _mm512_mul_ps(s_lo, v[2 * p]));
    }
}

static void dequant_block_packed(int fmt, const uint8_t *codes, const float *scales, const float *mins, uint16_t *out,
                                 int64_t pairs, int64_t group) {
    int64_t per_group = group / 2; /* pairs a group (8 or more, even) */
    for (int64_t g = 0; g < pairs / per_group; g++) {
        __m512 s = _mm512_loadu_ps(scales + 16 * g), z = mins ? _mm512_loadu_ps(mins + 16 * g) : _mm512_setzero_ps();
        __m512 s_lo, s_hi, z_lo, z_hi;
        rows_twice(s, &s_lo, &s_hi);
        rows_twice(z, &z_lo, &z_hi);
        for (int64_t q = g * per_group; q < (g + 1) * per_group; q += 2) { /* two pairs: 64 codes */
            __m512bh w[2];
            if (fmt == Q8) {
                __m512 v[4];
                for (int p = 0; p < 4; p++)
                    v[p] = _mm512_cvtepi32_ps(
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 32 * q + 16 * p))));
                for (int p = 0; p < 2; p++) /* pair q + p: rows 0-7 then 8-15 */
                    w[p] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(s_hi, v[2 * p + 1]), _mm512_mul_ps(s_lo, v[2 * p]));
            } else if (mins) {
                q4_pairs(1, codes, q, s_lo, s_hi, z_lo, z_hi, w);
            } else {
                q4_pairs(0, codes, q, s_lo, s_hi, z_lo, z_hi, w);
            }
            _mm512_storeu_si512(out + 32 * q, (__m512i)w[0]);
            _mm512_storeu_si512(out + 32 * (q + 1), (__m512i)w[1]);
        }
    }
}

/* The codes form of q8 codes (AVX512-BF16 without AMX; INFER_PACKED_CODE_SUMS=0 the dequantizing above): no weight
 * rounded to bf16. An int8 code is exact as a bf16 (8 significant bits), so each tile widens two pairs of inputs of
 * each block's codes into bf16 operands in registers (a sign extension and a conversion for 16 codes, one pack for
 * 32) and sums each group's code * x products by the pair instruction; each group's sum is scaled into the row's
 * total in group order by one fused multiply-add (the first group's by a multiply), then the bias, rounded once to
 * bf16: scale * sum q x, infer_qgemv's sum. The dequantizing path wrote each pair of blocks as bf16 (48 KiB at
 * k = 768: past L1) and read it back in every tile; at 16 rows of a 150M Llama's int8 products (per output channel)
 * on a 2-core Zen 4 EPYC this form ran 1.17-1.30x its speed, at 4 rows 1.36x. Past CODE_TILES_IN_REGISTERS tiles of
 * rows the widening in every tile costs more than a buffer: the codes are widened once into it (as the dequantizing
 * path's, without its multiplies) and every tile reads them there (64 rows: level with the dequantizing path, 0.94x
 * widening in every tile). A tile is 8 rows by 2 blocks, as packed_tile_bf16's; codes in groups (GGUF's Q8_0, Q6_K)
 * keep their totals in L1 (16 more registers would spill the sums), touched once a group. x comes pair-major per
 * tile (pair_major): read by row, its 8 row pointers took the registers the loop needed, and gcc parked them
 * in vector registers, a move a row a pair. q4 codes stay with the dequantizing path: their mins' term (each
 * group's min times x's group sum, fp32 lanes and a broadcast each) took ~10% of a tile, where the dequantizing folds
 * each min into its weights once a block; the form ran 1.03-1.06x at 16 rows, 0.80-0.86x at 64. */
/* Whether the codes form takes codes of format `fmt` at inner size k: q8 codes (Q6_K's are q8 codes),
 * INFER_PACKED_CODE_SUMS not 0, k not on AMX tiles (they take the dequantized buffer). */
static int code_sums_take(int fmt, int64_t k) {
    return (fmt == Q8 || fmt == Q6) && switched_on("INFER_PACKED_CODE_SUMS") && !infer_amx_takes(k);
}

#define CODE_ROWS PACK_ROWS /* (packed_tile_bf16's rows: the prefetch's share a pair is counted over its tiles) */
#define CODE_TILES_IN_REGISTERS 2
#define CODE_TALL_ROWS 16

/* Whether m rows take one tall tile of up to CODE_TALL_ROWS rows by one block (codes_pass_as) instead of tiles of
 * CODE_ROWS rows by PACK_BLOCKS blocks: 9-16 rows, INFER_CODES_TALL not 0. Two tiles widened each block's codes
 * twice; the tall tile widens them once (and broadcasts each row's x once a block instead of once a pair of blocks).
 * The same operations on each sum in the same order: the same bits. The 12 layers' int8 products of a 150M Llama on
 * a 2-core Zen 4, alternating in one process (the host noisy): 9 rows 1.15x, 10 1.11x, 12 1.04-1.10x. At 13-16 rows
 * it was level at first (16 rows 0.97-1.03x by medians, the LM head's shape 0.95x), so those kept the two tiles; on
 * 2026-12-04 (the 40 products of those shapes from DRAM, alternating in one process; an int8 LM head per 32 inputs,
 * 32768 x 768) the tall tile ran 13 rows 1.11x / 1.12x, 14 1.08x / 1.06x, 16 1.06x / 1.07x, and the engine's int8
 * decode steps at 16 requests 1.05x: 9-16 rows take it (q4's codes form had shown one tile of 16 rows by a block at
 * least level with 8-row tiles). */
static int codes_tall_takes(int64_t m) {
    return m > CODE_ROWS && m <= CODE_TALL_ROWS && switched_on("INFER_CODES_TALL");
}

/* Pairs q and q + 1 of a block's q8 codes (`c` at the block, the pairs form: pair q's 16 rows' two codes side by
 * side in 32 bytes) as exact bf16 operands, w[v] pair q + v's. */
static inline __attribute__((always_inline)) void code_pairs(const uint8_t *c, int64_t q, __m512bh w[2]) {
    for (int v = 0; v < 2; v++) {
        const uint8_t *p = c + 32 * (q + v);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        w[v] = _mm512_cvtne2ps_pbh(hi, lo);
    }
}

/* One block's codes as exact bf16 operands into `out` (infer_pack_bf16's layout, as dequant_block_packed's). */
static void codes_block_bf16(const uint8_t *codes, uint16_t *out, int64_t pairs) {
    for (int64_t q = 0; q < pairs; q += 2) {
        __m512bh w[2];
        code_pairs(codes, q, w);
        _mm512_storeu_si512(out + 32 * q, (__m512i)w[0]);
        _mm512_storeu_si512(out + 32 * (q + 1), (__m512i)w[1]);
    }
}

/* This calling thread's buffer for x pair-major, `len` int32s (kept, as widened_rows' AVX2 buffer: a prompt chunk's
 * 2048 rows of k = 3072 are 12 MiB, mapped and faulted afresh on every call otherwise); NULL without memory. */
static int32_t *pair_major_buffer(int64_t len) {
    static _Thread_local int32_t *kept = NULL;
    static _Thread_local int64_t kept_len = 0;
    if (len > kept_len) {
        int32_t *grown = (int32_t *)realloc(kept, (size_t)len * sizeof(int32_t));
        if (!grown) return NULL;
        kept = grown;
        kept_len = len;
    }
    return kept;
}

/* Pairs q0 .. q1 - 1 (multiples of 16) of x [m, k]'s rows, in the tiles of at most `rows` that codes_pass splits
 * them into, each tile pair-major: the tile of rows j0 .. j0 + mr - 1 at out + j0 * k / 2, its row j0 + j's pair q at
 * [q * mr + j]. With `sums` (q4's codes form: one tile, m <= 16) also each row's sum over each group of `group`
 * inputs among them, in fp32: each pair's two inputs added, then the pairs in order; row j's group g at
 * sums[g * m + j]. Pairs q0 .. q1 - 1 must then be whole groups. */
static void pair_major_plain(const uint16_t *x, int64_t m, int64_t k, int rows, int64_t q0, int64_t q1,
                             int32_t *out, int64_t group, float *sums) {
    int64_t tiles = (m + rows - 1) / rows, pairs = k / 2;
    for (int64_t t = 0, j0 = 0; t < tiles; t++) {
        int64_t mr = m / tiles + (t < m % tiles);
        int32_t *o = out + j0 * pairs;
        const uint16_t *x0 = x + j0 * k;
        for (int64_t q = q0; q < q1; q++)
            for (int64_t j = 0; j < mr; j++) memcpy(o + q * mr + j, x0 + j * k + 2 * q, 4);
        j0 += mr;
    }
    for (int64_t g = 2 * q0 / group; sums && g < 2 * q1 / group; g++)
        for (int64_t j = 0; j < m; j++) {
            float s = 0.f;
            for (int64_t i = g * group; i < (g + 1) * group; i += 2)
                s += bf16_to_f32(x[j * k + i]) + bf16_to_f32(x[j * k + i + 1]);
            sums[g * m + j] = s;
        }
}

/* 16 vectors of 16 int32 transposed in place: r[i]'s lane j becomes r[j]'s lane i. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each r[i] now holds, in its 128-bit lane l, rows 4 (i / 4) .. + 3's inputs 4 l + i % 4: gather the lanes */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* pair_major_plain's layout and sums (the same bits), 16 pairs of up to 16 rows a time: each row's 16 pairs one
 * 64-byte load, transposed in registers, each pair's rows one masked store; the group sums added in the transposed
 * registers, a lane a row (a scalar copy a pair and row, and a horizontal sum a group and row, had cost a 16-row q4
 * product of k = 1536 and 64 outputs a fifth of its time). INFER_PAIRS_IN_REGISTERS=0: pair_major_plain. */
static void pair_major(const uint16_t *x, int64_t m, int64_t k, int rows, int64_t q0, int64_t q1, int32_t *out,
                       int64_t group, float *sums) {
    if (!switched_on("INFER_PAIRS_IN_REGISTERS")) {
        pair_major_plain(x, m, k, rows, q0, q1, out, group, sums);
        return;
    }
    int64_t tiles = (m + rows - 1) / rows, pairs = k / 2, blocks_a_group = sums ? group / 32 : 1;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t t = 0, j0 = 0; t < tiles; t++) {
        int mr = (int)(m / tiles + (t < m % tiles));
        __mmask16 lanes = (__mmask16)((1u << mr) - 1);
        int32_t *o = out + j0 * pairs;
        const int32_t *x0 = (const int32_t *)x + j0 * pairs;
        __m512 s = _mm512_setzero_ps();
        for (int64_t q = q0, block = 0; q < q1; q += 16, block++) {
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = j < mr ? _mm512_loadu_si512((const void *)(x0 + j * pairs + q)) : _mm512_setzero_si512();
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_mask_storeu_epi32(o + (q + i) * mr, lanes, r[i]);
            if (!sums) continue;
            for (int i = 0; i < 16; i++) /* lane j: row j's pair q + i, its two inputs added */
                s = _mm512_add_ps(s, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(r[i], 16)),
                                                   _mm512_castsi512_ps(_mm512_and_si512(r[i], high))));
            if ((block + 1) % blocks_a_group == 0) {
                _mm512_mask_storeu_ps(sums + ((2 * q + 32) / group - 1) * m, lanes, s);
                s = _mm512_setzero_ps();
            }
        }
        j0 += mr;
    }
}

/* A tile's rows (`xt`: their pairs, pair-major) against `bk` blocks' q8 codes (PACK_BLOCKS, or 1: the tall tile;
 * `codes` at the first, nb of them, block_bytes apart; spare block lanes repeat block 0) and their scales
 * [nb][groups][16]: into y's columns c .. c + 16 nb - 1 (+ bias), masked past n. The codes widened here, or read
 * widened from `pb` (codes_block_bf16's, the blocks pairs * 32 values apart) where given. `pf` .. `pf_end` prefetched meanwhile, `per_iter` lines a pair
 * (the first pairs, that prefetch, a loop of their own, as packed_tile_bf16's). */
static inline __attribute__((always_inline)) void codes_tile(int mr, int bk, int one_group, const uint8_t *codes,
                                                             const uint16_t *pb, int64_t block_bytes, int64_t pairs,
                                                             int64_t group, const float *scales, const int32_t *xt,
                                                             const uint16_t *bias, uint16_t *y, int64_t n, int64_t c,
                                                             int nb, const char *pf, const char *pf_end,
                                                             int64_t per_iter) {
    int64_t per_group = one_group ? pairs : group / 2, groups = pairs / per_group;
    __m512 acc[PACK_BLOCKS][CODE_TALL_ROWS], tot[PACK_BLOCKS][CODE_TALL_ROWS];
    float held[PACK_BLOCKS][CODE_TALL_ROWS][16] __attribute__((aligned(64))); /* grouped codes' totals */
    const uint8_t *c1 = codes + (nb > 1 ? block_bytes : 0);
    const uint16_t *pb1 = pb ? pb + (nb > 1 ? pairs * 32 : 0) : NULL;
    int64_t lines = pf < pf_end ? (pf_end - pf + 63) / 64 : 0;
    int64_t ahead = 2 * ((lines + 2 * per_iter - 1) / (2 * per_iter));
#define CODE_PAIRS(q)                                                                  \
    do {                                                                               \
        __m512bh w0[2], w1[2];                                                         \
        if (pb) {                                                                      \
            for (int v = 0; v < 2; v++) {                                              \
                w0[v] = (__m512bh)_mm512_loadu_si512(pb + ((q) + v) * 32);             \
                if (bk > 1) w1[v] = (__m512bh)_mm512_loadu_si512(pb1 + ((q) + v) * 32); \
            }                                                                          \
        } else {                                                                       \
            code_pairs(codes, q, w0);                                                  \
            if (bk > 1) code_pairs(c1, q, w1);                                         \
        }                                                                              \
        for (int v = 0; v < 2; v++)                                                    \
            for (int j = 0; j < mr; j++) {                                             \
                __m512bh xv = (__m512bh)_mm512_set1_epi32(xt[((q) + v) * mr + j]);     \
                acc[0][j] = _mm512_dpbf16_ps(acc[0][j], w0[v], xv);                    \
                if (bk > 1) acc[1][j] = _mm512_dpbf16_ps(acc[1][j], w1[v], xv);        \
            }                                                                          \
    } while (0)
    for (int64_t g = 0; g < groups; g++) {
        for (int a = 0; a < bk; a++)
            for (int j = 0; j < mr; j++) acc[a][j] = _mm512_setzero_ps();
        int64_t q = g * per_group, q1 = q + per_group;
        for (; q < q1 && q < ahead; q += 2) {
            for (int64_t t = 0; t < 2 * per_iter && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
            CODE_PAIRS(q);
        }
        for (; q < q1; q += 2) CODE_PAIRS(q);
        for (int a = 0; a < bk; a++) {
            __m512 s = _mm512_loadu_ps(scales + ((a < nb ? a : 0) * groups + g) * 16);
            for (int j = 0; j < mr; j++) {
                if (one_group) {
                    tot[a][j] = _mm512_mul_ps(acc[a][j], s);
                    continue;
                }
                __m512 t = g ? _mm512_fmadd_ps(acc[a][j], s, _mm512_load_ps(held[a][j])) : _mm512_mul_ps(acc[a][j], s);
                _mm512_store_ps(held[a][j], t);
            }
        }
        __asm__ volatile("" ::: "memory"); /* (the totals stay in memory between groups) */
    }
#undef CODE_PAIRS
    for (int a = 0; a < bk; a++)
        for (int j = 0; j < mr && !one_group; j++) tot[a][j] = _mm512_load_ps(held[a][j]);
    store_tile_bf16(mr, tot, nb, bias, y, n, c);
}

/* A pair of blocks' q8 codes against every tile of x (packed_pass's split of the rows and of the prefetching), or
 * (`tall`: codes_tall_takes, x laid out as one tile) against the tall tile a block; inlined for codes in one group
 * (int8 per output channel) and in several. */
static inline __attribute__((always_inline)) void codes_pass_as(int one_group, int tall, const uint8_t *codes,
                                                                const uint16_t *pb, int64_t block_bytes,
                                                                int64_t pairs, int64_t group, const float *scales,
                                                                const int32_t *xt, int64_t m, const uint16_t *bias,
                                                                uint16_t *y, int64_t n, int64_t b, int nb,
                                                                const char *pf, const char *pf_end, int64_t per_iter) {
    if (tall) { /* one tile of all m rows a block, each block's codes widened once */
        int64_t chunk = ((pf_end - pf + nb - 1) / nb + 63) / 64 * 64, groups = 2 * pairs / group;
        for (int a = 0; a < nb; a++) {
            const char *end = pf + chunk < pf_end ? pf + chunk : pf_end;
            const uint8_t *ca = codes + a * block_bytes;
            const float *sa = scales + a * groups * 16;
            switch (m) {
#define CODES_TALL(M)                                                                                         \
    case M:                                                                                                   \
        codes_tile(M, 1, one_group, ca, NULL, block_bytes, pairs, group, sa, xt, bias, y, n, 16 * (b + a), 1, \
                   pf, end, per_iter);                                                                        \
        break;
                CODES_TALL(9) CODES_TALL(10) CODES_TALL(11) CODES_TALL(12)
                CODES_TALL(13) CODES_TALL(14) CODES_TALL(15) CODES_TALL(16)
#undef CODES_TALL
            }
            pf = end;
        }
        return;
    }
    int64_t tiles = (m + CODE_ROWS - 1) / CODE_ROWS;
    int64_t chunk = ((pf_end - pf + tiles - 1) / tiles + 63) / 64 * 64;
    for (int64_t t = 0, j = 0; t < tiles; t++) {
        int mr = (int)(m / tiles + (t < m % tiles));
        const char *end = pf + chunk < pf_end ? pf + chunk : pf_end;
        switch (mr) {
#define CODES_TILE(M)                                                                                               \
    case M:                                                                                                         \
        codes_tile(M, PACK_BLOCKS, one_group, codes, pb, block_bytes, pairs, group, scales, xt + j * pairs, bias,   \
                   y + j * n, n, 16 * b, nb, pf, end, per_iter);                                                    \
        break;
            CODES_TILE(1) CODES_TILE(2) CODES_TILE(3) CODES_TILE(4)
            CODES_TILE(5) CODES_TILE(6) CODES_TILE(7) CODES_TILE(8)
#undef CODES_TILE
        }
        pf = end;
        j += mr;
    }
}

static void codes_pass(int tall, const uint8_t *codes, const uint16_t *pb, int64_t block_bytes, int64_t pairs,
                       int64_t group, const float *scales, const int32_t *xt, int64_t m, int64_t k,
                       const uint16_t *bias, uint16_t *y, int64_t n, int64_t b, int nb, const char *pf,
                       const char *pf_end, int64_t per_iter) {
    if (group == k)
        codes_pass_as(1, tall, codes, pb, block_bytes, pairs, group, scales, xt, m, bias, y, n, b, nb, pf, pf_end,
                      per_iter);
    else
        codes_pass_as(0, tall, codes, pb, block_bytes, pairs, group, scales, xt, m, bias, y, n, b, nb, pf, pf_end,
                      per_iter);
}

/* q4 codes (with mins: every q4 kind's) dequantized in the tile, up to one tile's rows (AVX512-BF16 without AMX;
 * INFER_Q4_IN_TILES=0 the buffer above): the tile computes each pair's weights from the codes in registers by the
 * buffer's own q4_pairs (the scale, the code and the min in one fused multiply-add, rounded once to bf16) and
 * multiplies them as packed_tile_bf16 multiplies the buffer's: the same weights, the same sums in the same
 * order, the same bits. x comes pair-major (pair_major), as the q8 codes form's: the tile's rows from one
 * pointer (read by row, a 16-row tile's row pointers spilled). At the 40 products of a 150M Llama's decode-step
 * shapes (q4 codes from DRAM) on a 2-core Zen 4 EPYC, alternating: 2 rows 1.2-1.3x, 6 rows 1.13-1.18x, 8 rows 1.10-1.14x, 4 rows level; the engine's decode steps
 * at 8 requests 1.03-1.08x, at 4 1.02-1.10x. Past one tile each tile would dequantize the pair again (two tiles of 8
 * at 16 rows: 0.86x), and a tall tile of 9-16 rows by one block, dequantizing once, ran level with the buffer: the
 * dequantizing's conversions and multiply-adds take the pipes the pair instructions need, so only where the tiles
 * leave them idle (few rows, weights streaming from DRAM) do they come free. */
static int q4_tiles_take(int64_t m, int64_t k) {
    return m <= PACK_ROWS && switched_on("INFER_Q4_IN_TILES") && !infer_amx_takes(k); /* (AMX: the buffer) */
}

/* A tile of mr rows of x against a pair of blocks of q4 codes (`codes` at the first, nb of them, block_bytes apart;
 * spare block lanes repeat block 0; scales and mins [nb][groups][16]), into y's columns c .. c + 16 nb - 1 (+ bias),
 * masked past n; `pf` .. `pf_end` prefetched meanwhile, `per_iter` lines a pair. */
static inline __attribute__((always_inline)) void q4_tile(int mr, const uint8_t *codes,
                                                          int64_t block_bytes, int64_t pairs, int64_t group,
                                                          const float *scales, const float *mins, const int32_t *xt,
                                                          const uint16_t *bias, uint16_t *y, int64_t n,
                                                          int64_t c, int nb, const char *pf, const char *pf_end,
                                                          int64_t per_iter) {
    int64_t per_group = group / 2, groups = pairs / per_group;
    __m512 acc[PACK_BLOCKS][PACK_ROWS];
    for (int a = 0; a < PACK_BLOCKS; a++)
        for (int j = 0; j < mr; j++) acc[a][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 s_lo[PACK_BLOCKS], s_hi[PACK_BLOCKS], z_lo[PACK_BLOCKS], z_hi[PACK_BLOCKS];
        for (int a = 0; a < PACK_BLOCKS; a++) {
            int64_t at = ((a < nb ? a : 0) * groups + g) * 16;
            rows_twice(_mm512_loadu_ps(scales + at), &s_lo[a], &s_hi[a]);
            rows_twice(_mm512_loadu_ps(mins + at), &z_lo[a], &z_hi[a]);
        }
        for (int64_t q = g * per_group; q < (g + 1) * per_group; q += 2) {
            for (int64_t t = 0; t < 2 * per_iter && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
            __m512bh w[PACK_BLOCKS][2];
            for (int a = 0; a < PACK_BLOCKS; a++)
                q4_pairs(1, codes + (a < nb ? a : 0) * block_bytes, q, s_lo[a], s_hi[a], z_lo[a], z_hi[a], w[a]);
            for (int v = 0; v < 2; v++)
                for (int j = 0; j < mr; j++) {
                    __m512bh xv = (__m512bh)_mm512_set1_epi32(xt[(q + v) * mr + j]);
                    for (int a = 0; a < PACK_BLOCKS; a++) acc[a][j] = _mm512_dpbf16_ps(acc[a][j], w[a][v], xv);
                }
        }
    }
    store_tile_bf16(mr, acc, nb, bias, y, n, c);
}

/* One tile of all m rows (m <= PACK_ROWS) against a pair of blocks of q4 codes. */
static void q4_pass(const uint8_t *codes, int64_t block_bytes, int64_t pairs, int64_t group, const float *scales,
                    const float *mins, const int32_t *xt, int64_t m, const uint16_t *bias, uint16_t *y, int64_t n,
                    int64_t b, int nb, const char *pf, const char *pf_end, int64_t per_iter) {
    switch (m) {
#define Q4_TILE(M)                                                                                                   \
    case M:                                                                                                          \
        q4_tile(M, codes, block_bytes, pairs, group, scales, mins, xt, bias, y, n, 16 * b, nb, pf, pf_end, per_iter); \
        break;
        Q4_TILE(1) Q4_TILE(2) Q4_TILE(3) Q4_TILE(4) Q4_TILE(5) Q4_TILE(6) Q4_TILE(7) Q4_TILE(8)
#undef Q4_TILE
    }
}

/* The codes form of q4 codes, up to Q4_CODE_ROWS rows of x (AVX512-BF16 without AMX; INFER_Q4_CODES=0: the tiles
 * above up to 8 rows, the buffer past them): no weight rounded to bf16, no fp32 work a weight. A q4 code becomes an
 * exact bf16 operand by integer operations alone: 1 + q / 16 is 0x3f80 | q << 3 (the code in the mantissa's top 4
 * bits; the high nibble shifted right by one, the low one left by 3, each masked and set in one ternary-logic
 * operation), so each group's sums are sum (1 + q / 16) x = X + sum q x / 16, X x's sum over the group, and each
 * row's total is sum over groups of 16 s (that sum) + (min - 16 s) X: scale * q + min against x, in group order, two
 * fused multiply-adds a group and row (X per row and group, in fp32, summed once a call before the tiles). The
 * dequantizing took four conversions, two multiply-adds and a rounding on the multiply pipes for each 32 weights, as
 * many as 16 rows' pair instructions take a third of; the codes form's two multiply-adds a group of 32 are an eighth,
 * and its byte widening, shifts and masks run beside the pair instructions. The offset (1 of every 1 + q / 16) keeps
 * each sum's terms within 16 + 15 of |s| |x| (1 + q / 128, one shift fewer, ran no faster and put 128 there). A tile
 * is up to 16 rows by one block, each block's codes widened once for all of them (two tiles of 8 rows, or 8 rows by
 * two blocks, widen each pair twice or broadcast x twice as often: level or slower); its totals stay in L1 between
 * groups. At the 40 products of a 150M Llama's decode-step shapes (q4 codes in groups of 32 from DRAM) on a 2-core
 * Zen 4 EPYC, against the tiles or the buffer: 2 rows 1.36x, 4 1.24x, 8 1.23x, 12 1.21x, 16 1.06x; from L2 at 16 rows
 * on one thread 1.13x (0.85x the bf16 packed product: the multiply-adds and widening left, 12.5% and ~5%); 24 and 48
 * rows 0.98x and 0.96x (the buffer's dequantizing amortized over the rows), so the codes form stops at 16. The engine's
 * decode steps of that model in int4 at 4 requests 1.24x, 8 1.12x, 16 1.07x. */
#define Q4_CODE_ROWS 16
static int q4_codes_take(int64_t m, int64_t k) {
    return m <= Q4_CODE_ROWS && switched_on("INFER_Q4_CODES") && !infer_amx_takes(k);
}

/* A tile of mr rows (`xt`: their pairs, pair-major; `xs`: their group sums, row j's group g at xs[g * mr + j])
 * against one block of q4 codes (`codes` at it; scales and mins [groups][16]), into y's columns c .. c + 15 (+ bias),
 * masked past n; `pf` .. `pf_end` prefetched meanwhile, `per_iter` lines a pair. */
static inline __attribute__((always_inline)) void q4_codes_tile(int mr, const uint8_t *codes, int64_t pairs,
                                                                int64_t group, const float *scales, const float *mins,
                                                                const int32_t *xt, const float *xs,
                                                                const uint16_t *bias, uint16_t *y, int64_t n,
                                                                int64_t c, const char *pf, const char *pf_end,
                                                                int64_t per_iter) {
    int64_t per_group = group / 2, groups = pairs / per_group;
    __m512 acc[Q4_CODE_ROWS], tot[1][Q4_CODE_ROWS];
    float held[Q4_CODE_ROWS][16] __attribute__((aligned(64))); /* the totals between groups */
    const __m512i field = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(0x3f80);
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < mr; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t q = g * per_group; q < (g + 1) * per_group; q += 2) { /* pairs q and q + 1: one 32-byte run */
            for (int64_t t = 0; t < 2 * per_iter && pf < pf_end; t++, pf += 64) __builtin_prefetch(pf, 0, 2);
            __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 16 * q)));
            /* (a | b) & c's table is 0xea: the masked field, with 1.0's exponent set */
            __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(b, 3), field, one, 0xea);
            __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 1), field, one, 0xea);
            for (int j = 0; j < mr; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], w0, (__m512bh)_mm512_set1_epi32(xt[q * mr + j]));
            for (int j = 0; j < mr; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], w1, (__m512bh)_mm512_set1_epi32(xt[(q + 1) * mr + j]));
        }
        __m512 s = _mm512_loadu_ps(scales + g * 16), z = _mm512_loadu_ps(mins + g * 16);
        __m512 s16 = _mm512_mul_ps(s, sixteen), offset = _mm512_fnmadd_ps(s, sixteen, z); /* 16 s exact; min - 16 s */
        for (int j = 0; j < mr; j++) {
            __m512 t = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs[g * mr + j]), _mm512_mul_ps(acc[j], s16));
            _mm512_store_ps(held[j], g ? _mm512_add_ps(_mm512_load_ps(held[j]), t) : t);
        }
        __asm__ volatile("" ::: "memory"); /* (the totals stay in memory between groups) */
    }
    for (int j = 0; j < mr; j++) tot[0][j] = _mm512_load_ps(held[j]);
    store_tile_bf16(mr, tot, 1, bias, y, n, c);
}

/* A pair of blocks of q4 codes (nb of them, block_bytes apart; scales and mins [nb][groups][16]) against all m rows
 * of x in one tile a block; `pf` .. `pf_end` shared out between the blocks. */
static void q4_codes_pass(const uint8_t *codes, int64_t block_bytes, int64_t pairs, int64_t group, const float *scales,
                          const float *mins, const int32_t *xt, const float *xs, int64_t m, const uint16_t *bias,
                          uint16_t *y, int64_t n, int64_t b, int nb, const char *pf, const char *pf_end,
                          int64_t per_iter) {
    int64_t groups = 2 * pairs / group;
    int64_t chunk = ((pf_end - pf + nb - 1) / nb + 63) / 64 * 64;
    for (int a = 0; a < nb; a++) {
        const char *end = pf + chunk < pf_end ? pf + chunk : pf_end;
        const uint8_t *ca = codes + a * block_bytes;
        const float *sa = scales + a * groups * 16, *za = mins + a * groups * 16;
        switch (m) {
#define Q4_CODES_TILE(M)                                                                                          \
    case M:                                                                                                     \
        q4_codes_tile(M, ca, pairs, group, sa, za, xt, xs, bias, y, n, 16 * (b + a), pf, end, per_iter);        \
        break;
            Q4_CODES_TILE(1) Q4_CODES_TILE(2) Q4_CODES_TILE(3) Q4_CODES_TILE(4)
            Q4_CODES_TILE(5) Q4_CODES_TILE(6) Q4_CODES_TILE(7) Q4_CODES_TILE(8)
            Q4_CODES_TILE(9) Q4_CODES_TILE(10) Q4_CODES_TILE(11) Q4_CODES_TILE(12)
            Q4_CODES_TILE(13) Q4_CODES_TILE(14) Q4_CODES_TILE(15) Q4_CODES_TILE(16)
#undef Q4_CODES_TILE
        }
        pf = end;
    }
}

#elif defined(HAVE_PACKED_BF16)
/* 16 values an operation computed rounded to bf16 as f32_to_bf16 rounds, a's 8 then b's, one pack for the two:
 * such a NaN is quiet (its top mantissa bit set), so rounding to nearest even keeps it a NaN without bf16x8_round's
 * check. */
static inline __m256i bf16x16_round_computed(__m256 a, __m256 b) {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    __m256i u = _mm256_castps_si256(a), v = _mm256_castps_si256(b);
    u = _mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    v = _mm256_add_epi32(v, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(v, 16), one)));
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_srli_epi32(u, 16), _mm256_srli_epi32(v, 16)), 0xd8);
}

/* The same on AVX2 (its packed product widens the bf16 buffer as it widens a packed bf16 weight), 8 values a
 * vector: a pair's 32 codes are rows 0-3, 4-7, 8-11 and 12-15, each row's two inputs side by side; the same
 * products and sums in fp32, rounded to bf16 as f32_to_bf16 rounds. Inlined for each format (and q4 with or
 * without mins): the per-vector branches on them had cost a tenth of the dequantizing. */
static inline __attribute__((always_inline)) void dequant_block_packed_as(int fmt, int with_mins, const uint8_t *codes,
                                                                          const float *scales, const float *mins,
                                                                          uint16_t *out, int64_t pairs, int64_t group) {
    const __m256i twice[2] = {_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)};
    int64_t per_group = group / 2; /* pairs a group (8 or more, even) */
    for (int64_t g = 0; g < pairs / per_group; g++) {
        __m256 s[4], z[4]; /* rows 4i .. 4i + 3's scales (mins), each twice */
        for (int i = 0; i < 4; i++) {
            s[i] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(scales + 16 * g + 8 * (i / 2)), twice[i % 2]);
            z[i] = with_mins ? _mm256_permutevar8x32_ps(_mm256_loadu_ps(mins + 16 * g + 8 * (i / 2)), twice[i % 2])
                             : _mm256_setzero_ps();
        }
        for (int64_t q = g * per_group; q < (g + 1) * per_group; q += 2) { /* two pairs: 64 codes */
            __m128i eight[8]; /* pair q + v / 4's codes of rows 4 (v % 4) .. 4 (v % 4) + 3 */
            if (fmt == Q8) {
                for (int v = 0; v < 8; v++) eight[v] = _mm_loadl_epi64((const __m128i *)(codes + 32 * q + 8 * v));
            } else { /* byte j: pair q's code j in its low nibble, pair q + 1's in its high one */
                __m256i a = _mm256_loadu_si256((const __m256i *)(codes + 16 * q)), low = _mm256_set1_epi8(0x0f);
                __m256i nib[2] = {_mm256_and_si256(a, low), _mm256_and_si256(_mm256_srli_epi16(a, 4), low)};
                for (int p = 0; p < 2; p++) {
                    __m128i first = _mm256_castsi256_si128(nib[p]), second = _mm256_extracti128_si256(nib[p], 1);
                    eight[4 * p] = first, eight[4 * p + 1] = _mm_srli_si128(first, 8);
                    eight[4 * p + 2] = second, eight[4 * p + 3] = _mm_srli_si128(second, 8);
                }
            }
            for (int v = 0; v < 8; v += 2) {
                __m256 w[2];
                for (int h = 0; h < 2; h++) {
                    w[h] = _mm256_cvtepi32_ps(fmt == Q8 ? _mm256_cvtepi8_epi32(eight[v + h])
                                                        : _mm256_cvtepu8_epi32(eight[v + h]));
                    w[h] = _mm256_mul_ps(s[(v + h) % 4], w[h]);
                    if (with_mins) w[h] = _mm256_add_ps(w[h], z[(v + h) % 4]);
                }
                _mm256_storeu_si256((__m256i *)(out + 32 * q + 8 * v), bf16x16_round_computed(w[0], w[1]));
            }
        }
    }
}

static void dequant_block_packed(int fmt, const uint8_t *codes, const float *scales, const float *mins, uint16_t *out,
                                 int64_t pairs, int64_t group) {
    if (fmt == Q8)
        dequant_block_packed_as(Q8, 0, codes, scales, NULL, out, pairs, group);
    else if (mins)
        dequant_block_packed_as(Q4, 1, codes, scales, mins, out, pairs, group);
    else
        dequant_block_packed_as(Q4, 0, codes, scales, NULL, out, pairs, group);
}
#endif

/* y [m, n] = x [m, k] W^T (+ bias) for quantized W laid out as above (fmt Q8 or Q4; mins NULL for q8); every thread a
 * contiguous range of blocks, as infer_gemm_bf16_packed, the next pair's codes prefetched into L2 while this pair runs.
 * fmt Q8C / Q4C (AVX2 builds): q8 / q4 codes, each block's codes input-major instead (q8: C[b][i][l] = q[16b + l][i];
 * q4: byte C[b][i][l] = q[16b + l][i] | q[16b + 8 + l][i] << 4: pack_codes' channel form), multiplied with no
 * dequantizing to bf16: q8 by channel_tile (each group's fp32 sum times its scale, summed over the groups), q4 by
 * channel_tile too up to Q4_SUMS_ROWS rows, past them by scaled_block (each weight scale * code in fp32, fused
 * multiply-adds over the row), then q4's each group's min times x's group sum, rounded once; the scales (mins)
 * float32 [blocks][groups][16].
 * Returns -2 on a bad shape or without the pair instruction, -1 without memory (nothing written). */
#if defined(HAVE_CHANNEL_CODES)
/* n float16 values at p widened into out (F16C's conversion, or f16_to_f32's: the same values). */
static void widen_halves(const uint16_t *p, float *out, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + i))));
#endif
    for (; i < n; i++) out[i] = f16_to_f32(p[i]);
}

/* AVX2's packed product on codes (infer_qgemm_packed's, and infer_qgemm_packed_f32's): rows x [m, k] in the dtype of
 * the sums `o` (bf16 rows widened to fp32 once per call, fp32 ones read as they are), each block dequantized into
 * bf16 pairs (the pairs form: bf16 rows alone) or multiplied as codes (the channel form). AVX512-BF16 builds take
 * fp32 rows of codes in the channel form alone (their bf16 rows take the pairs form on the pair instruction). */
static int codes_product_avx2(int fmt, const uint8_t *codes, const float *scales, const float *mins, const void *x,
                              sums_out o, int64_t m, int64_t n, int64_t k, int64_t group, int threads) {
    int half = fmt & HALF_SCALES; /* (float16 scales and mins, widened a block at a time below) */
    fmt &= ~HALF_SCALES;
    if (half && fmt != Q8C && fmt != Q4C) return -2;
    /* the channel form: codes the tiles read as they are, or (q4 past Q4_SUMS_ROWS rows) scaled a stretch at a time
     * (scaled_block) */
    int channels = fmt == Q8C || fmt == Q4C, q4 = fmt == Q4C;
    int scaled = q4 && (m > Q4_SUMS_ROWS || !switched_on("INFER_Q4_GROUP_SUMS"));
    if (fmt == Q6 || fmt == Q8C) fmt = Q8;
    if (fmt == Q4C) fmt = Q4;
    if (!qshape_ok(fmt, k, group)) return -2;
    if (o.f32 && !channels) return -2; /* (fp32 rows: the channel form alone; the pairs form rounds weights to bf16) */
#if defined(HAVE_DOT_BF16)
    if (!o.f32) return -2;
#endif
    if (m <= 0 || n <= 0) return 0;
    const float *xw = o.f32 ? (const float *)x : widened_rows((const uint16_t *)x, m, k, threads);
    const float *xsums = q4 && mins ? group_sums(xw, m, k, group) : NULL;
    if (!xw || (q4 && mins && !xsums)) return -1;
    /* (the scaled form reads x a stretch of SCALED_INPUTS inputs at a time: its rows' stretches in L2) */
    int64_t pairs = k / 2, groups = k / group, block_bytes = fmt == Q8 ? 16 * k : 8 * k;
    int64_t rows_at_once = scaled ? rows_in_l2(SCALED_INPUTS) : rows_in_l2(k);
    /* the blocks shared by the threads (work_range: each its own from the front, then the others' from the back),
     * a set of ranges for each group of rows, as the bf16 packed product shares them */
    int64_t blocks = (n + 15) / 16, row_groups = (m + rows_at_once - 1) / rows_at_once;
    int failed = 0, loops = prefetch_loops(), nr = threads > 1 ? threads : 1, balance = work_balance();
    (void)loops; /* (the pairs form's alone: AVX2 builds') */
    /* few rows: blocks side by side, an item of the walk `bk` of them */
    int bk = channels ? few_rows_blocks(q4, scaled, m) : 1;
    int64_t items = (blocks + bk - 1) / bk;
    work_range *ranges = work_ranges(row_groups, nr, items);
    if (!ranges) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* the dequantized block (pairs form), or the scaled stretch and each row's 16 sums (scaled form) */
        size_t scratch = channels ? (scaled ? (size_t)(16 * SCALED_INPUTS + 16 * rows_at_once) * sizeof(float) : 0)
                                  : (size_t)(pairs * 32) * sizeof(uint16_t);
        void *buf = scratch ? malloc(scratch) : NULL;
        /* float16 scales (and mins) of an item's blocks, widened */
        int64_t per_item = (int64_t)bk * groups * 16;
        float *widened = half ? (float *)malloc((size_t)(2 * per_item) * sizeof(float)) : NULL;
        int ready = (!scratch || buf) && (!half || widened); /* (a thread without its buffers takes no blocks) */
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        }
        /* the codes prefetched a block ahead of the one dequantizing; in the channel form, whose tiles read them
         * as they run, a block ahead of that */
        int64_t ahead = channels ? 2 : 1;
        for (int64_t j0 = 0; ready && j0 < m; j0 += rows_at_once) {
            int64_t mc = m - j0 < rows_at_once ? m - j0 : rows_at_once;
            int64_t tiles = (mc + CHANNEL_ROWS - 1) / CHANNEL_ROWS;
            int64_t per_iter = (bk * block_bytes / 64 + tiles * pairs - 1) / (tiles * pairs);
            work_walk walk = work_start(ranges + j0 / rows_at_once * nr, nr, items, balance);
            for (int64_t item; (item = work_next(&walk)) >= 0;) {
                int64_t b = item * bk;
                const uint8_t *bc = codes + b * block_bytes;
                const float *bs = scales + b * groups * 16, *bm = mins ? mins + b * groups * 16 : NULL;
                if (half) { /* (the item's real blocks: a spare lane repeats block 0) */
                    int64_t count = (blocks - b < bk ? blocks - b : bk) * groups * 16;
                    widen_halves((const uint16_t *)scales + b * groups * 16, widened, count);
                    bs = widened;
                    if (mins) {
                        widen_halves((const uint16_t *)mins + b * groups * 16, widened + per_item, count);
                        bm = widened + per_item;
                    }
                }
                int64_t from, to; /* the item `ahead` further along the walk, prefetched into L2 */
                work_ahead(&walk, item, ahead, bk, blocks, &from, &to);
                const char *pf = (const char *)(codes + from * block_bytes);
                const char *pf_end = (const char *)(codes + to * block_bytes);
                if (bk > 1) {
                    few_rows_pass(q4, scaled, blocks - b < bk ? (int)(blocks - b) : bk, bc, bs, bm, group,
                                  xsums ? xsums + j0 * groups : NULL, xw + j0 * k, mc, k, rows_from(o, j0), b, pf,
                                  pf_end, per_iter);
                    continue;
                }
                if (scaled) {
                    scaled_block(bc, bs, bm, group, xsums ? xsums + j0 * groups : NULL, xw + j0 * k, mc, k,
                                 rows_from(o, j0), b, (float *)buf, (float *)buf + 16 * SCALED_INPUTS, pf, pf_end,
                                 per_iter);
                    continue;
                }
                if (channels) {
                    channel_block cb = {group, bs, q4, bm, xsums ? xsums + j0 * groups : NULL};
                    channel_pass(bc, &cb, pairs, xw + j0 * k, mc, k, rows_from(o, j0), b, pf, pf_end, per_iter);
                    continue;
                }
#if !defined(HAVE_DOT_BF16) /* (the pairs form's bf16 tile: AVX2's, on x widened) */
                dequant_block_packed(fmt, bc, bs, bm, (uint16_t *)buf, pairs, group);
                packed_pass((const uint16_t *)buf, pairs, xw + j0 * k, mc, k, rows_from(o, j0), b, 1, pf, pf_end,
                            per_iter, loops);
#endif
            }
        }
        free(buf);
        free(widened);
    }
    free(ranges);
    return failed ? -1 : 0;
}
#endif

#if defined(HAVE_DOT_BF16)
/* Whether each thread lays out all of x pair-major in its own buffer (m <= PAIRS_EACH_ROWS, INFER_PAIRS_EACH_THREAD
 * not 0) rather than a share of its pairs into one buffer followed by a barrier: the tiles then read x from their own
 * core's cache and no thread waits for the other's share (a decode step's x is 16 rows: twice a few microseconds'
 * layout against a barrier and the other core's lines). The same values either way. Engine decode steps of 16
 * requests, alternating in one process on a 2-core Zen 4: the 150M Llama in int4 1.02x, SmolLM2's Q4_1 1.03x.
 * Prompt chunks (hundreds of rows) share the layout: their buffers would be megabytes per thread. */
#define PAIRS_EACH_ROWS 16
static int pairs_each_thread(int64_t m) { return m <= PAIRS_EACH_ROWS && switched_on("INFER_PAIRS_EACH_THREAD"); }
#endif

int infer_qgemm_packed(int fmt, const uint8_t *codes, const float *scales, const float *mins, const uint16_t *x,
                       const uint16_t *bias, uint16_t *y, int64_t m, int64_t n, int64_t k, int64_t group, int threads) {
#if defined(HAVE_DOT_BF16)
    if (fmt == Q8C || fmt == Q4C || (fmt & HALF_SCALES)) return -2; /* (AVX2's forms) */
    if (fmt == Q6) fmt = Q8;
    if (!qshape_ok(fmt, k, group)) return -2;
    if (m <= 0 || n <= 0) return 0;
    int64_t pairs = k / 2, groups = k / group, block_bytes = fmt == Q8 ? 16 * k : 8 * k;
    int failed = 0;
#if defined(HAVE_AMX) /* the dequantized pair of blocks on AMX tiles, as infer_gemm_bf16_packed's */
    int amx = amx_takes(k), amx_tall = amx && switched_on("INFER_AMX_TALL");
    const uint16_t *xt = amx ? amx_rows_as_tiles(x, m, k, threads) : NULL;
    if (amx && !xt) return -1;
#endif
    /* pairs of blocks shared by the threads, as infer_gemm_bf16_packed's (work_range) */
    int64_t blocks = (n + 15) / 16, items = (blocks + PACK_BLOCKS - 1) / PACK_BLOCKS;
    int nr = threads > 1 ? threads : 1;
    work_range *ranges = work_ranges(1, nr, items);
    if (!ranges) return -1;
    int balance = work_balance(), loops = prefetch_loops();
    int code_sums = code_sums_take(fmt, k); /* q8 codes in the codes form (above) */
    int tall = code_sums && codes_tall_takes(m); /* (decided once: x's layout and the tiles must agree) */
    int q4_codes = fmt == Q4 && mins && q4_codes_take(m, k); /* (with the codes form off, the tiles up to 8 rows) */
    int q4_tiles = fmt == Q4 && mins && !q4_codes && q4_tiles_take(m, k);
    /* x pair-major, and for q4's codes form its group sums after it (pairs_each_thread: in each thread's buffer) */
    int laid = code_sums || q4_tiles || q4_codes, each = laid && pairs_each_thread(m);
    int64_t laid_len = m * pairs + (q4_codes ? m * groups : 0);
    int32_t *xpairs = laid && !each ? pair_major_buffer(laid_len) : NULL;
    if (laid && !each && !xpairs) {
        free(ranges);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t tiles = (m + PACK_ROWS - 1) / PACK_ROWS;
        int32_t *xp = each ? pair_major_buffer(laid_len) : xpairs; /* (each: this thread's own buffer) */
        float *xsums = q4_codes && xp ? (float *)(xp + m * pairs) : NULL;
        if (laid) {
            int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            int tile_rows = q4_tiles ? PACK_ROWS : q4_codes ? Q4_CODE_ROWS : tall ? CODE_TALL_ROWS : CODE_ROWS;
            if (!xp) {
#pragma omp atomic write
                failed = 1;
            } else if (each) { /* all of x, into this thread's own buffer: no barrier */
                pair_major(x, m, k, tile_rows, 0, pairs, xp, group, xsums);
            } else { /* a share of its pairs each (whole groups where sums are taken), then all of them wait */
                int64_t unit = q4_codes ? group / 2 : 16, units = pairs / unit;
                pair_major(x, m, k, tile_rows, units * tid / nt * unit, units * (tid + 1) / nt * unit, xp, group,
                           xsums);
#pragma omp barrier
            }
        }
#if defined(HAVE_AMX)
        if (amx) amx_configure();
#endif
        uint16_t *buf = (uint16_t *)malloc((size_t)(PACK_BLOCKS * pairs * 32) * sizeof(uint16_t));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        /* the next pair's codes, spread over this pair's iterations (a line per pair of each block's codes) */
        int64_t per_iter = (PACK_BLOCKS * block_bytes / 64 + tiles * pairs - 1) / (tiles * pairs);
        work_walk walk = work_start(ranges, nr, items, balance);
        for (int64_t item; buf && (!laid || xp) && (item = work_next(&walk)) >= 0;) {
            int64_t b = item * PACK_BLOCKS;
            int nb = blocks - b < PACK_BLOCKS ? (int)(blocks - b) : PACK_BLOCKS;
            int64_t from, to; /* the next pair along the walk */
            work_ahead(&walk, item, 1, PACK_BLOCKS, blocks, &from, &to);
            const char *pf = (const char *)(codes + from * block_bytes), *pf_end = (const char *)(codes + to * block_bytes);
            if (code_sums) {
                const uint16_t *pb = NULL; /* (the codes widened in every tile, or once into the buffer) */
                if (tiles > CODE_TILES_IN_REGISTERS) {
                    for (int a = 0; a < nb; a++)
                        codes_block_bf16(codes + (b + a) * block_bytes, buf + a * pairs * 32, pairs);
                    pb = buf;
                }
                codes_pass(tall, codes + b * block_bytes, pb, block_bytes, pairs, group, scales + b * groups * 16,
                           xp, m, k, bias, y, n, b, nb, pf, pf_end, per_iter);
                continue;
            }
            if (q4_codes) { /* (the codes form, above) */
                q4_codes_pass(codes + b * block_bytes, block_bytes, pairs, group, scales + b * groups * 16,
                              mins + b * groups * 16, xp, xsums, m, bias, y, n, b, nb, pf, pf_end, per_iter);
                continue;
            }
            if (q4_tiles) { /* (dequantized in the tiles, above) */
                q4_pass(codes + b * block_bytes, block_bytes, pairs, group, scales + b * groups * 16,
                        mins + b * groups * 16, xp, m, bias, y, n, b, nb, pf, pf_end, per_iter);
                continue;
            }
            for (int a = 0; a < nb; a++)
                dequant_block_packed(fmt, codes + (b + a) * block_bytes, scales + (b + a) * groups * 16,
                                     mins ? mins + (b + a) * groups * 16 : NULL, buf + a * pairs * 32, pairs, group);
#if defined(HAVE_AMX)
            if (amx) {
                amx_pass(buf, pairs, xt, m, k, bias, y, n, b, nb, pf, pf_end, amx_tall);
                continue;
            }
#endif
            sums_out o = {y, bias, n, 0};
            packed_pass(buf, pairs, x, m, k, o, b, nb, pf, pf_end, per_iter, loops);
        }
#if defined(HAVE_AMX)
        if (amx) _tile_release();
#endif
        free(buf);
    }
    free(ranges);
    return failed ? -1 : 0;
#elif defined(HAVE_PACKED_BF16) /* AVX2: a block at a time into the buffer, for each group of rows whose x is in L2 */
    sums_out o = {y, bias, n, 0};
    return codes_product_avx2(fmt, codes, scales, mins, x, o, m, n, k, group, threads);
#else
    (void)fmt, (void)codes, (void)scales, (void)mins, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k;
    (void)group, (void)threads;
    return -2;
#endif
}

/* y [m, n] = x [m, k] W^T (+ bias) with x, bias and y fp32 (an fp32 model's batched products), for codes in the
 * channel form (Q8C, Q4C): infer_qgemm_packed's sums on AVX2's tiles, not rounded to bf16 (AVX512-BF16 builds too:
 * their bf16 rows take codes in the pairs form, their fp32 ones this). Returns -2 for the other forms and on builds
 * without AVX2 and FMA, -1 without memory. */
int infer_qgemm_packed_f32(int fmt, const uint8_t *codes, const float *scales, const float *mins, const float *x,
                           const float *bias, float *y, int64_t m, int64_t n, int64_t k, int64_t group, int threads) {
#if defined(HAVE_CHANNEL_CODES)
    if ((fmt & ~HALF_SCALES) != Q8C && (fmt & ~HALF_SCALES) != Q4C) return -2;
    sums_out o = {y, bias, n, 1};
    return codes_product_avx2(fmt, codes, scales, mins, x, o, m, n, k, group, threads);
#else
    (void)fmt, (void)codes, (void)scales, (void)mins, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k;
    (void)group, (void)threads;
    return -2;
#endif
}

/* Whether infer_qgemm_packed multiplies codes of format `fmt` (Q8, Q6 or Q4) at inner size k in the codes form:
 * 1, else 0 (the dequantizing path, or AVX2's forms). */
int infer_packed_code_sums(int fmt, int64_t k) {
#if defined(HAVE_DOT_BF16)
    return code_sums_take(fmt, k);
#else
    (void)fmt, (void)k;
    return 0;
#endif
}

/* The most rows of x infer_qgemm_packed multiplies q4 codes (with mins) in the codes form at inner size k:
 * Q4_CODE_ROWS, or 0 where it never does (INFER_Q4_CODES=0, AMX tiles, builds without the pair instruction). */
int infer_q4_code_rows(int64_t k) {
#if defined(HAVE_DOT_BF16)
    return q4_codes_take(1, k) ? Q4_CODE_ROWS : 0;
#else
    (void)k;
    return 0;
#endif
}

/* ---- a one-token step of one sequence: every decoder layer in one call ----
 * A small model's decode step is dominated by the Python between its ops (SmolLM2-135M: ~20 ops a layer, 30
 * layers, half the step), not by its products. This runs a whole step's layers with the same kernels the
 * per-op path calls (infer_gemv / infer_qgemv, infer_rms_norm, infer_rope, infer_gated; the paged kernel's exact
 * path for attention), in the order of infer/models/transformer.py's DecoderLayer, so the only difference from
 * that path is attention's summation order (SDPA's there). infer/models/native_step.py describes the model. */

typedef struct {
    int kind;   /* 0: a dense weight of the step's dtype (infer_gemv); 1: q8, 2: q4, 3: Q6_K's q8 codes (infer_qgemv);
                 * 4: codes packed for infer_qgemm_packed (fp32 steps: its fp32 entry, the channel form);
                 * 5: q8 or q4 codes (fmt) with x quantized to int8 (infer_qgemv_a8) */
    int sdtype; /* the scales' (and mins') dtype of quantized codes (kind 4: float32) */
    const void *w, *scales, *mins, *bias; /* w: the weight or its codes; bias in the step's dtype, or NULL */
    int64_t n, k, group;
    int64_t fmt; /* kind 4: the packed codes' Q8, Q4, Q8C or Q4C; kind 5: Q8 or Q4; kind 2: MINS_EIGHT_SCALES or 0 */
} step_proj;

typedef struct {
    step_proj qkv[3], o, gate_up[2], down; /* q/k/v and gate/up fused (one part) or separate (three, two) */
    int64_t n_qkv, n_gate_up;
    /* norms (weights of hidden values): before attention, after it (Gemma's sandwich; NULL elsewhere), before
     * the MLP, after it (sandwich); q_norm / k_norm over each head (QK-norm; NULL elsewhere) */
    const void *attn_in, *attn_out, *mlp_in, *mlp_out, *q_norm, *k_norm;
    void *k, *v;   /* this layer's cache rows [Hkv, slots, D] (one sequence) */
    int64_t slots; /* position p goes to slot p (ring: p % slots; every filled slot is a key) */
    int64_t ring, window; /* window: keys at positions > p - window only (0: all) */
    int64_t rope;         /* which of the step's (cos, sin) rows this layer rotates by */
    float scale, softcap; /* query scale; attention logit softcap (0: none) */
    /* A quantized cache's layer (infer/cache/quantized.py) where qscheme > 0 (1 + Q_INT8, Q_INT4 or Q_FP4; 0, as
     * a zeroed descriptor has it: exact rows): k, v above
     * are its exact rings (position p at slot (p - sinks) % slots for keys, % vslots for values); the sinks, codes,
     * scales, key offsets and value rotation as infer_qattn reads them, nq_cap key and nqv_cap value code rows,
     * keys by channel over blocks of `block` rows (scale_rows rows of scales) or by row. */
    int64_t qscheme, channel_keys, sinks, nq_cap, block, scale_rows, vslots, nqv_cap;
    const void *k_sink, *v_sink, *k_codes, *v_codes, *k_scale, *v_scale, *k_offset, *v_rot;
} step_layer;

static int step_product(int dtype, const step_proj *p, const void *x, void *y, int threads) {
    if (p->kind == 0) return infer_gemv(dtype, p->w, x, p->bias, y, p->n, p->k, threads);
    if (p->kind == 5) /* x quantized to int8 (Transformer.quantize_activations) */
        return infer_qgemv_a8((int)p->fmt, (const uint8_t *)p->w, p->sdtype, p->scales, p->mins, dtype, x, p->bias, y,
                              p->n, p->k, p->group, threads);
    if (p->kind == 4) { /* (one row of the packed codes' tiles, as the per-op path's product on them) */
        int code = dtype == F32 ? infer_qgemm_packed_f32((int)p->fmt, (const uint8_t *)p->w, (const float *)p->scales,
                                                         (const float *)p->mins, (const float *)x,
                                                         (const float *)p->bias, (float *)y, 1, p->n, p->k, p->group,
                                                         threads)
                                : infer_qgemm_packed((int)p->fmt, (const uint8_t *)p->w, (const float *)p->scales,
                                                     (const float *)p->mins, (const uint16_t *)x,
                                                     (const uint16_t *)p->bias, (uint16_t *)y, 1, p->n, p->k,
                                                     p->group, threads);
        return code == -1 ? -1 : code ? -2 : 0;
    }
    int fmt = p->kind == 1 ? Q8 : p->kind == 2 ? (Q4 | ((int)p->fmt & MINS_EIGHT_SCALES)) : Q6; /* (Q4_0's flag) */
    return infer_qgemv(fmt, (const uint8_t *)p->w, p->sdtype, p->scales, p->mins, dtype, x,
                       p->bias, y, 1, p->n, p->k, p->group, threads);
}

/* Value rows of layer L: a quantized cache's value ring has its own length. */
static inline int64_t step_vslots(const step_layer *L) { return L->qscheme ? L->vslots : L->slots; }

/* The slot of position `pos` in layer L's key (or `value`) rows: its ring's (past a quantized cache's sinks), or pos
 * itself. */
static inline int64_t step_slot(const step_layer *L, int64_t pos, int value) {
    return L->ring ? (pos - (L->qscheme ? L->sinks : 0)) % (value ? step_vslots(L) : L->slots) : pos;
}

/* Layer l's K/V rows of position `pos` swapped with `keep` [2, Hkv, D]: saved before the write, put back on failure. */
static void swap_rows(const step_layer *L, int64_t pos, char *keep, int64_t kv_heads, int64_t d, int64_t esize) {
    char tmp[1024];
    int64_t slot = step_slot(L, pos, 0), vslot = step_slot(L, pos, 1);
    for (int64_t g = 0; g < 2 * kv_heads; g++) {
        char *cache = g < kv_heads ? (char *)L->k + ((g % kv_heads) * L->slots + slot) * d * esize
                                   : (char *)L->v + ((g % kv_heads) * step_vslots(L) + vslot) * d * esize;
        for (int64_t i = 0; i < d * esize; i += (int64_t)sizeof tmp) {
            size_t n = (size_t)(d * esize - i < (int64_t)sizeof tmp ? d * esize - i : (int64_t)sizeof tmp);
            memcpy(tmp, cache + i, n);
            memcpy(cache + i, keep + g * d * esize + i, n);
            memcpy(keep + g * d * esize + i, tmp, n);
        }
    }
}

/* Whether a layer's products and cache fit the step's shapes (checked for every layer before anything is written). */
static int step_layer_fits(const step_layer *L, int64_t pos, int64_t heads, int64_t kv_heads, int64_t d,
                           int64_t hidden, int64_t inter) {
    int64_t qkv = 0, gate_up = 0;
    if (L->n_qkv < 1 || L->n_qkv > 3 || L->n_gate_up < 1 || L->n_gate_up > 2) return 0;
    for (int64_t p = 0; p < L->n_qkv; p++) {
        if (L->qkv[p].k != hidden) return 0;
        qkv += L->qkv[p].n;
    }
    for (int64_t p = 0; p < L->n_gate_up; p++) {
        if (L->gate_up[p].k != hidden) return 0;
        gate_up += L->gate_up[p].n;
    }
    return qkv == (heads + 2 * kv_heads) * d && gate_up == 2 * inter && L->o.k == heads * d && L->o.n == hidden &&
           L->down.k == inter && L->down.n == hidden && L->slots > 0 && (L->ring || pos < L->slots) &&
           (L->qscheme == 0 || (L->ring && pos >= L->sinks && L->block > 0 && L->vslots > 0));
}


/* x [hidden] (dtype) becomes the last layer's output; position `pos`'s K/V rows are written to every layer's
 * cache. cos/sin: one row of D per rope table. Returns 0; -1 where memory ran out, -2 where a layer's shapes do
 * not fit (before anything is written) or a quantized product refused its shape: then every slot written is put
 * back and x is unchanged, so the step is all or nothing. */
int infer_decode_step(int dtype, const step_layer *layers, int64_t n_layers, int64_t heads, int64_t kv_heads,
                      int64_t d, int64_t hidden, int64_t inter, float eps, int gemma, int gelu, void *x,
                      int64_t pos, int64_t quantized, int64_t vquantized, const void *const *cos,
                      const void *const *sin, int threads) {
    /* quantized, vquantized: how many positions past the sinks a quantized cache's layers hold as key and value
     * codes in this step (the rest of its stream, this position's included, in the rings) */
    int64_t esize = dtype == F32 ? 4 : 2, qkv_n = (heads + 2 * kv_heads) * d, row = kv_heads * d;
    int64_t act = 2 * inter > qkv_n ? 2 * inter : qkv_n;
    /* scratch in dtype: h, o, x's input (to undo), the products' outputs, act(gate) * up, the attention output;
     * every layer's overwritten K/V slot; one attention buffer per thread. All taken before anything is written. */
    char *mem = (char *)malloc((size_t)((3 * hidden + act + inter + heads * d) * esize));
    char *undo = (char *)malloc((size_t)(n_layers * 2 * row * esize));
    float **scratch = (float **)calloc((size_t)threads, sizeof(float *));
    int code = mem && undo && scratch ? 0 : -1;
    for (int64_t l = 0; code == 0 && l < n_layers; l++)
        if (!step_layer_fits(layers + l, pos, heads, kv_heads, d, hidden, inter)) code = -2;
    for (int t = 0; code == 0 && t < threads; t++)
        if (!(scratch[t] = qattn_alloc(heads / kv_heads, d, pos + 1))) code = -1;
    char *h = mem, *o = h + hidden * esize, *x0 = o + hidden * esize, *big = x0 + hidden * esize;
    char *gated = big + act * esize, *attn = gated + inter * esize;
    int64_t written = 0; /* layers whose slot holds this step's row */
    int saved = code == 0;
    if (saved) memcpy(x0, x, (size_t)(hidden * esize));
    for (int64_t l = 0; code == 0 && l < n_layers; l++) {
        const step_layer *L = layers + l;
        /* attention: norm, q/k/v, QK-norm, RoPE, the new K/V row into the cache, attend, o, (post-norm), residual */
        infer_rms_norm(dtype, x, L->attn_in, h, 1, hidden, eps, gemma, 1);
        int64_t at = 0;
        for (int64_t p = 0; code == 0 && p < L->n_qkv; at += L->qkv[p].n, p++)
            code = step_product(dtype, L->qkv + p, h, big + at * esize, threads);
        if (code) break;
        char *q = big, *k = big + heads * d * esize; /* v follows k */
        if (L->q_norm) infer_rms_norm(dtype, q, L->q_norm, q, heads, d, eps, gemma, 1);
        if (L->k_norm) infer_rms_norm(dtype, k, L->k_norm, k, kv_heads, d, eps, gemma, 1);
        infer_rope(dtype, q, cos[L->rope], sin[L->rope], q, heads, d);
        infer_rope(dtype, k, cos[L->rope], sin[L->rope], k, kv_heads, d);
        int64_t start = 0, length = pos + 1;
        if (L->ring) length = pos + 1 < L->slots ? pos + 1 : L->slots;
        else if (L->window > 0 && pos + 1 > L->window) start = pos + 1 - L->window;
        char *keep = undo + l * 2 * row * esize; /* k then v rows: the new ones in, the old ones out */
        memcpy(keep, k, (size_t)(2 * row * esize));
        swap_rows(L, pos, keep, kv_heads, d, esize);
        written++;
        if (L->qscheme) { /* sinks, codes, then the ring's newest rows: the per-layer path's kernel */
            if (infer_qattn(dtype, (int)L->qscheme - 1, (int)L->channel_keys, q, L->k_sink, L->v_sink,
                            (const uint8_t *)L->k_codes, (const uint8_t *)L->v_codes, (const uint16_t *)L->k_scale,
                            (const uint16_t *)L->v_scale, (const uint16_t *)L->k_offset, (const float *)L->v_rot,
                            L->k, L->v, attn, 1, heads, kv_heads, d, L->sinks, L->sinks, quantized, L->nq_cap,
                            L->block, L->scale_rows, pos + 1 - L->sinks - quantized, L->slots, vquantized,
                            L->nqv_cap, L->vslots, L->scale, L->softcap, L->window, threads)) {
                code = -1;
                break;
            }
        } else {
            /* the layer's rows as one staged block of `slots` rows, read from `start` on: keys start .. length - 1 */
            int64_t table = 0, end = length, first = start;
            const char *kb = (const char *)L->k + start * d * esize, *vb = (const char *)L->v + start * d * esize;
            qattn_paged(dtype, Q_INT8, q, NULL, NULL, NULL, NULL, NULL, NULL, kb, vb, &table, &end, &first, attn, 1,
                        heads, kv_heads, d, L->slots, 1, 0, L->scale, L->softcap, 0, threads, scratch);
        }
        if ((code = step_product(dtype, &L->o, attn, o, threads))) break;
        if (L->attn_out) infer_rms_norm(dtype, o, L->attn_out, o, 1, hidden, eps, gemma, 1);
        for (int64_t i = 0; i < hidden; i++) store_scalar(dtype, x, i, load_scalar(dtype, x, i) + load_scalar(dtype, o, i));
        /* MLP: norm, gate/up, act(gate) * up, down, (post-norm), residual */
        infer_rms_norm(dtype, x, L->mlp_in, h, 1, hidden, eps, gemma, 1);
        at = 0;
        for (int64_t p = 0; code == 0 && p < L->n_gate_up; at += L->gate_up[p].n, p++)
            code = step_product(dtype, L->gate_up + p, h, big + at * esize, threads);
        if (code) break;
        infer_gated(dtype, big, gated, inter, gelu);
        if ((code = step_product(dtype, &L->down, gated, o, threads))) break;
        if (L->mlp_out) infer_rms_norm(dtype, o, L->mlp_out, o, 1, hidden, eps, gemma, 1);
        for (int64_t i = 0; i < hidden; i++) store_scalar(dtype, x, i, load_scalar(dtype, x, i) + load_scalar(dtype, o, i));
    }
    if (code) { /* put back what the layers run so far overwrote */
        for (int64_t l = 0; l < written; l++) {
            const step_layer *L = layers + l;
            swap_rows(L, pos, undo + l * 2 * row * esize, kv_heads, d, esize);
        }
        if (saved) memcpy(x, x0, (size_t)(hidden * esize));
    }
    for (int t = 0; scratch && t < threads; t++) free(scratch[t]);
    free(scratch);
    free(undo);
    free(mem);
    return code;
}

/* ---- a quantized pool's filled blocks into codes (infer/cache/paged_quantized.py) ----
 * The pool's own quantizing (QuantizedPoolLayer.quantize_filled's torch code, infer/cache/quant.py) without a Python
 * call per layer: once requests drift apart a block fills in most decode steps, and the torch code's ~20 small ops a
 * layer made a 150M Llama's 16-request int8 step 1.16-1.22x slower on a 2-core Xeon. The same formulas in the same fp32
 * operations, so the same codes and scales bit for bit, except the 4-bit schemes' value rotation, whose sums (x @ H)
 * PyTorch's matmul orders its own way: here in input order, so a rotated value on a rounding boundary may take the
 * neighbouring code.
 *   keys [bs, d] of a block and head: (4-bit) offsets o_c = bf16((max_t x + min_t x) / 2), x -= o_c; then one scale
 *     per channel over the block's tokens, s_c = absmax_t |x| / qmax rounded to bf16, and up one bf16 step where
 *     that fell below (`round_up_scale`, quant.row_scale); code = clamp(rint(x / s_c)) (s_c = 0 divides by 1);
 *   values: each row (rotated by H for the 4-bit schemes: x @ H in fp32) its own scale over d, the same codes.
 * int8: one code a byte; int4: codes -7..7 as two's-complement nibbles; fp4: E2M1 (the magnitude's bucket among
 * the midpoints, a value on one going down; bit 3 the sign); 4-bit codes two a byte, element 2i in the low nibble.
 * Keys' qmax: 127 / 7 / 4 (FP4_KEY_MAX), values': 127 / 7 / 6. */
static const float FP4_MIDPOINTS[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

/* absmax / qmax rounded to bf16, and up one bf16 step where that rounded below (no value clips) */
static inline uint16_t round_up_scale(float absmax, float qmax) {
    float exact = absmax / qmax;
    uint16_t s = f32_to_bf16(exact);
    if (bf16_to_f32(s) < exact) s = (s & 0x7fff) == 0 ? 1 : (uint16_t)(s + 1); /* (torch.nextafter toward +inf) */
    return s;
}

/* a scaled value's int8 / int4 code (rint: ties to even, as torch.round), clamped to +-lim */
static inline int int_code(float v, float lim) {
    float r = rintf(v);
    r = r < -lim ? -lim : r;
    return (int)(r > lim ? lim : r);
}

/* a scaled value's E2M1 code: the magnitude's bucket among the midpoints (a value on one goes down), bit 3 the sign */
static inline int fp4_code(float v) {
    float a = fabsf(v);
    int m = 0;
    for (int i = 0; i < 7; i++) m += FP4_MIDPOINTS[i] < a;
    return m | (v < 0 ? 8 : 0);
}

/* n scaled values (x / scale, already divided) as `scheme`'s codes at out (plain loops the compiler vectorizes: a
 * 48-request int4 step spent 7% of its time here as one branchy loop) */
static inline void pack_codes(int scheme, const float *restrict scaled, int64_t n, uint8_t *restrict out) {
    if (scheme == Q_INT8)
        for (int64_t i = 0; i < n; i++) out[i] = (uint8_t)(int8_t)int_code(scaled[i], 127.0f);
    else if (scheme == Q_INT4)
        for (int64_t i = 0; i < n / 2; i++)
            out[i] = (uint8_t)((int_code(scaled[2 * i], 7.0f) & 0x0f) |
                               (int_code(scaled[2 * i + 1], 7.0f) & 0x0f) << 4);
    else
        for (int64_t i = 0; i < n / 2; i++)
            out[i] = (uint8_t)(fp4_code(scaled[2 * i]) | fp4_code(scaled[2 * i + 1]) << 4);
}

/* rot = row @ rotation ([d, d]): each output's sum over the inputs in order (a row at a time of the matrix, so the
 * compiler vectorizes over the outputs) */
static inline void rotate_row(const float *restrict row, const float *restrict rotation, float *restrict rot,
                              int64_t d) {
    for (int64_t j = 0; j < d; j++) rot[j] = 0.0f;
    for (int64_t c = 0; c < d; c++) {
        const float r = row[c], *restrict h = rotation + c * d;
        for (int64_t j = 0; j < d; j++) rot[j] += r * h[j];
    }
}

static inline float scale_divisor(uint16_t s) { return bf16_to_f32(s) == 0.0f ? 1.0f : bf16_to_f32(s); }

/* One block and head: keys x [bs, d] and values [bs, d] (fp32, overwritten) into codes at kc / vc, key scales ks
 * [d], value scales vs [bs], key offsets ko [d] (NULL: none); rotation [d, d] or NULL; w: 5d floats of scratch.
 * The keys' channels a token row at a time (the loops run along the channels, which the compiler vectorizes); each
 * value the same operations as the formula's, so the same bits whichever way the loops run. */
static void quantize_block_head(int scheme, float *restrict x, float *restrict v, int64_t bs, int64_t d, uint8_t *kc,
                                uint8_t *vc, uint16_t *ks, uint16_t *vs, uint16_t *ko, const float *rotation,
                                float *restrict w) {
    int64_t per = scheme == Q_INT8 ? 1 : 2;
    float key_qmax = scheme == Q_INT8 ? 127.0f : scheme == Q_INT4 ? 7.0f : 4.0f;
    float value_qmax = scheme == Q_INT8 ? 127.0f : scheme == Q_INT4 ? 7.0f : 6.0f;
    float *restrict hi = w, *restrict lo = w + d, *restrict amax = w + 2 * d, *restrict div = w + 3 * d;
    float *restrict rot = w + 4 * d;
    if (ko) { /* keys: each channel's midpoint over the block's tokens, rounded to bf16, taken off */
        memcpy(hi, x, sizeof(float) * (size_t)d);
        memcpy(lo, x, sizeof(float) * (size_t)d);
        for (int64_t t = 1; t < bs; t++)
            for (int64_t c = 0; c < d; c++) {
                hi[c] = x[t * d + c] > hi[c] ? x[t * d + c] : hi[c];
                lo[c] = x[t * d + c] < lo[c] ? x[t * d + c] : lo[c];
            }
        for (int64_t c = 0; c < d; c++) {
            ko[c] = f32_to_bf16((hi[c] + lo[c]) / 2.0f);
            hi[c] = bf16_to_f32(ko[c]);
        }
        for (int64_t t = 0; t < bs; t++)
            for (int64_t c = 0; c < d; c++) x[t * d + c] -= hi[c];
    }
    for (int64_t c = 0; c < d; c++) amax[c] = 0.0f; /* one scale per channel over the block's tokens */
    for (int64_t t = 0; t < bs; t++)
        for (int64_t c = 0; c < d; c++) amax[c] = fabsf(x[t * d + c]) > amax[c] ? fabsf(x[t * d + c]) : amax[c];
    for (int64_t c = 0; c < d; c++) {
        ks[c] = round_up_scale(amax[c], key_qmax);
        div[c] = scale_divisor(ks[c]);
    }
    for (int64_t t = 0; t < bs; t++) {
        for (int64_t c = 0; c < d; c++) x[t * d + c] /= div[c];
        pack_codes(scheme, x + t * d, d, kc + t * (d / per));
    }
    for (int64_t t = 0; t < bs; t++) { /* values: each row its own scale (rotated first, each sum in input order) */
        float *restrict row = v + t * d, m = 0.0f;
        if (rotation) {
            rotate_row(row, rotation, rot, d);
            memcpy(row, rot, sizeof(float) * (size_t)d);
        }
        for (int64_t c = 0; c < d; c++) m = fabsf(row[c]) > m ? fabsf(row[c]) : m;
        vs[t] = round_up_scale(m, value_qmax);
        float s = scale_divisor(vs[t]);
        for (int64_t c = 0; c < d; c++) row[c] /= s;
        pack_codes(scheme, row, d, vc + t * (d / per));
    }
}

/* Blocks blocks[f] (their codes, scales and offsets in one layer's tensors) from staging rows rows[f] of k_stage /
 * v_stage ([*, kv_heads, bs, d] in dtype), f < n. k_offset NULL: no key offsets; rotation NULL: none. Returns -1
 * without memory, -3 for a 4-bit scheme and odd d (nothing written either way). */
int infer_quantize_blocks(int dtype, int scheme, const void *k_stage, const void *v_stage, const int64_t *rows,
                          const int64_t *blocks, int64_t n, void *k_codes, void *v_codes, uint16_t *k_scale,
                          uint16_t *v_scale, uint16_t *k_offset, const float *rotation, int64_t kv_heads, int64_t bs,
                          int64_t d, int threads) {
    if (scheme != Q_INT8 && d % 2) return -3;
    if (n <= 0) return 0;
    int64_t per = scheme == Q_INT8 ? 1 : 2, esize = dtype == F32 ? 4 : 2, units = n * kv_heads;
    if (units < 2 || units * bs * d * (rotation ? d : 8) < 262144) threads = 1; /* (a rotation: d^2 a row) */
    int64_t cells = 2 * bs * d + 5 * d; /* a thread's keys, values and quantize_block_head's scratch */
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(cells * threads));
    if (!scratch) return -1;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t u = 0; u < units; u++) {
#ifdef _OPENMP
        float *x = scratch + cells * omp_get_thread_num();
#else
        float *x = scratch;
#endif
        int64_t f = u / kv_heads, h = u % kv_heads, b = blocks[f], bh = b * kv_heads + h;
        size_t src = (size_t)((rows[f] * kv_heads + h) * bs * d * esize);
        for (int64_t t = 0; t < bs; t++) {
            load_row(dtype, (const char *)k_stage + src + (size_t)(t * d * esize), x + t * d, d);
            load_row(dtype, (const char *)v_stage + src + (size_t)(t * d * esize), x + (bs + t) * d, d);
        }
        quantize_block_head(scheme, x, x + bs * d, bs, d, (uint8_t *)k_codes + bh * bs * (d / per),
                            (uint8_t *)v_codes + bh * bs * (d / per), k_scale + bh * d, v_scale + bh * bs,
                            k_offset ? k_offset + bh * d : NULL, rotation, x + 2 * bs * d);
    }
    free(scratch);
    return 0;
}

/* ---- every decoder layer of a batched engine step in one call ----
 * The per-op path of a step whose tokens all attend in the native paged kernel (DecodeGroup.all_rows) makes ~15
 * Python calls a layer around its kernels: at 16 rows of a 150M Llama ~4 of a ~20 ms step. This runs the same
 * kernels in DecoderLayer's order for pre-norm SiLU layers (q/k norms or not) whose four products are packed for
 * the native packed product (Transformer.pack_products(layout="native")): norm, q/k/v, RoPE of each row by its
 * own position, the rows' K/V into their slots (fresh blocks zeroed first), paged attention, o, residual, norm,
 * gate/up, SiLU(gate) * up, down, residual; every value as the per-op path computes it (its residual adds are
 * PyTorch's adds: fp32 sums, rounded once to bf16 in a bf16 step). A step's rows are the model's dtype, `dtype`: bf16,
 * or fp32 (an fp32 model's: its products the fp32 packed product or its codes' fp32 sums in the channel form, its
 * small ops the same kernels in fp32). x [rows, hidden] becomes the last layer's output (`ends`, where
 * given: x embedded here first, each row's RoPE read at its position, the final norm last; see batch_ends). A quantized
 * pool's layers stage their rows and quantize the blocks the rows fill (infer_quantize_blocks, as the per-op path on
 * a CPU does; or, with the pool's torch quantizer, by calling `quantize_filled(layer)` back, whose non-zero return
 * stops the call: -4) before attending over codes and staging. A quantized model's products run the packed product
 * on its packed codes (infer_qgemm_packed), as its per-op path does. Gemma 3's layers: its norms (x (1 + w)), the
 * post-norms of the attention's and the MLP's outputs before each residual add (`attn_out`, `mlp_out`), tanh-GELU, and
 * each layer's own batch (`batch`: its sliding layers read the rings' tables, the others the pool's). */
typedef struct {
    const int64_t *slot_blocks, *slot_offsets, *fresh; /* [rows], [rows], [n_fresh]: where each row's K/V go */
    const int64_t *tables, *lengths, *starts;          /* [rows, nb], [rows], [rows]: what each row attends */
    int64_t n_fresh, nb;
} batch_tables;

typedef struct {
    const void *w, *bias; /* packed by infer_pack_bf16 / infer_pack_f32 (fmt -1, the step's dtype) or codes packed for
                           * infer_qgemm_packed (fp32 steps: the channel form); bias (the step's dtype) */
    const float *scales, *mins; /* the codes' (mins NULL: none) */
    int64_t fmt, group;         /* -1, Q8, Q4, Q8C or Q4C; the codes' group */
    const void *rows_w;         /* the weight row-major (the step's dtype), for one-row steps' GEMV (NULL: none) */
} batch_product;

/* The step's code for a product that failed: -2 a product this build cannot run (packed codes without the pair
 * instruction, or fp32 rows of codes not in the channel form), -3 a shape it cannot take, -1 anything else (its
 * buffer not allocated). x and y in the step's dtype (bf16 or fp32). */
static int batch_product_run(int dtype, const batch_product *p, const void *x, void *y, int64_t m, int64_t n,
                             int64_t k, int threads) {
    if (m == 1 && p->rows_w) /* one row: the GEMV the per-op path's one-row products run, so the same values bit for
                              * bit (the packed product's one-row tile streams as fast, but may round differently) */
        return infer_gemv(dtype, p->rows_w, x, p->bias, y, n, k, threads) ? -1 : 0;
    int code;
    if (dtype == F32) /* (an fp32 model's: the fp32 packed product, or its codes' fp32 sums) */
        code = p->fmt < 0 ? infer_gemm_f32_packed((const float *)p->w, (const float *)x, (const float *)p->bias,
                                                  (float *)y, m, n, k, threads)
                          : infer_qgemm_packed_f32((int)p->fmt, (const uint8_t *)p->w, p->scales, p->mins,
                                                   (const float *)x, (const float *)p->bias, (float *)y, m, n, k,
                                                   p->group, threads);
    else
        code = p->fmt < 0 ? infer_gemm_bf16_packed((const uint16_t *)p->w, (const uint16_t *)x,
                                                   (const uint16_t *)p->bias, (uint16_t *)y, m, n, k, threads)
                          : infer_qgemm_packed((int)p->fmt, (const uint8_t *)p->w, p->scales, p->mins,
                                               (const uint16_t *)x, (const uint16_t *)p->bias, (uint16_t *)y, m, n,
                                               k, p->group, threads);
    return code == 0 || code == -2 || code == -3 ? code : -1;
}

/* The step's two ends, done in the call where the caller can (a NULL field: the caller did it): the rows embedded
 * (`embed` [vocab, hidden] in the step's dtype read at each row's id, or a quantized table's row dequantized as infer_qdequant
 * dequantizes it: `embed_codes`, its scales and mins, format, scales' dtype and group; times `embed_scale` rounded once
 * where it is not 0: Gemma's x * sqrt(hidden) in the step's dtype, as PyTorch multiplies), every layer's RoPE read at each row's
 * position (`positions`: the layers' cos/sin are tables of `table_rows` positions, not [rows, d]), and the final norm
 * (`final_norm`) on every row. Each was a few PyTorch ops between steps, run with their code evicted by the step's
 * weights (~0.1 ms each at 16 rows). Ids and positions are checked before anything is written: -5 one out of its
 * table (-3 a quantized table of a shape the dequantizer cannot take). */
typedef struct {
    const void *embed;
    const uint8_t *embed_codes;
    const void *embed_scales, *embed_mins;
    int64_t embed_fmt, embed_sdtype, embed_group;
    const int64_t *ids;
    int64_t vocab;
    float embed_scale;
    const int64_t *positions;
    int64_t table_rows;
    const void *final_norm;
} batch_ends;

/* Row r of x: the embedding of ids[r] (a table's row, or a quantized one's dequantized), scaled where Gemma scales;
 * in the step's dtype (each product rounded to it, as PyTorch multiplies). */
static void embed_row(int dtype, const batch_ends *e, int64_t r, void *x, int64_t hidden) {
    int64_t id = e->ids[r];
    size_t es = dtype == F32 ? 4 : 2;
    char *xr = (char *)x + (size_t)(r * hidden) * es;
    if (e->embed) {
        memcpy(xr, (const char *)e->embed + (size_t)(id * hidden) * es, (size_t)hidden * es);
    } else {
        int fmt = e->embed_fmt == Q6 ? Q8 : (int)e->embed_fmt, sdtype = (int)e->embed_sdtype;
        int64_t groups = hidden / e->embed_group, row_bytes = fmt == Q8 ? hidden : hidden / 2;
        dequant_row(fmt, e->embed_codes + id * row_bytes, scale_row_of(sdtype, e->embed_scales, id, groups, hidden),
                    scale_row_of(sdtype, e->embed_mins, id, groups, hidden), e->embed_mins != NULL, dtype, xr, hidden,
                    e->embed_group);
    }
    if (e->embed_scale != 0.0f)
        for (int64_t i = 0; i < hidden; i++) store_scalar(dtype, xr, i, load_scalar(dtype, xr, i) * e->embed_scale);
}

typedef struct {
    const void *attn_norm, *mlp_norm;                            /* [hidden] */
    const void *attn_out, *mlp_out;                              /* [hidden] (Gemma 3's post-norms) or NULL */
    const void *q_norm, *k_norm;                                 /* [d] (Qwen 3, Gemma 3) or NULL */
    const batch_tables *batch;                                   /* the batch this layer's pool reads */
    batch_product qkv, o, gate_up, down;
    void *k_blocks, *v_blocks;                                   /* [num_blocks, kv_heads, bs, d] */
    const void *cos, *sin;                                       /* [rows, d]: the layer's RoPE at each row (or
                                                                  * tables read at batch_ends' positions) */
    int64_t window;                                              /* 0: none */
    float scale, softcap;
    /* A quantized pool (infer/cache/paged_quantized.py), or NULL codes: an exact one. Its K/V rows go to staging
     * rows `write_rows` of `k_stage` / `v_stage` (fresh rows `fresh_rows` zeroed first), the filled blocks are
     * quantized (here, or by the step's call back), and the rows attend over codes (blocks < num_blocks) and staging
     * slots (num_blocks + s: k_blocks / v_blocks, the layer's own staging). */
    void *k_codes, *v_codes, *k_scale, *v_scale, *k_offset;       /* k_offset NULL: no key offsets */
    const float *rotation;                                       /* [d, d] or NULL */
    void *k_stage, *v_stage;
    const int64_t *write_rows, *fresh_rows;                      /* [rows], [n_fresh] */
    const int64_t *fill_rows, *fill_blocks;                      /* [n_fill]: the blocks the rows fill, quantized
                                                                  * here (infer_quantize_blocks; n_fill 0: by the
                                                                  * call back, if any) */
    int64_t scheme, num_blocks, n_fill;                          /* Q_INT8 / Q_INT4 / Q_FP4 */
} batch_layer;

/* out = a + b over n bf16 values, as PyTorch adds bf16 tensors (fp32 sum rounded to nearest even). */
static void add_bf16(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if defined(HAVE_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), bf16x16_round(_mm512_add_ps(bf16x16_load(a + i), bf16x16_load(b + i))));
#elif defined(HAVE_AVX2_ROWS)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), bf16x8_round(_mm256_add_ps(bf16x8_load(a + i), bf16x8_load(b + i))));
#endif
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

/* The residual add in the step's dtype: add_bf16, or fp32's (each sum rounded once, as PyTorch adds fp32 tensors). */
static void add_rows(int dtype, void *a, const void *b, int64_t n) {
    if (dtype == BF16) {
        add_bf16((const uint16_t *)a, (const uint16_t *)b, (uint16_t *)a, n);
        return;
    }
    float *x = (float *)a;
    const float *y = (const float *)b;
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

int infer_batch_step(int dtype, const batch_layer *layers, int64_t n_layers, void *x, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t d, int64_t hidden, int64_t inter, float eps, int gemma, int gelu,
                     int64_t bs, int threads, int (*quantize_filled)(int64_t layer), const batch_ends *ends) {
#if defined(HAVE_PACKED_BF16) /* (AVX2 builds: bf16 products; packed codes need the pair instruction: -2) */
    if (dtype != BF16 && dtype != F32) return -3;
    size_t es = dtype == F32 ? 4 : 2;
    int64_t qkv_n = (heads + 2 * kv_heads) * d, wide = qkv_n > 2 * inter ? qkv_n : 2 * inter;
    if (d % 2 || hidden % 2 || inter % 2 || (heads * d) % 2) return -3;
    const int64_t *at = ends ? ends->positions : NULL;
    int embeds = ends && (ends->embed || ends->embed_codes);
    if (ends && ends->embed_codes) {
        int fmt = ends->embed_fmt == Q6 ? Q8 : (int)ends->embed_fmt;
        if (!qshape_ok(fmt, hidden, ends->embed_group) || (ends->embed_sdtype == FK && hidden % 256)) return -3;
    }
    for (int64_t r = 0; r < rows; r++)
        if ((at && (at[r] < 0 || at[r] >= ends->table_rows)) ||
            (embeds && (ends->ids[r] < 0 || ends->ids[r] >= ends->vocab)))
            return -5;
    if (embeds)
        for (int64_t r = 0; r < rows; r++) embed_row(dtype, ends, r, x, hidden);
    /* scratch, taken before anything is written: h, the products' outputs, q and k rotated, attention, o, gated (the
     * attention's own buffers are taken in each call: a failure there leaves the step's slots written, which the
     * engine's abort of the step discards) */
    size_t cells = (size_t)rows * (size_t)(hidden + wide + heads * d + kv_heads * d + heads * d + hidden + inter);
    char *mem = (char *)malloc(cells * es);
    int code = mem ? 0 : -1;
    char *h = mem, *big = h + rows * hidden * es, *q = big + rows * wide * es, *k = q + rows * heads * d * es;
    char *attn = k + rows * kv_heads * d * es, *o = attn + rows * heads * d * es, *gated = o + rows * hidden * es;
    const char *qkv_v = big + (heads + kv_heads) * d * es, *up = big + inter * es; /* (v: each row's last part) */
    for (int64_t l = 0; code == 0 && l < n_layers; l++) {
        const batch_layer *L = layers + l;
        const batch_tables *B = L->batch;
        infer_rms_norm(dtype, x, L->attn_norm, h, rows, hidden, eps, gemma, threads);
        if ((code = batch_product_run(dtype, &L->qkv, h, big, rows, qkv_n, hidden, threads)) != 0) break;
        if (L->q_norm) /* each row's heads normed in place, as the per-op path's rows norms do */
            for (int64_t r = 0; r < rows; r++) {
                char *row = big + r * qkv_n * es, *keys = row + heads * d * es;
                infer_rms_norm(dtype, row, L->q_norm, row, heads, d, eps, gemma, 1);
                infer_rms_norm(dtype, keys, L->k_norm, keys, kv_heads, d, eps, gemma, 1);
            }
        rope_rows_at(dtype, big, qkv_n, d, L->cos, L->sin, at, q, rows, heads, d, threads);
        rope_rows_at(dtype, big + heads * d * es, qkv_n, d, L->cos, L->sin, at, k, rows, kv_heads, d, threads);
        /* a quantized pool's rows go to its staging, and the callback quantizes the blocks they fill */
        int quantized = L->k_codes != NULL;
        infer_write_kv(k, kv_heads * d, d, qkv_v, qkv_n, d,
                       quantized ? L->k_stage : L->k_blocks, quantized ? L->v_stage : L->v_blocks,
                       quantized ? L->write_rows : B->slot_blocks, B->slot_offsets, rows,
                       quantized ? L->fresh_rows : B->fresh, B->n_fresh, kv_heads, bs, d, (int64_t)es);
        if (quantized && L->n_fill > 0) {
            if (infer_quantize_blocks(dtype, (int)L->scheme, L->k_stage, L->v_stage, L->fill_rows, L->fill_blocks,
                                      L->n_fill, L->k_codes, L->v_codes, (uint16_t *)L->k_scale,
                                      (uint16_t *)L->v_scale, (uint16_t *)L->k_offset, L->rotation, kv_heads, bs, d,
                                      threads)) {
                code = -1;
                break;
            }
        } else if (quantized && quantize_filled && quantize_filled(l)) {
            code = -4;
            break;
        }
        if (qattn_paged(dtype, quantized ? (int)L->scheme : Q_INT8, q, (const uint8_t *)L->k_codes,
                        (const uint8_t *)L->v_codes, (const uint16_t *)L->k_scale, (const uint16_t *)L->v_scale,
                        (const uint16_t *)L->k_offset, L->rotation, L->k_blocks, L->v_blocks, B->tables, B->lengths,
                        B->starts, attn, rows, heads, kv_heads, d, bs, B->nb, quantized ? L->num_blocks : 0, L->scale,
                        L->softcap, L->window, threads, NULL)) { /* (its own score buffers, as the per-op path's call:
                                                                   * the same order of work) */
            code = -1;
            break;
        }
        if ((code = batch_product_run(dtype, &L->o, attn, o, rows, hidden, heads * d, threads)) != 0) break;
        if (L->attn_out) infer_rms_norm(dtype, o, L->attn_out, o, rows, hidden, eps, gemma, threads);
        add_rows(dtype, x, o, rows * hidden);
        infer_rms_norm(dtype, x, L->mlp_norm, h, rows, hidden, eps, gemma, threads);
        if ((code = batch_product_run(dtype, &L->gate_up, h, big, rows, 2 * inter, hidden, threads)) != 0) break;
        infer_gated_rows(dtype, big, 2 * inter, up, 2 * inter, gated, rows, inter, gelu, threads);
        if ((code = batch_product_run(dtype, &L->down, gated, o, rows, hidden, inter, threads)) != 0) break;
        if (L->mlp_out) infer_rms_norm(dtype, o, L->mlp_out, o, rows, hidden, eps, gemma, threads);
        add_rows(dtype, x, o, rows * hidden);
    }
    if (code == 0 && ends && ends->final_norm)
        infer_rms_norm(dtype, x, ends->final_norm, x, rows, hidden, eps, gemma, threads);
    free(mem);
    return code;
#else
    (void)dtype, (void)layers, (void)n_layers, (void)x, (void)rows, (void)heads, (void)kv_heads, (void)d, (void)hidden, (void)inter;
    (void)eps, (void)gemma, (void)gelu, (void)bs, (void)threads, (void)quantize_filled, (void)ends;
    return -2;
#endif
}
