/* The weight matrices of the decoding steps (decode.c, decode_mamba2.c) in any of their storage
   formats, read and widened to REAL in registers: the projections y = W·x of one token. The
   activations, the states and every sum stay in REAL (float32 for the low-precision formats);
   only the matrices are narrow, since a batch-1 step is bound by reading them. library.c
   includes this file once per REAL, before decode.c: the types the first time only.

   Formats (WMat.type), for a matrix of n_out rows of n inputs:
     W_REAL  REAL (n_out, n), the dtype of the step;
     W_BF16  bfloat16 (n_out, n): the high half of a float32;
     W_F16   IEEE half (n_out, n), widened exactly (subnormals too);
     W_Q8    int8 (n_out, n) and float32 scales (n_out, nb), nb = ceil(n / 32): w = q·scale of
             its block of 32 inputs (the last block of a row may be shorter);
     W_Q4    bytes (n_out, 16·nb) and float32 scales (n_out, nb): block j of a row is 16 bytes,
             byte k holding input 32j + k in its low nibble and 32j + 16 + k in its high one,
             w = (nibble − 8)·scale (padding nibbles hold 8: zero). */

#ifndef SSM_DECODE_WEIGHTS_TYPES
#define SSM_DECODE_WEIGHTS_TYPES

#define DOT_LANES 16 /* partial sums per row of a decoding step's dot products */

enum { W_REAL = 0, W_BF16 = 1, W_F16 = 2, W_Q8 = 3, W_Q4 = 4 };
#define QBLOCK 32 /* inputs per scale of W_Q8 / W_Q4 */

/* A matrix as the steps read it: its data, its scales (W_Q8, W_Q4; else NULL), its format, the
   instruction set its products run in (decode_simd.c's ISA_*; float32 steps only), and act:
   ACT_I8 for a W_Q8 / W_Q4 matrix whose products take int8 activations (below), else ACT_F. */
typedef struct {
    const void *w;
    const float *scale;
    i64 type, isa, act;
} WMat;

/* Activations rounded to int8 (ACT_I8; float32 steps only): the input x of a product with a W_Q8
   or W_Q4 matrix, per block of 32 inputs, d = max|x| / 127 and q = round(x / d) (to nearest,
   ties to even, as x · (1 / d) in float32), so that a block's products are integers summed
   exactly, scaled once by (weight scale · d): the dot products run in integer instructions
   (decode_simd.c: AVX2's vpmaddubsw, AVX-512 VNNI's vpdpbusd), as llama.cpp's q8_0 / q4_0 do.
   The price is the activations' rounding: at most d / 2 an input, a relative 1/254 of its
   block's largest. A block holding a NaN or an infinity gives d = NaN: its outputs are NaN. */
enum { ACT_F = 0, ACT_I8 = 1 };

/* Whether W's products take int8 activations (the integer kernels) rather than float ones. */
static inline int takes_int8_acts(const WMat *W) { return W->act == ACT_I8 && (W->type == W_Q8 || W->type == W_Q4); }

/* The int8 activations of nrows inputs of n values: row b's q at q + b·qs (qs = 32·nb, the last
   block padded with zeros), its scales at d + b·nb. */
typedef struct {
    const int8_t *q;
    const float *d;
    i64 qs, nb;
} QAct;

static void quantize_act_row(const float *x, i64 n, int8_t *q, float *d) {
    const i64 nb = (n + QBLOCK - 1) / QBLOCK;
    for (i64 j = 0; j < nb; j++) {
        const i64 i0 = j * QBLOCK, len = n - i0 < QBLOCK ? n - i0 : QBLOCK;
        const float *xb = x + i0;
        int8_t *qb = q + i0;
        float amax = 0;
        int finite = 1;
        for (i64 k = 0; k < len; k++) {
            const float a = fabsf(xb[k]);
            finite &= a <= FLT_MAX; /* false for an infinity and a NaN */
            amax = a > amax ? a : amax;
        }
        const float dj = amax / 127.0f, id = amax > 0 ? 1.0f / dj : 0.0f;
        d[j] = finite ? dj : NAN;
        if (finite && len == QBLOCK) { /* a plain loop, which the compiler vectorises */
            for (int k = 0; k < QBLOCK; k++) qb[k] = (int8_t)nearbyintf(xb[k] * id);
        } else {
            for (i64 k = 0; k < QBLOCK; k++) qb[k] = finite && k < len ? (int8_t)nearbyintf(xb[k] * id) : 0;
        }
    }
}

/* Per thread, the int8 activations of the product it is about to run (each thread rounds the
   whole input itself: no barrier, and the input is at most a few thousand values a row). The
   buffer grows and is kept for the thread's life. */
static __thread int8_t *act_q;
static __thread float *act_d;
static __thread i64 act_cap;

/* The int8 activations of rows x + b·sx (b < nrows, n values each) for a product with W, in
   this thread's buffer; q NULL (the float path) unless W takes int8 activations. */
static QAct quantize_acts(const WMat *W, const float *x, i64 sx, i64 nrows, i64 n) {
    QAct a = {NULL, NULL, 0, 0};
    if (!takes_int8_acts(W)) return a;
    a.nb = (n + QBLOCK - 1) / QBLOCK;
    a.qs = a.nb * QBLOCK;
    if (nrows * a.qs > act_cap) {
        free(act_q);
        free(act_d);
        act_q = malloc((size_t)(nrows * a.qs));
        act_d = malloc((size_t)(nrows * a.nb) * sizeof(float));
        act_cap = act_q && act_d ? nrows * a.qs : 0;
        if (!act_cap) return a; /* out of memory: the float path, which needs no buffer */
    }
    for (i64 b = 0; b < nrows; b++) quantize_act_row(x + b * sx, n, act_q + b * a.qs, act_d + b * a.nb);
    a.q = act_q;
    a.d = act_d;
    return a;
}

/* y[r] = row o + r of a W_Q8 / W_Q4 matrix W (n inputs) times the int8 activations q (scales
   d), r < nr: one row at a time, each block's integer sum exact, scaled by (w scale · d) and
   added in order. The portable code; decode_simd.c has the same in intrinsics. */
static void qdot_rows_portable(const WMat *W, i64 n, i64 o, i64 nr, const int8_t *q, const float *d, float *y) {
    const i64 nb = (n + QBLOCK - 1) / QBLOCK;
    for (i64 r = 0; r < nr; r++) {
        const float *sc = W->scale + (o + r) * nb;
        float acc = 0;
        for (i64 j = 0; j < nb; j++) {
            const int8_t *qb = q + j * QBLOCK;
            int32_t s = 0;
            if (W->type == W_Q8) {
                const int8_t *w = (const int8_t *)W->w + (o + r) * n + j * QBLOCK;
                const i64 len = n - j * QBLOCK < QBLOCK ? n - j * QBLOCK : QBLOCK;
                for (i64 k = 0; k < len; k++) s += (int32_t)w[k] * qb[k];
            } else { /* padding nibbles hold 8 (zero), and q is zero past n */
                const uint8_t *b = (const uint8_t *)W->w + ((o + r) * nb + j) * (QBLOCK / 2);
                for (int k = 0; k < QBLOCK / 2; k++)
                    s += ((b[k] & 15) - 8) * qb[k] + ((b[k] >> 4) - 8) * qb[k + QBLOCK / 2];
            }
            acc += (float)s * (sc[j] * d[j]);
        }
        y[r] = acc;
    }
}

/* Input t (0 <= t < 32) of a W_Q4 block of 16 bytes, as its integer (nibble − 8). */
static inline int q4_at(const uint8_t *block, i64 t) { return (t < 16 ? block[t & 15] & 15 : block[t & 15] >> 4) - 8; }

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* Branch-free (it vectorises): the magnitude's bits shifted into a float's place, times 2^112
   to move the exponent's bias from 15 to 127 (exact, subnormals included); inf / NaN kept. */
static inline float f16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } mag, special, out;
    mag.u = (uint32_t)(h & 0x7fff) << 13;
    special.u = mag.u | 0x7f800000u;
    out.f = (h & 0x7c00) == 0x7c00 ? special.f : mag.f * 0x1p112f;
    out.u |= (uint32_t)(h & 0x8000) << 16;
    return out.f;
}

/* The body of a dot_rows over a 16-bit format: decode.c's dot_rows with each weight widened by
   WIDEN. Defined as a macro so that the compiler sees a plain loop over uint16_t per format. */
#define SSM_DOT_ROWS_U16(NAME, WIDEN)                                                                   \
    static inline void NAME(const uint16_t *W, i64 n, i64 nr, const REAL *x, REAL *y) {                \
        const uint16_t *w0 = W, *w1 = W + (nr > 1 ? n : 0), *w2 = W + (nr > 2 ? 2 * n : 0);             \
        const uint16_t *w3 = W + (nr > 3 ? 3 * n : 0);                                                  \
        REAL a0[DOT_LANES] = {0}, a1[DOT_LANES] = {0}, a2[DOT_LANES] = {0}, a3[DOT_LANES] = {0};        \
        REAL s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                                            \
        i64 i = 0;                                                                                      \
        for (; i + DOT_LANES <= n; i += DOT_LANES) {                                                    \
            _Pragma("omp simd") for (int k = 0; k < DOT_LANES; k++) {                                   \
                const REAL xv = x[i + k];                                                               \
                a0[k] += (REAL)WIDEN(w0[i + k]) * xv;                                                   \
                a1[k] += (REAL)WIDEN(w1[i + k]) * xv;                                                   \
                a2[k] += (REAL)WIDEN(w2[i + k]) * xv;                                                   \
                a3[k] += (REAL)WIDEN(w3[i + k]) * xv;                                                   \
            }                                                                                           \
        }                                                                                               \
        for (; i < n; i++) {                                                                            \
            s0 += (REAL)WIDEN(w0[i]) * x[i];                                                            \
            s1 += (REAL)WIDEN(w1[i]) * x[i];                                                            \
            s2 += (REAL)WIDEN(w2[i]) * x[i];                                                            \
            s3 += (REAL)WIDEN(w3[i]) * x[i];                                                            \
        }                                                                                               \
        for (int k = 0; k < DOT_LANES; k++) {                                                           \
            s0 += a0[k];                                                                                \
            s1 += a1[k];                                                                                \
            s2 += a2[k];                                                                                \
            s3 += a3[k];                                                                                \
        }                                                                                               \
        const REAL sums[4] = {s0, s1, s2, s3};                                                          \
        for (i64 r = 0; r < nr; r++) y[r] = sums[r];                                                    \
    }

#include "decode_simd.c"

#endif /* SSM_DECODE_WEIGHTS_TYPES */

/* ------------------------------------------------------------------ for one REAL */

/* y[r] = W[r]·x for the nr ≤ 4 rows of W (n apart), read side by side in DOT_LANES partial sums
   each: one row at a time with one running sum waits on each add's latency and keeps too few
   reads in flight; four rows sharing x's loads read the weights at the machine's bandwidth,
   which decoding is bound by (measured: as fast as torch's gemv; one row at a time 1.3x slower). */
static inline void SUF(dot_rows)(const REAL *W, i64 n, i64 nr, const REAL *x, REAL *y) {
    const REAL *w0 = W, *w1 = W + (nr > 1 ? n : 0), *w2 = W + (nr > 2 ? 2 * n : 0), *w3 = W + (nr > 3 ? 3 * n : 0);
    REAL a0[DOT_LANES] = {0}, a1[DOT_LANES] = {0}, a2[DOT_LANES] = {0}, a3[DOT_LANES] = {0};
    REAL s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    i64 i = 0;
    for (; i + DOT_LANES <= n; i += DOT_LANES) {
#pragma omp simd
        for (int k = 0; k < DOT_LANES; k++) {
            const REAL xv = x[i + k];
            a0[k] += w0[i + k] * xv;
            a1[k] += w1[i + k] * xv;
            a2[k] += w2[i + k] * xv;
            a3[k] += w3[i + k] * xv;
        }
    }
    for (; i < n; i++) {
        s0 += w0[i] * x[i];
        s1 += w1[i] * x[i];
        s2 += w2[i] * x[i];
        s3 += w3[i] * x[i];
    }
    for (int k = 0; k < DOT_LANES; k++) {
        s0 += a0[k];
        s1 += a1[k];
        s2 += a2[k];
        s3 += a3[k];
    }
    const REAL sums[4] = {s0, s1, s2, s3};
    for (i64 r = 0; r < nr; r++) y[r] = sums[r];
}

SSM_DOT_ROWS_U16(SUF(dot_rows_bf16), bf16_to_f32)
SSM_DOT_ROWS_U16(SUF(dot_rows_f16), f16_to_f32)

/* y[r] = W[r]·x for nr ≤ 4 rows of a W_Q8 matrix (rows n apart, their scales nb apart): per
   full block of 32, each weight scaled as it is widened, in 32 lanes (one block a step); the
   last, partial block one input at a time. (Measured on one core: 32 lanes with the scale per
   weight read 5.5 G weights/s; 16 lanes scaling the sum of a block's two halves, 4.1: the
   compiler widened the int8 in 128-bit pieces there.) */
static inline void SUF(dot_rows_q8)(const int8_t *W, const float *sc, i64 n, i64 nr, const REAL *x, REAL *y) {
    const i64 nb = (n + QBLOCK - 1) / QBLOCK;
    const int8_t *w0 = W, *w1 = W + (nr > 1 ? n : 0), *w2 = W + (nr > 2 ? 2 * n : 0), *w3 = W + (nr > 3 ? 3 * n : 0);
    const float *s[4];
    for (int r = 0; r < 4; r++) s[r] = sc + (r < nr ? r : 0) * nb;
    REAL a0[QBLOCK] = {0}, a1[QBLOCK] = {0}, a2[QBLOCK] = {0}, a3[QBLOCK] = {0};
    i64 j = 0;
    for (; (j + 1) * QBLOCK <= n; j++) {
        const i64 i = j * QBLOCK;
        const REAL d0 = s[0][j], d1 = s[1][j], d2 = s[2][j], d3 = s[3][j];
#pragma omp simd
        for (int k = 0; k < QBLOCK; k++) {
            const REAL xv = x[i + k];
            a0[k] += (d0 * (REAL)w0[i + k]) * xv;
            a1[k] += (d1 * (REAL)w1[i + k]) * xv;
            a2[k] += (d2 * (REAL)w2[i + k]) * xv;
            a3[k] += (d3 * (REAL)w3[i + k]) * xv;
        }
    }
    const int8_t *w[4] = {w0, w1, w2, w3};
    REAL sums[4] = {0, 0, 0, 0};
    for (int r = 0; r < 4; r++) {
        REAL tail = 0;
        for (i64 i = j * QBLOCK; i < n; i++) tail += (REAL)w[r][i] * x[i];
        sums[r] = tail * (j < nb ? (REAL)s[r][j] : 0);
    }
    for (int k = 0; k < QBLOCK; k++) {
        sums[0] += a0[k];
        sums[1] += a1[k];
        sums[2] += a2[k];
        sums[3] += a3[k];
    }
    for (i64 r = 0; r < nr; r++) y[r] = sums[r];
}

/* The same for a W_Q4 matrix (rows 16·nb bytes apart): a block's byte k gives inputs k (low
   nibble) and 16 + k (high nibble). */
static inline void SUF(dot_rows_q4)(const uint8_t *W, const float *sc, i64 n, i64 nr, const REAL *x, REAL *y) {
    const i64 nb = (n + QBLOCK - 1) / QBLOCK, row = nb * (QBLOCK / 2);
    const uint8_t *w[4];
    const float *s[4];
    for (int r = 0; r < 4; r++) {
        w[r] = W + (r < nr ? r : 0) * row;
        s[r] = sc + (r < nr ? r : 0) * nb;
    }
    REAL a0[DOT_LANES] = {0}, a1[DOT_LANES] = {0}, a2[DOT_LANES] = {0}, a3[DOT_LANES] = {0};
    i64 j = 0;
    for (; (j + 1) * QBLOCK <= n; j++) {
        const i64 i = j * QBLOCK, b = j * (QBLOCK / 2);
        const REAL d0 = s[0][j], d1 = s[1][j], d2 = s[2][j], d3 = s[3][j];
#pragma omp simd
        for (int k = 0; k < DOT_LANES; k++) {
            const REAL xl = x[i + k], xh = x[i + DOT_LANES + k];
            a0[k] += d0 * ((REAL)((w[0][b + k] & 15) - 8) * xl + (REAL)((w[0][b + k] >> 4) - 8) * xh);
            a1[k] += d1 * ((REAL)((w[1][b + k] & 15) - 8) * xl + (REAL)((w[1][b + k] >> 4) - 8) * xh);
            a2[k] += d2 * ((REAL)((w[2][b + k] & 15) - 8) * xl + (REAL)((w[2][b + k] >> 4) - 8) * xh);
            a3[k] += d3 * ((REAL)((w[3][b + k] & 15) - 8) * xl + (REAL)((w[3][b + k] >> 4) - 8) * xh);
        }
    }
    REAL sums[4] = {0, 0, 0, 0};
    for (int r = 0; r < 4; r++) {
        REAL tail = 0;
        for (i64 i = j * QBLOCK; i < n; i++) tail += (REAL)q4_at(w[r] + j * (QBLOCK / 2), i - j * QBLOCK) * x[i];
        sums[r] = tail * (j < nb ? (REAL)s[r][j] : 0);
    }
    for (int k = 0; k < DOT_LANES; k++) {
        sums[0] += a0[k];
        sums[1] += a1[k];
        sums[2] += a2[k];
        sums[3] += a3[k];
    }
    for (i64 r = 0; r < nr; r++) y[r] = sums[r];
}

/* y[r] = row o + r of W times x, r < nr ≤ 4, in W's format (n inputs): in intrinsics where
   W->isa asks for them (float32 only), else in the portable code above. */
static inline void SUF(dot_rows_any)(const WMat *W, i64 n, i64 o, i64 nr, const REAL *x, REAL *y) {
    const i64 nb = (n + QBLOCK - 1) / QBLOCK;
#if REAL_IS_F32
    if (simd_dot_rows(W, n, o, nr, x, y)) return; /* decode_simd.c, at the level W->isa asks */
#endif
    switch (W->type) {
    case W_BF16: SUF(dot_rows_bf16)((const uint16_t *)W->w + o * n, n, nr, x, y); break;
    case W_F16: SUF(dot_rows_f16)((const uint16_t *)W->w + o * n, n, nr, x, y); break;
    case W_Q8: SUF(dot_rows_q8)((const int8_t *)W->w + o * n, W->scale + o * nb, n, nr, x, y); break;
    case W_Q4: SUF(dot_rows_q4)((const uint8_t *)W->w + o * nb * (QBLOCK / 2), W->scale + o * nb, n, nr, x, y); break;
    default: SUF(dot_rows)((const REAL *)W->w + o * n, n, nr, x, y);
    }
}

/* The tensor path's int8 activations (a QuantLinear's input on the CPU, float32 only): row r of
   x, its n values at x + r·rs + i·es, rounded as the fused step rounds it (quantize_act_row) and
   written back widened, out (rows, n) = q · d, for the float32 product with the widened weights.
   ssm.ops.quant.round_activations computes the same in torch. Strided rows (a transposed
   (B, D, L) tensor: es = L, rs = 1) are copied ROUND_TILE at a time into contiguous ones, input
   by input, so that each cache line of x is read once (row by row took 2.0 ms for 512 × 1536,
   against 0.43 for contiguous rows). */
#define ROUND_TILE 16
#if REAL_IS_F32
void SUF(decode_round_rows)(const float *x, i64 rows, i64 n, i64 rs, i64 es, float *out, i64 nthreads) {
    const i64 nb = (n + QBLOCK - 1) / QBLOCK, tiles = (rows + ROUND_TILE - 1) / ROUND_TILE;
    (void)nthreads; /* unused without OpenMP */
#pragma omp parallel num_threads((int)nthreads)
    {
        int8_t *q = malloc((size_t)(nb * QBLOCK));
        float *d = malloc((size_t)nb * sizeof(float));
        float *tile = es == 1 ? NULL : malloc((size_t)(ROUND_TILE * n) * sizeof(float));
        const int ok = q && d && (es == 1 || tile);
#pragma omp for schedule(static)
        for (i64 t = 0; t < tiles; t++) {
            const i64 r0 = t * ROUND_TILE, nr = rows - r0 < ROUND_TILE ? rows - r0 : ROUND_TILE;
            if (ok && es != 1)
                for (i64 i = 0; i < n; i++)
                    for (i64 k = 0; k < nr; k++) tile[k * n + i] = x[(r0 + k) * rs + i * es];
            for (i64 k = 0; k < nr; k++) {
                float *o = out + (r0 + k) * n;
                if (!ok) { /* out of memory: NaN, never an unrounded row */
                    for (i64 i = 0; i < n; i++) o[i] = NAN;
                    continue;
                }
                quantize_act_row(es == 1 ? x + (r0 + k) * rs : tile + k * n, n, q, d);
                for (i64 j = 0; j < nb; j++) {
                    const i64 i0 = j * QBLOCK, i1 = i0 + QBLOCK < n ? i0 + QBLOCK : n;
                    const float dj = d[j];
#pragma omp simd
                    for (i64 i = i0; i < i1; i++) o[i] = (float)q[i] * dj;
                }
            }
        }
        free(q);
        free(d);
        free(tile);
    }
}
#endif

/* Rows lo .. hi-1 of a W_Q8 or W_Q4 matrix W (n inputs) widened to REAL, one after another in
   out ((hi − lo) × n): the weights exactly as the products above read them (the integer times
   its block's float32 scale, rounded once to float32, as ops.quant.dequantize_rows computes it),
   for the tensor path's matrix products (a prompt's prefill) of a quantised layer. One pass over
   the narrow rows where torch's formula makes five over the wide ones. */
void SUF(decode_widen_rows)(const WMat *W, i64 n, i64 lo, i64 hi, REAL *out, i64 nthreads) {
    const i64 nb = (n + QBLOCK - 1) / QBLOCK;
    (void)nthreads; /* unused without OpenMP */
#pragma omp parallel for schedule(static) num_threads((int)nthreads)
    for (i64 o = lo; o < hi; o++) {
        REAL *dst = out + (o - lo) * n;
        const float *sc = W->scale + o * nb;
        if (W->type == W_Q8) {
            const int8_t *w = (const int8_t *)W->w + o * n;
            for (i64 j = 0; j < nb; j++) {
                const i64 i0 = j * QBLOCK, i1 = i0 + QBLOCK < n ? i0 + QBLOCK : n;
                const float d = sc[j];
#pragma omp simd
                for (i64 i = i0; i < i1; i++) dst[i] = (REAL)((float)w[i] * d);
            }
            continue;
        }
        const uint8_t *w = (const uint8_t *)W->w + o * nb * (QBLOCK / 2); /* W_Q4 */
        for (i64 j = 0; j < nb; j++) {
            const i64 i0 = j * QBLOCK;
            const uint8_t *b = w + j * (QBLOCK / 2);
            const float d = sc[j];
            if (i0 + QBLOCK <= n) {
#pragma omp simd
                for (int k = 0; k < QBLOCK / 2; k++) {
                    dst[i0 + k] = (REAL)((float)((b[k] & 15) - 8) * d);
                    dst[i0 + QBLOCK / 2 + k] = (REAL)((float)((b[k] >> 4) - 8) * d);
                }
            } else { /* the last, partial block */
                for (i64 i = i0; i < n; i++) dst[i] = (REAL)((float)q4_at(b, i - i0) * d);
            }
        }
    }
}
