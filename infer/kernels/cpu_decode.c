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

static inline void prefetch(const void *p) {
#if defined(__GNUC__)
    __builtin_prefetch(p, 0, 3);
#else
    (void)p;
#endif
}

/* ---- one row's dot product, per instruction set ----
 * dot_bf16: both operands bf16 (the AVX512-BF16 path); dot_wide: x already widened to fp32 once per call
 * (every other path), w converted as it streams. Each step covers one cache line of w and prefetches the
 * line PREFETCH_BYTES ahead; one line a step measured faster than two (fewer loads in flight per prefetch).
 */

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
#define HAVE_DOT_BF16 1
static float dot_bf16(const uint16_t *w, const uint16_t *x, int64_t k) {
    const char *bytes = (const char *)w;
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
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

/* The instruction-set path this build took. */
const char *infer_isa(void) { return ISA; }

/* Whether this build computes `dtype` (fp16 needs hardware conversions on x86 without AVX512). */
int infer_supports(int dtype) {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(HAVE_AVX512) && !defined(__F16C__)
    if (dtype == F16) return 0;
#endif
    return dtype == F32 || dtype == BF16 || dtype == F16;
}

/* y[r] = sum_i w[r * k + i] * x[i] (+ bias[r]) for r < n, in fp32, rounded once to `dtype`; w, x, bias and y
 * all of `dtype`, w row-major with rows of k. Rows are split into `threads` contiguous ranges. Returns 0, or
 * -1 where x could not be widened (no memory; nothing written). */
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
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int64_t blocks = (n + 15) / 16; /* ranges in whole 16-row blocks: no two threads share a line of y */
        int64_t r0 = blocks * t / nt * 16, r1 = blocks * (t + 1) / nt * 16;
        if (r1 > n) r1 = n;
        for (int64_t r = r0; r < r1; r++) {
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

/* RMSNorm of `rows` rows of d: h = x * 1/sqrt(mean(x^2) + eps) in fp32, then
 * Llama/Qwen: weight * round(h) (weight in dtype, the product rounded); Gemma: round(h * (1 + weight)). */
void infer_rms_norm(int dtype, const void *x, const void *weight, void *out, int64_t rows, int64_t d, float eps,
                    int gemma) {
    int64_t esize = dtype == F32 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * d * esize;
        char *outr = (char *)out + r * d * esize;
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
