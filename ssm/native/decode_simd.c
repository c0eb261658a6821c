/* The decoding steps' matrix-vector products in x86 intrinsics, for float32 steps: the same
   y[r] = W[r]·x for nr ≤ 4 rows as decode_weights.c's portable dot_rows_*, for every format
   (W_REAL = float32, W_BF16, W_F16, W_Q8, W_Q4), with the four rows' sums in registers. Each
   weight is widened exactly to float32 and multiplied by the float32 activation, as in the
   portable code: only the order of the additions differs (the activations are never rounded).

   Three levels, each compiled per function with a target attribute (the library's -march may
   lack them) and chosen at run time (WMat.isa, which ssm/native/build.py's cpu_isa() sets, never
   above what ssm_cpu_isa() says this CPU runs):
     ISA_AVX2         AVX2 + FMA + F16C, 8 lanes;
     ISA_AVX512       AVX-512F, 16 lanes;
     ISA_AVX512_VNNI  the same, and AVX-512 VNNI (with BW, VL) for the int8-activation products.

   The int8-activation products (WMat.act = ACT_I8, decode_weights.c) have their own kernels,
   qdot4_*: AVX2's vpmaddubsw (also at ISA_AVX512) and VNNI's vpdpbusd. Their integer sums are
   exact, so they differ from the portable code's only in the order of the float additions of
   the blocks' scaled sums.
   decode_weights.c includes this file once, with its types; on another architecture or
   compiler only ssm_cpu_isa() is left, returning ISA_PORTABLE.

   Prefetch: a matrix larger than the caches is read from memory, and a narrow format does more
   work per byte, so fewer of its cache lines are in flight at a time than for float32; the
   loops over 16-bit and integer formats ask for each row's lines PREFETCH bytes ahead (float32
   reads slowed by it: 3.85 -> 3.2 G weights/s, so it has none). Measured on one loaded core of a Zen 4
   EPYC, an LM head (50280 x 768): bf16 4.4 -> 5.5 G weights/s, int8 6.5 -> 7.6 to 10 (noisy).
   Read from L3 (3072 x 768) the same loops run at 21 (bf16, f16, int8) and 17 (int4) G
   weights/s, against 4 to 16 for the portable C. */

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_VNNI = 3 };

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define SSM_X86_SIMD 1
#include <cpuid.h>
#include <immintrin.h>

/* The best level this CPU (and its OS, which must save the wide registers: the compiler's
   __builtin_cpu_supports checks that) runs. F16C through cpuid: clang's builtin does not know it. */
int ssm_cpu_isa(void) {
    unsigned a, b, c, d;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        const int vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
        return vnni ? ISA_AVX512_VNNI : ISA_AVX512;
    }
    const int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) return ISA_AVX2;
    return ISA_PORTABLE;
}

/* The rows of a call: row r < nr, else row 0 again (read, never written). */
#define ROWS4(T, base, stride)                                                                          \
    const T *w0 = (base), *w1 = (base) + (nr > 1 ? (stride) : 0), *w2 = (base) + (nr > 2 ? 2 * (stride) : 0), \
            *w3 = (base) + (nr > 3 ? 3 * (stride) : 0)

#ifndef PREFETCH
#define PREFETCH 1024
#endif
/* Ask for the cache lines of the four rows PREFETCH bytes past byte b of each, over the span of
   `bytes` bytes a step reads of a row (see the note at the top). */
#define PREFETCH4(b, bytes)                                                                             \
    for (i64 l_ = 0; l_ < (bytes); l_ += 64) {                                                          \
        _mm_prefetch((const char *)w0 + (b) + PREFETCH + l_, _MM_HINT_T0);                              \
        _mm_prefetch((const char *)w1 + (b) + PREFETCH + l_, _MM_HINT_T0);                              \
        _mm_prefetch((const char *)w2 + (b) + PREFETCH + l_, _MM_HINT_T0);                              \
        _mm_prefetch((const char *)w3 + (b) + PREFETCH + l_, _MM_HINT_T0);                              \
    }

/* The inputs from .. n-1 of each of the four rows (past the last full vector, or block), one at
   a time, added to s[r]: times scale[r] (the partial block's scale) when scale is not NULL. */
static inline void tail_rows(const WMat *W, const void *const *rows, i64 from, i64 n, const float *scale,
                             const float *x, float *s) {
    for (int r = 0; r < 4; r++) {
        float acc = 0;
        for (i64 i = from; i < n; i++) {
            float w;
            switch (W->type) {
            case W_BF16: w = bf16_to_f32(((const uint16_t *)rows[r])[i]); break;
            case W_F16: w = f16_to_f32(((const uint16_t *)rows[r])[i]); break;
            case W_Q8: w = (float)((const int8_t *)rows[r])[i]; break;
            case W_Q4: w = (float)q4_at((const uint8_t *)rows[r] + i / QBLOCK * (QBLOCK / 2), i % QBLOCK); break;
            default: w = ((const float *)rows[r])[i];
            }
            acc += w * x[i];
        }
        s[r] += scale ? acc * scale[r] : acc;
    }
}

/* ------------------------------------------------------------------ AVX-512F: 16 lanes */

#define T512 __attribute__((target("avx512f")))

static T512 inline __m512 ld_f32_512(const float *p) { return _mm512_loadu_ps(p); }
static T512 inline __m512 ld_bf16_512(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static T512 inline __m512 ld_f16_512(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* f32, bf16, f16: 32 inputs a step, two sums a row (eight chains of FMAs in flight). */
#define DOT4_512(NAME, T, LOAD)                                                                          \
    static T512 void NAME(const WMat *W, i64 n, i64 o, i64 nr, const float *x, float *y) {             \
        ROWS4(T, (const T *)W->w + o * n, n);                                                           \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0; \
        i64 i = 0;                                                                                      \
        for (; i + 32 <= n; i += 32) {                                                                  \
            if (sizeof(T) < 4) PREFETCH4(i * (i64)sizeof(T), 32 * (i64)sizeof(T)); \
            const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);                 \
            a0 = _mm512_fmadd_ps(LOAD(w0 + i), x0, a0);                                                 \
            a1 = _mm512_fmadd_ps(LOAD(w1 + i), x0, a1);                                                 \
            a2 = _mm512_fmadd_ps(LOAD(w2 + i), x0, a2);                                                 \
            a3 = _mm512_fmadd_ps(LOAD(w3 + i), x0, a3);                                                 \
            b0 = _mm512_fmadd_ps(LOAD(w0 + i + 16), x1, b0);                                            \
            b1 = _mm512_fmadd_ps(LOAD(w1 + i + 16), x1, b1);                                            \
            b2 = _mm512_fmadd_ps(LOAD(w2 + i + 16), x1, b2);                                            \
            b3 = _mm512_fmadd_ps(LOAD(w3 + i + 16), x1, b3);                                            \
        }                                                                                               \
        for (; i + 16 <= n; i += 16) {                                                                  \
            const __m512 x0 = _mm512_loadu_ps(x + i);                                                   \
            a0 = _mm512_fmadd_ps(LOAD(w0 + i), x0, a0);                                                 \
            a1 = _mm512_fmadd_ps(LOAD(w1 + i), x0, a1);                                                 \
            a2 = _mm512_fmadd_ps(LOAD(w2 + i), x0, a2);                                                 \
            a3 = _mm512_fmadd_ps(LOAD(w3 + i), x0, a3);                                                 \
        }                                                                                               \
        float s[4] = {_mm512_reduce_add_ps(_mm512_add_ps(a0, b0)), _mm512_reduce_add_ps(_mm512_add_ps(a1, b1)), \
                      _mm512_reduce_add_ps(_mm512_add_ps(a2, b2)), _mm512_reduce_add_ps(_mm512_add_ps(a3, b3))}; \
        const void *rows[4] = {w0, w1, w2, w3};                                                         \
        tail_rows(W, rows, i, n, NULL, x, s);                                                              \
        for (i64 r = 0; r < nr; r++) y[r] = s[r];                                                       \
    }

DOT4_512(dot4_f32_512, float, ld_f32_512)
DOT4_512(dot4_bf16_512, uint16_t, ld_bf16_512)
DOT4_512(dot4_f16_512, uint16_t, ld_f16_512)

/* One row's block of 32 int8 (or int4 already unpacked to int8: lo = inputs 0-15, hi = 16-31)
   against x0, x1, its scale applied once to the block's sum. */
static T512 inline __m512 block_512(__m128i lo, __m128i hi, __m512 x0, __m512 x1, float scale, __m512 acc) {
    const __m512 p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), x1,
                                     _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), x0));
    return _mm512_fmadd_ps(p, _mm512_set1_ps(scale), acc);
}

/* W_Q8 and W_Q4: one block of 32 inputs a step; the last, partial block in tail_rows. */
#define DOT4_Q_512(NAME, T, ROWLEN, BB, UNPACK)                                                              \
    static T512 void NAME(const WMat *W, i64 n, i64 o, i64 nr, const float *x, float *y) {             \
        const i64 nb = (n + QBLOCK - 1) / QBLOCK, full = n / QBLOCK;                                    \
        ROWS4(T, (const T *)W->w + o * (ROWLEN), ROWLEN);                                               \
        const float *sc = W->scale + o * nb, *s0 = sc, *s1 = sc + (nr > 1 ? nb : 0);                    \
        const float *s2 = sc + (nr > 2 ? 2 * nb : 0), *s3 = sc + (nr > 3 ? 3 * nb : 0);                 \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                     \
        __m128i lo, hi;                                                                                 \
        for (i64 j = 0; j < full; j++) {                                                                \
            PREFETCH4(j * (BB), 64);                                                                     \
            const __m512 x0 = _mm512_loadu_ps(x + j * QBLOCK), x1 = _mm512_loadu_ps(x + j * QBLOCK + 16); \
            UNPACK(w0, j);                                                                              \
            a0 = block_512(lo, hi, x0, x1, s0[j], a0);                                                  \
            UNPACK(w1, j);                                                                              \
            a1 = block_512(lo, hi, x0, x1, s1[j], a1);                                                  \
            UNPACK(w2, j);                                                                              \
            a2 = block_512(lo, hi, x0, x1, s2[j], a2);                                                  \
            UNPACK(w3, j);                                                                              \
            a3 = block_512(lo, hi, x0, x1, s3[j], a3);                                                  \
        }                                                                                               \
        float s[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2),     \
                      _mm512_reduce_add_ps(a3)};                                                        \
        const void *rows[4] = {w0, w1, w2, w3};                                                         \
        if (full < nb) {                                                                                \
            const float last[4] = {s0[full], s1[full], s2[full], s3[full]};                             \
            tail_rows(W, rows, full * QBLOCK, n, last, x, s);                                           \
        }                                                                                               \
        for (i64 r = 0; r < nr; r++) y[r] = s[r];                                                       \
    }

/* int8: a block is 32 bytes; int4: 16 bytes, low nibbles the first 16 inputs, high the last 16. */
#define UNPACK_Q8(w, j)                                                                                 \
    lo = _mm_loadu_si128((const __m128i *)((w) + (j) * QBLOCK));                                        \
    hi = _mm_loadu_si128((const __m128i *)((w) + (j) * QBLOCK + 16))
#define UNPACK_Q4(w, j)                                                                                 \
    hi = _mm_loadu_si128((const __m128i *)((w) + (j) * (QBLOCK / 2)));                                  \
    lo = _mm_sub_epi8(_mm_and_si128(hi, _mm_set1_epi8(15)), _mm_set1_epi8(8));                          \
    hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(hi, 4), _mm_set1_epi8(15)), _mm_set1_epi8(8))

DOT4_Q_512(dot4_q8_512, int8_t, n, QBLOCK, UNPACK_Q8)
DOT4_Q_512(dot4_q4_512, uint8_t, nb *(QBLOCK / 2), QBLOCK / 2, UNPACK_Q4)

/* ------------------------------------------------------------------ AVX2 + FMA + F16C: 8 lanes */

#define T256 __attribute__((target("avx2,fma,f16c")))

static T256 inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static T256 inline __m256 ld_f32_256(const float *p) { return _mm256_loadu_ps(p); }
static T256 inline __m256 ld_bf16_256(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static T256 inline __m256 ld_f16_256(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* f32, bf16, f16: 16 inputs a step, two sums a row. */
#define DOT4_256(NAME, T, LOAD)                                                                          \
    static T256 void NAME(const WMat *W, i64 n, i64 o, i64 nr, const float *x, float *y) {             \
        ROWS4(T, (const T *)W->w + o * n, n);                                                           \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0; \
        i64 i = 0;                                                                                      \
        for (; i + 16 <= n; i += 16) {                                                                  \
            if (sizeof(T) < 4) PREFETCH4(i * (i64)sizeof(T), 16 * (i64)sizeof(T)); \
            const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);                  \
            a0 = _mm256_fmadd_ps(LOAD(w0 + i), x0, a0);                                                 \
            a1 = _mm256_fmadd_ps(LOAD(w1 + i), x0, a1);                                                 \
            a2 = _mm256_fmadd_ps(LOAD(w2 + i), x0, a2);                                                 \
            a3 = _mm256_fmadd_ps(LOAD(w3 + i), x0, a3);                                                 \
            b0 = _mm256_fmadd_ps(LOAD(w0 + i + 8), x1, b0);                                             \
            b1 = _mm256_fmadd_ps(LOAD(w1 + i + 8), x1, b1);                                             \
            b2 = _mm256_fmadd_ps(LOAD(w2 + i + 8), x1, b2);                                             \
            b3 = _mm256_fmadd_ps(LOAD(w3 + i + 8), x1, b3);                                             \
        }                                                                                               \
        float s[4] = {hsum256(_mm256_add_ps(a0, b0)), hsum256(_mm256_add_ps(a1, b1)),                   \
                      hsum256(_mm256_add_ps(a2, b2)), hsum256(_mm256_add_ps(a3, b3))};                  \
        const void *rows[4] = {w0, w1, w2, w3};                                                         \
        tail_rows(W, rows, i, n, NULL, x, s);                                                           \
        for (i64 r = 0; r < nr; r++) y[r] = s[r];                                                       \
    }

DOT4_256(dot4_f32_256, float, ld_f32_256)
DOT4_256(dot4_bf16_256, uint16_t, ld_bf16_256)
DOT4_256(dot4_f16_256, uint16_t, ld_f16_256)

static T256 inline __m256 cvt8_256(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

/* As block_512: lo holds inputs 0-15 of the block, hi 16-31, as int8. */
static T256 inline __m256 block_256(__m128i lo, __m128i hi, const float *xb, float scale, __m256 acc) {
    __m256 p = _mm256_mul_ps(cvt8_256(lo), _mm256_loadu_ps(xb));
    p = _mm256_fmadd_ps(cvt8_256(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xb + 8), p);
    p = _mm256_fmadd_ps(cvt8_256(hi), _mm256_loadu_ps(xb + 16), p);
    p = _mm256_fmadd_ps(cvt8_256(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xb + 24), p);
    return _mm256_fmadd_ps(p, _mm256_set1_ps(scale), acc);
}

#define DOT4_Q_256(NAME, T, ROWLEN, BB, UNPACK)                                                              \
    static T256 void NAME(const WMat *W, i64 n, i64 o, i64 nr, const float *x, float *y) {             \
        const i64 nb = (n + QBLOCK - 1) / QBLOCK, full = n / QBLOCK;                                    \
        ROWS4(T, (const T *)W->w + o * (ROWLEN), ROWLEN);                                               \
        const float *sc = W->scale + o * nb, *s0 = sc, *s1 = sc + (nr > 1 ? nb : 0);                    \
        const float *s2 = sc + (nr > 2 ? 2 * nb : 0), *s3 = sc + (nr > 3 ? 3 * nb : 0);                 \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                     \
        __m128i lo, hi;                                                                                 \
        for (i64 j = 0; j < full; j++) {                                                                \
            PREFETCH4(j * (BB), 64);                                                                     \
            const float *xb = x + j * QBLOCK;                                                           \
            UNPACK(w0, j);                                                                              \
            a0 = block_256(lo, hi, xb, s0[j], a0);                                                      \
            UNPACK(w1, j);                                                                              \
            a1 = block_256(lo, hi, xb, s1[j], a1);                                                      \
            UNPACK(w2, j);                                                                              \
            a2 = block_256(lo, hi, xb, s2[j], a2);                                                      \
            UNPACK(w3, j);                                                                              \
            a3 = block_256(lo, hi, xb, s3[j], a3);                                                      \
        }                                                                                               \
        float s[4] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};                              \
        const void *rows[4] = {w0, w1, w2, w3};                                                         \
        if (full < nb) {                                                                                \
            const float last[4] = {s0[full], s1[full], s2[full], s3[full]};                             \
            tail_rows(W, rows, full * QBLOCK, n, last, x, s);                                           \
        }                                                                                               \
        for (i64 r = 0; r < nr; r++) y[r] = s[r];                                                       \
    }

DOT4_Q_256(dot4_q8_256, int8_t, n, QBLOCK, UNPACK_Q8)
DOT4_Q_256(dot4_q4_256, uint8_t, nb *(QBLOCK / 2), QBLOCK / 2, UNPACK_Q4)

/* ------------------------------------------------------------------ int8 activations */

/* The integer kernels: y[r] = Σ_j (w scale_rj · d_j) · Σ_k w_rjk · q_jk for nr ≤ 4 rows, q the
   int8 activations (32·nb values, zero past n), d their scales. A W_Q8 row holds exactly n
   bytes, so its last block, when short, is summed one input at a time (qtail_rows); a W_Q4 row
   is padded to whole blocks (nibbles of 8: zero) and read whole. */
static inline void qtail_rows(const WMat *W, i64 n, i64 o, i64 nr, const int8_t *q, const float *d, float *s) {
    const i64 nb = (n + QBLOCK - 1) / QBLOCK, j = n / QBLOCK;
    if (W->type != W_Q8 || j == nb) return;
    for (i64 r = 0; r < nr; r++) {
        const int8_t *w = (const int8_t *)W->w + (o + r) * n;
        int32_t t = 0;
        for (i64 i = j * QBLOCK; i < n; i++) t += (int32_t)w[i] * q[i];
        s[r] += (float)t * (W->scale[(o + r) * nb + j] * d[j]);
    }
}

/* The blocks a kernel reads whole: the full ones of a W_Q8 row, all of a W_Q4 row. */
static inline i64 whole_blocks(const WMat *W, i64 n) {
    return W->type == W_Q8 ? n / QBLOCK : (n + QBLOCK - 1) / QBLOCK;
}

/* The four rows' bytes and scales of a call on rows o .. o+nr-1 (a row past nr: row o again,
   read, never written). */
static inline void qrows4(const WMat *W, i64 n, i64 o, i64 nr, const uint8_t *w[4], const float *sc[4]) {
    const i64 nb = (n + QBLOCK - 1) / QBLOCK, rowlen = W->type == W_Q4 ? nb * (QBLOCK / 2) : n;
    for (int r = 0; r < 4; r++) {
        w[r] = (const uint8_t *)W->w + (o + (r < nr ? r : 0)) * rowlen;
        sc[r] = W->scale + (o + (r < nr ? r : 0)) * nb;
    }
}

/* AVX2: one block (32 inputs) a step. A W_Q8 block: |w| · (q with w's sign), vpmaddubsw into 16
   pairs, vpmaddwd into 8 sums (|w| ≤ 128, |q| ≤ 127: a pair stays inside int16). A W_Q4 block:
   the nibbles (0..15) times q, less 8 · Σq (computed once for the four rows). */
static T256 inline __m256i q4_block_256(const uint8_t *b) {
    const __m128i v = _mm_loadu_si128((const __m128i *)b), m = _mm_set1_epi8(15);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, m)),
                                   _mm_and_si128(_mm_srli_epi16(v, 4), m), 1);
}

static T256 void qdot4_256(const WMat *W, i64 n, i64 o, i64 nr, const int8_t *q, const float *d, float *y) {
    const i64 whole = whole_blocks(W, n), q4 = W->type == W_Q4;
    const uint8_t *w[4], *w0, *w1, *w2, *w3;
    const float *sc[4];
    qrows4(W, n, o, nr, w, sc);
    w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3]; /* PREFETCH4's names */
    const __m256i ones = _mm256_set1_epi16(1), eights = _mm256_set1_epi8(8);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (i64 j = 0; j < whole; j++) {
        PREFETCH4(j * (q4 ? QBLOCK / 2 : QBLOCK), 64);
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + j * QBLOCK));
        const __m256i off = q4 ? _mm256_madd_epi16(_mm256_maddubs_epi16(eights, qv), ones) : _mm256_setzero_si256();
        for (int r = 0; r < 4; r++) {
            __m256i isum;
            if (q4) {
                isum = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q4_block_256(w[r] + j * (QBLOCK / 2)), qv), ones), off);
            } else {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w[r] + j * QBLOCK));
                isum = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(qv, wv)), ones);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(sc[r][j] * d[j]), acc[r]);
        }
    }
    float s[4] = {hsum256(acc[0]), hsum256(acc[1]), hsum256(acc[2]), hsum256(acc[3])};
    qtail_rows(W, n, o, nr, q, d, s);
    for (i64 r = 0; r < nr; r++) y[r] = s[r];
}

/* AVX-512 VNNI: two blocks (64 inputs) a step, vpdpbusd (unsigned × signed bytes, four products
   a lane into int32). W_Q8: |w| times q with w's sign, lanes 0-7 block j, 8-15 block j + 1.
   W_Q4: the two blocks' 32 bytes give [low nibbles j, j + 1 | high nibbles j, j + 1], so q is
   permuted to match (128-bit lanes 0, 2, 1, 3) and each lane's sum starts from −8 · Σq. An odd
   last block runs the same in 256 bits. */
#define TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

static TVNNI inline __m512i q4_pair_512(const uint8_t *b) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)b), m = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m)),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 1);
}

/* Two consecutive floats p[0], p[1] spread over the 16 lanes as `pick` (0 or 1 a lane) says. */
static TVNNI inline __m512 pair_lanes(__m512i pick, const float *p) {
    return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)p))));
}

static TVNNI void qdot4_vnni(const WMat *W, i64 n, i64 o, i64 nr, const int8_t *q, const float *d, float *y) {
    const i64 whole = whole_blocks(W, n), q4 = W->type == W_Q4, bb = q4 ? QBLOCK / 2 : QBLOCK;
    const uint8_t *w[4], *w0, *w1, *w2, *w3;
    const float *sc[4];
    qrows4(W, n, o, nr, w, sc);
    w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3]; /* PREFETCH4's names */
    /* the lanes' blocks: W_Q8 8 lanes of j then 8 of j + 1; W_Q4 4, 4, 4, 4 of j, j + 1, j, j + 1 */
    const __m512i pick = q4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                            : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i zero = _mm512_setzero_si512(), eights = _mm512_set1_epi8(8);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    i64 j = 0;
    for (; j + 2 <= whole; j += 2) {
        PREFETCH4(j * bb, 2 * bb);
        __m512i qv = _mm512_loadu_si512((const void *)(q + j * QBLOCK));
        if (q4) qv = _mm512_shuffle_i64x2(qv, qv, _MM_SHUFFLE(3, 1, 2, 0));
        const __m512i start = q4 ? _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, eights, qv)) : zero;
        const __m512 dv = pair_lanes(pick, d + j);
        for (int r = 0; r < 4; r++) {
            __m512i isum;
            if (q4) {
                isum = _mm512_dpbusd_epi32(start, q4_pair_512(w[r] + j * bb), qv);
            } else {
                const __m512i wv = _mm512_loadu_si512((const void *)(w[r] + j * bb));
                const __m512i sq = _mm512_mask_sub_epi8(qv, _mm512_movepi8_mask(wv), zero, qv);
                isum = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wv), sq);
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(pair_lanes(pick, sc[r] + j), dv), acc[r]);
        }
    }
    float s[4] = {_mm512_reduce_add_ps(acc[0]), _mm512_reduce_add_ps(acc[1]), _mm512_reduce_add_ps(acc[2]),
                  _mm512_reduce_add_ps(acc[3])};
    if (j < whole) { /* an odd last block, 256 bits */
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + j * QBLOCK)), z = _mm256_setzero_si256();
        const __m256i start = q4 ? _mm256_sub_epi32(z, _mm256_dpbusd_epi32(z, _mm256_set1_epi8(8), qv)) : z;
        for (int r = 0; r < 4; r++) {
            __m256i isum;
            if (q4) {
                isum = _mm256_dpbusd_epi32(start, q4_block_256(w[r] + j * bb), qv);
            } else {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w[r] + j * bb));
                isum = _mm256_dpbusd_epi32(z, _mm256_abs_epi8(wv), _mm256_mask_sub_epi8(qv, _mm256_movepi8_mask(wv), z, qv));
            }
            s[r] += hsum256(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(sc[r][j] * d[j])));
        }
    }
    qtail_rows(W, n, o, nr, q, d, s);
    for (i64 r = 0; r < nr; r++) y[r] = s[r];
}

/* ------------------------------------------------------------------ dispatch */

static int cpu_isa_cached = -1; /* ssm_cpu_isa(), asked once (a benign race: every thread writes the same) */

/* The level a product of W runs at on a CPU whose best level is cpu: W->isa if that CPU runs
   it, else ISA_PORTABLE (never an instruction the CPU lacks). */
static inline int isa_on(const WMat *W, int cpu) {
    return W->isa <= ISA_PORTABLE || W->isa > cpu || W->isa > ISA_AVX512_VNNI ? ISA_PORTABLE : (int)W->isa;
}
static inline int isa_run(const WMat *W) {
    if (W->isa == ISA_PORTABLE) return ISA_PORTABLE;
    if (cpu_isa_cached < 0) cpu_isa_cached = ssm_cpu_isa();
    return isa_on(W, cpu_isa_cached);
}

/* Every kernel with its name (the function's own identifier), so that what the dispatch picks
   can be asked by name (ssm_decode_kernel) through the same code that picks it. */
typedef void (*Dot4)(const WMat *, i64, i64, i64, const float *, float *);
typedef void (*QDot4)(const WMat *, i64, i64, i64, const int8_t *, const float *, float *);
typedef struct { const char *name; Dot4 fn; } DotKernel;
typedef struct { const char *name; QDot4 fn; } QDotKernel;
#define NAMED(fn) {#fn, fn}
static const DotKernel DOT4[2][5] = {
    {NAMED(dot4_f32_256), NAMED(dot4_bf16_256), NAMED(dot4_f16_256), NAMED(dot4_q8_256), NAMED(dot4_q4_256)},
    {NAMED(dot4_f32_512), NAMED(dot4_bf16_512), NAMED(dot4_f16_512), NAMED(dot4_q8_512), NAMED(dot4_q4_512)},
};
static const QDotKernel QDOT4[2] = {NAMED(qdot4_256), NAMED(qdot4_vnni)};

/* The kernel of W's float products at level isa, or NULL for the portable code. */
static const DotKernel *dot_kernel(const WMat *W, int isa) {
    if (isa == ISA_PORTABLE || W->type < W_REAL || W->type > W_Q4) return NULL;
    return &DOT4[isa >= ISA_AVX512 ? 1 : 0][W->type];
}

/* The kernel of W's int8-activation products at level isa, or NULL for the portable code. The
   VNNI kernel only at the VNNI level: an AVX-512 CPU without VNNI takes AVX2's. */
static const QDotKernel *qdot_kernel(const WMat *W, int isa) {
    (void)W;
    if (isa == ISA_PORTABLE) return NULL;
    return &QDOT4[isa == ISA_AVX512_VNNI ? 1 : 0];
}

/* y[r] = row o + r of W times x (r < nr ≤ 4) at level W->isa; 0 (nothing done) where that level
   is portable or above what this CPU runs: the caller then runs the portable code. */
static int simd_dot_rows(const WMat *W, i64 n, i64 o, i64 nr, const float *x, float *y) {
    const DotKernel *k = dot_kernel(W, isa_run(W));
    if (!k) return 0;
    k->fn(W, n, o, nr, x, y);
    return 1;
}

/* The same for int8 activations q (scales d) and a W_Q8 / W_Q4 matrix. */
static int simd_qdot_rows(const WMat *W, i64 n, i64 o, i64 nr, const int8_t *q, const float *d, float *y) {
    const QDotKernel *k = qdot_kernel(W, isa_run(W));
    if (!k) return 0;
    k->fn(W, n, o, nr, q, d, y);
    return 1;
}

/* The name of the kernel a float32 step's product with a matrix of this type (W_*) and
   activations (ACT_*) runs when its products ask for level isa on a CPU whose best level is cpu
   (-1: this CPU): the function the dispatch above calls, or "portable" / "qdot_rows_portable".
   For tests: which instructions each SSM_CPU_ISA level runs, whatever CPU runs the test. */
const char *ssm_decode_kernel(i64 isa, i64 type, i64 act, i64 cpu) {
    WMat W = {NULL, NULL, type, isa, act};
    if (cpu < 0) {
        if (cpu_isa_cached < 0) cpu_isa_cached = ssm_cpu_isa();
        cpu = cpu_isa_cached;
    }
    const int level = isa_on(&W, (int)cpu);
    if (takes_int8_acts(&W)) {
        const QDotKernel *k = qdot_kernel(&W, level);
        return k ? k->name : "qdot_rows_portable";
    }
    const DotKernel *k = dot_kernel(&W, level);
    return k ? k->name : "portable";
}

#else /* not x86, or a compiler without target attributes: the portable code only */

int ssm_cpu_isa(void) { return ISA_PORTABLE; }
static inline int simd_dot_rows(const WMat *W, i64 n, i64 o, i64 nr, const float *x, float *y) {
    (void)W, (void)n, (void)o, (void)nr, (void)x, (void)y;
    return 0;
}
static inline int simd_qdot_rows(const WMat *W, i64 n, i64 o, i64 nr, const int8_t *q, const float *d, float *y) {
    (void)W, (void)n, (void)o, (void)nr, (void)q, (void)d, (void)y;
    return 0;
}
const char *ssm_decode_kernel(i64 isa, i64 type, i64 act, i64 cpu) {
    const WMat W = {NULL, NULL, type, isa, act};
    (void)cpu;
    return takes_int8_acts(&W) ? "qdot_rows_portable" : "portable";
}

#endif
