/* Sequential scan kernels for the "cpu" backend (ssm/scan/cpu.py builds and calls them), and
   the one-token steps that decoding calls once per layer and token.

   Plain C11 + OpenMP, no Python or torch headers: cpu.py compiles this file with the system C
   compiler at first use and calls it through ctypes on the tensors' data pointers.

   Design: every thread owns whole channels (a work unit is one channel of the selective scan,
   or one block of columns of the linear scan) and walks all L steps of them on its own, with
   the state in a small array the compiler keeps in registers/L1 and vectorises over N. Threads
   never wait on one another inside a sweep; units are handed out dynamically, so a thread that
   shares its core with another process simply takes fewer of them. Nothing is allocated per
   step; a thread's scratch (a chunk of T steps) is allocated once per call.

   Shape symbols: B batch, D channels, L length, N state size, G groups, S packed sequences,
   T chunk length (steps between saved states), E / F the linear scan's flattened dims before /
   after the scanned one.

   The file includes itself twice (REAL = float, then double), so every kernel exists as
   *_f32 and *_f64. */

#ifndef REAL

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else /* built without OpenMP: one thread */
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

typedef int64_t i64;

/* exp, log1p for float: branch-free (Cephes polynomials) so that loops over N or over a
   chunk's steps vectorise; a few ulp from libm's. */
static inline float exp_f32(float x) {
    /* x is clamped to [-87.3, 88.3] (below, the result is 1e-38 rather than 0: negligible, and
       branch-free); the clamps are max/min instructions, and a NaN is passed through at the end. */
    float r, p, k, xc;
    union { int32_t i; float f; } scale;
    xc = x > -87.33654f ? x : -87.33654f;
    xc = xc < 88.37626f ? xc : 88.37626f;
    k = floorf(xc * 1.44269504088896341f + 0.5f);      /* x = k·ln2 + r, |r| <= ln2/2 */
    r = xc - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    scale.i = ((int32_t)k + 127) << 23;               /* 2^k */
    return x == x ? p * scale.f : x;
}

static inline float log_f32(float x) { /* x > 0, finite */
    union { int32_t i; float f; } bits;
    float e, m, z, y;
    bits.f = x;
    e = (float)(((bits.i >> 23) & 0xff) - 126);
    bits.i = (bits.i & 0x807fffff) | 0x3f000000;      /* mantissa in [0.5, 1) */
    m = bits.f;
    if (m < 0.707106781186547524f) { e -= 1.0f; m = m + m - 1.0f; } else { m = m - 1.0f; }
    z = m * m;
    y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    y += -2.12194440e-4f * e;
    y += -0.5f * z;
    return m + y + 0.693359375f * e;
}

static inline float log1p_f32(float y) { /* y >= 0: log(1 + y), exact to a few ulp for tiny y */
    float u = 1.0f + y;
    float d = u - 1.0f;
    return d == 0.0f ? y : log_f32(u) * (y / d);
}

static inline double exp_f64(double x) { return exp(x); }
static inline double log1p_f64(double x) { return log1p(x); }

/* Packed-sequence bounds: sequence s is steps cu[s] .. cu[s+1]-1; without cu_seqlens each batch
   row is one sequence of all L steps. */
static inline i64 next_nonempty(const i64 *cu, i64 s, i64 S) {
    while (s < S && cu[s] == cu[s + 1]) s++;
    return s;
}
static inline i64 prev_nonempty(const i64 *cu, i64 s) {
    while (s >= 0 && cu[s] == cu[s + 1]) s--;
    return s;
}

/* Work units per grab of a dynamic schedule: enough for GRAB_WORK element-steps, and no more than
   leaves 4 grabs a thread. Each grab is an atomic on a counter the threads share (a cache line
   passed between cores): at one unit a grab, a short call (a 16-token prefill) spent more on the
   grabs than on its steps (selective_fwd at L 1, 1536 channels: 300 µs). */
#define GRAB_WORK 16384
static inline i64 grab_size(i64 units, i64 work_per_unit, i64 nthreads) {
    const i64 want = work_per_unit >= GRAB_WORK ? 1 : work_per_unit < 1 ? GRAB_WORK : (GRAB_WORK + work_per_unit - 1) / work_per_unit;
    const i64 cap = units / (4 * nthreads);
    return want < cap ? want : cap > 1 ? cap : 1;
}

/* Arguments of the selective-scan kernels (the struct cpu.py mirrors with ctypes). Strides are
   in elements. u, delta, z are read as X[b*s0 + d*s1 + t*s2]; B and C as
   M[b*s0 + g*s1 + t*s2 + n] (N contiguous). A fixed (D, N) B or C is passed with s0 = s2 = 0,
   s1 = N and one "group" per channel. */
typedef struct {
    i64 batch, dim, length, N, groups_B, groups_C, nseq, nthreads;
    i64 chunk;                             /* T: steps between saved states (ckpt) */
    i64 B_fixed, C_fixed, softplus;
    i64 nparts;                            /* backward: channel blocks, each with its own B, C partial sums */
    const void *u, *delta, *A, *B, *C, *D, *z, *delta_bias, *h0;
    const i64 *cu_seqlens;                 /* NULL, or (S + 1,) with batch 1 */
    i64 su[3], sdelta[3], sz[3], sB[3], sC[3];
    /* forward outputs */
    void *out;                             /* (B, D, L) contiguous */
    void *last;                            /* (S, D, N) (S = B without cu_seqlens) */
    void *ckpt;                            /* (B, ceil(L/T), D, N), the state entering each chunk; NULL: not kept */
    /* backward inputs and outputs */
    const void *grad_out;                  /* (B, D, L), strides sgo */
    const void *grad_last;                 /* NULL or (S, D, N) */
    i64 sgo[3];
    void *d_u, *d_delta, *d_z;             /* (B, D, L) contiguous */
    void *d_A;                             /* (D, N) */
    void *d_B, *d_C;                       /* fixed: (D, N); time-varying: (B, G, L, N) */
    void *part_B, *part_C;                 /* time-varying: per-block (nparts, B, G, L, N) scratch */
    void *d_D, *d_delta_bias;              /* (D,) each, or NULL */
    void *d_h0;                            /* NULL or (S, D, N) */
} SelectiveArgs;

/* Arguments of the linear-scan kernels: gates, inputs, states (E, L, F) contiguous. */
typedef struct {
    i64 E, length, F, nseq, reverse, nthreads;
    const void *gates, *inputs, *h0;       /* h0: NULL, (E, F), or (S, F) with cu_seqlens */
    const i64 *cu_seqlens;
    void *states;                          /* forward output; backward input */
    const void *grad;                      /* backward: dLoss/dstates (E, L, F) */
    void *d_gates, *d_inputs, *d_h0;
} LinearArgs;

#define LINEAR_BLOCK 256 /* columns per work unit of the linear scan */
#define DOT_LANES 16     /* partial sums per row of a decoding step's dot products */

/* Arguments of the one-step selective kernel (recurrent decoding): u, delta, z (batch, dim) and
   B, C (batch, N) with row strides su, sdelta, sz, sB, sC (elements; the last dim contiguous);
   A (dim, N), state and new_state (batch, dim, N) contiguous; D, delta_bias (dim,) or NULL. */
typedef struct {
    i64 batch, dim, N, softplus, nthreads;
    const void *state, *u, *delta, *A, *B, *C, *D, *z, *delta_bias;
    i64 su, sdelta, sz, sB, sC;
    void *out, *new_state;                 /* out (batch, dim) contiguous */
} StepArgs;

/* Arguments of a whole Mamba-1 block's decoding step (one token per sequence): residual ←
   hidden + residual; RMSNorm; in_proj; the causal conv's step and SiLU; x_proj; dt_proj; the
   selective step gated by SiLU(z); out_proj. Every tensor contiguous, in one dtype. Shapes:
   hidden, residual, new_hidden, new_residual (batch, d_model) (residual NULL in the first
   block); norm_w (d_model); in_w (2·dim, d_model); conv_w (dim, K); conv_state (batch, dim, K)
   and ssm_state (batch, dim, N), both updated in place; x_w (R + 2N, dim); dt_w (dim, R);
   dt_b, Dskip (dim); A (dim, N); out_w (d_model, dim); in_b, conv_b, out_b: bias or NULL;
   work: scratch of batch·(d_model + 5·dim + R + 2N) elements. */
typedef struct {
    i64 batch, d_model, dim, N, R, K, nthreads;
    double eps;
    const void *hidden, *residual, *norm_w, *in_w, *in_b, *conv_w, *conv_b;
    void *conv_state;
    const void *x_w, *dt_w, *dt_b, *A, *Dskip;
    void *ssm_state;
    const void *out_w, *out_b;
    void *work, *new_hidden, *new_residual;
} BlockStepArgs;

/* The language model's head after the last block: residual ← hidden + residual, RMSNorm
   (norm_w (d_model), eps), logits (batch, vocab) = weight (vocab, d_model) · normed. */
typedef struct {
    i64 vocab;
    double eps;
    const void *norm_w, *weight;
    void *logits;
} HeadArgs;

/* Arguments of the causal depthwise convolution of a Mamba layer, in the layout in_proj leaves it:
   x (B, L, D), channels contiguous, batch rows sxb and steps sx elements apart (in_proj's x half);
   wt (K, D) the taps (tap K-1 on the current step); bias (D) or NULL; with cu_seqlens (S + 1,),
   B = 1 and no tap reaches before its sequence's start (zeros there, as at step 0).
   Forward: y (B, L, D) contiguous = silu(conv) with silu, else conv; and when yT is not NULL the
   same values in yT (B, D, L) contiguous, the layout the scans read (no transposed copy of y).
   Backward: from grad (B, L, D) contiguous (of y; NULL: zeros) plus gradT (B, D, L) contiguous
   (of yT; NULL: zeros), d_x (B, L, D) contiguous, d_wt (K, D), d_bias (D) or NULL; part:
   scratch of nthreads·(2K + 2)·D elements. */
typedef struct {
    i64 batch, length, dim, K, sxb, sx, nseq, silu, nthreads;
    const void *x, *wt, *bias;
    const i64 *cu_seqlens;
    void *y, *yT;
    const void *grad, *gradT;
    void *d_x, *d_wt, *d_bias, *part;
} ConvArgs;

/* Arguments of RMSNorm over groups of ``group`` channels of the rows of x (rows, M), M a multiple
   of group, optionally gated by silu(z) (z like x): gate 0, y = x̂·w; gate 1 (Mamba-2's
   default), v = x·silu(z) and y = v̂·w; gate 2, y = x̂·w·silu(z); where x̂ = x·rstd, rstd =
   1/sqrt(mean over the group(x²) + eps), kept (rows, M / group) for the backward. Backward
   from grad (rows, M): d_x, d_z (gates 1 and 2), d_w (M); part: scratch of nthreads·M
   elements. Every tensor contiguous, but z's rows may be sz elements apart (in_proj's z slice). */
typedef struct {
    i64 rows, M, group, gate, nthreads, sz;
    double eps;
    const void *x, *z, *w;
    void *y, *rstd;
    const void *grad;
    void *d_x, *d_z, *d_w, *part;
} NormArgs;

/* The first and one-past-last steps of the sequence holding step t (the last sequence s with
   cu[s] <= t: it does not end before t, as empty sequences come before it). */
static inline void seq_bounds(const i64 *cu, i64 S, i64 L, i64 t, i64 *lo, i64 *hi) {
    if (!cu) {
        *lo = 0;
        *hi = L;
        return;
    }
    i64 a = 0, b = S - 1;
    while (a < b) {
        const i64 m = (a + b + 1) / 2;
        if (cu[m] <= t) a = m;
        else b = m - 1;
    }
    *lo = cu[a];
    *hi = cu[a + 1];
}

#define REAL float
#define SUF(name) name##_f32
#define EXP exp_f32
#define LOG1P log1p_f32
#include __FILE__
#undef REAL
#undef SUF
#undef EXP
#undef LOG1P

#define REAL double
#define SUF(name) name##_f64
#define EXP exp_f64
#define LOG1P log1p_f64
#include __FILE__

int ssm_kernels_abi(void) { return 7; }

#else /* ------------------------------------------------------------- kernels, for one REAL */

/* softplus with torch's threshold: x above 20 is returned as is. */
static inline REAL SUF(softplus)(REAL x) { return x > 20 ? x : LOG1P(EXP(x)); }
static inline REAL SUF(sigmoid)(REAL x) { return 1 / (1 + EXP(-x)); }

/* One chunk's per-step scalars of channel (b, d): Δ (after bias and softplus), u, and the
   z gate silu(z) (1 when there is no z). */
static void SUF(chunk_inputs)(const SelectiveArgs *a, i64 b, i64 d, i64 t0, i64 n_steps,
                              REAL *dt, REAL *raw, REAL *u, REAL *zv) {
    const REAL *U = (const REAL *)a->u + b * a->su[0] + d * a->su[1];
    const REAL *Dl = (const REAL *)a->delta + b * a->sdelta[0] + d * a->sdelta[1];
    REAL bias = a->delta_bias ? ((const REAL *)a->delta_bias)[d] : 0;
    for (i64 k = 0; k < n_steps; k++) {
        u[k] = U[(t0 + k) * a->su[2]];
        raw[k] = Dl[(t0 + k) * a->sdelta[2]] + bias;
    }
    if (a->softplus) {
#pragma omp simd
        for (i64 k = 0; k < n_steps; k++) dt[k] = SUF(softplus)(raw[k]);
    } else {
        for (i64 k = 0; k < n_steps; k++) dt[k] = raw[k];
    }
    if (a->z) {
        const REAL *Z = (const REAL *)a->z + b * a->sz[0] + d * a->sz[1];
        for (i64 k = 0; k < n_steps; k++) zv[k] = Z[(t0 + k) * a->sz[2]];
    }
}

/* Steps k0 .. k1-1 of a chunk of one channel, within one sequence: h (N) is updated in place
   and y[k] = C_t·h_t. B and C point at the chunk's first step, ``sB`` / ``sC`` apart.
   With N a multiple of LANES the sums over N run in LANES partial sums, added up as a tree:
   the loop over n then maps onto whole vectors, with no per-step loop remainder. */
#define LANES 8

/* Whether a channel's A is one value for every n (Mamba-2's scalar decay per head, run on these
   sweeps by ssd_cpu): then exp(Δ_t·A) is one exp per step instead of N, with the same result. */
static inline int SUF(all_equal)(const REAL *Ad, i64 N) {
    for (i64 n = 1; n < N; n++)
        if (Ad[n] != Ad[0]) return 0;
    return 1;
}

/* A call of fwd_steps / recompute_steps with N and same_A as constants for the usual cases, so
   that each is compiled with its loop over n unrolled and its exp hoisted where it can be. */
#ifndef SPECIALISED
#define SPECIALISED(fn, ...)                                       \
    do {                                                           \
        if (N == 16 && same_A) fn(16, 1, __VA_ARGS__);             \
        else if (N == 16) fn(16, 0, __VA_ARGS__);                  \
        else if (same_A) fn(N, 1, __VA_ARGS__);                    \
        else fn(N, 0, __VA_ARGS__);                                \
    } while (0)
#endif
static inline REAL SUF(sum_lanes)(const REAL *p) { return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7])); }

static inline __attribute__((always_inline)) void SUF(fwd_steps)(
    const i64 N, const int same_A, i64 k0, i64 k1, REAL *restrict h, const REAL *restrict Ad, const REAL *restrict Bm, i64 sB,
    const REAL *restrict Cm, i64 sC, const REAL *restrict dt, const REAL *restrict u, REAL *restrict y,
    REAL *restrict y_lanes) {
    for (i64 k = k0; k < k1; k++) {
        const REAL *restrict Bt = Bm + k * sB, *restrict Ct = Cm + k * sC;
        const REAL dtk = dt[k], dtu = dt[k] * u[k];
        const REAL e0 = same_A ? EXP(dtk * Ad[0]) : 0;
        if (N % LANES == 0) {
            REAL *restrict acc = y_lanes + k * LANES; /* added up after the loop, off the recurrence */
            for (i64 j = 0; j < LANES; j++) acc[j] = 0;
            for (i64 n0 = 0; n0 < N; n0 += LANES)
                for (i64 j = 0; j < LANES; j++) {
                    const i64 n = n0 + j;
                    REAL hn = (same_A ? e0 : EXP(dtk * Ad[n])) * h[n] + dtu * Bt[n];
                    h[n] = hn;
                    acc[j] += Ct[n] * hn;
                }
        } else {
            REAL yk = 0;
#pragma omp simd reduction(+ : yk)
            for (i64 n = 0; n < N; n++) {
                REAL hn = (same_A ? e0 : EXP(dtk * Ad[n])) * h[n] + dtu * Bt[n];
                h[n] = hn;
                yk += Ct[n] * hn;
            }
            y[k] = yk;
        }
    }
    if (N % LANES == 0)
        for (i64 k = k0; k < k1; k++) y[k] = SUF(sum_lanes)(y_lanes + k * LANES);
}

/* Forward: out = (C·h + D·u)·silu(z), the last state of every sequence, and (with ckpt) the
   state entering every chunk. */
void SUF(selective_fwd)(const SelectiveArgs *a) {
    const i64 T = a->chunk;
    const i64 Bn = a->batch, Dn = a->dim, L = a->length, N = a->N;
    const i64 n_chunks = (L + T - 1) / T;
    const i64 S = a->cu_seqlens ? a->nseq : 1;
    const REAL *A = (const REAL *)a->A;
    REAL *last = (REAL *)a->last;
    const REAL *h0 = (const REAL *)a->h0;
    const i64 grab = grab_size(Dn, Bn * L * N, a->nthreads);

#pragma omp parallel num_threads((int)a->nthreads)
    {
        REAL *scratch = (REAL *)malloc(sizeof(REAL) * ((4 + LANES) * T + 2 * N));
        REAL *dt = scratch, *raw = dt + T, *u = raw + T, *zv = u + T;
        REAL *h = zv + T, *Ad = h + N, *y_lanes = Ad + N;
        i64 own_cu[2] = {0, L};
        const i64 *cu = a->cu_seqlens ? a->cu_seqlens : own_cu;

#pragma omp for schedule(dynamic, grab)
        for (i64 d = 0; d < Dn; d++) {
            const REAL Dd = a->D ? ((const REAL *)a->D)[d] : 0;
            const i64 gB = d / (Dn / a->groups_B), gC = d / (Dn / a->groups_C);
            for (i64 n = 0; n < N; n++) Ad[n] = A[d * N + n];
            const int same_A = SUF(all_equal)(Ad, N);
            for (i64 b = 0; b < Bn; b++) {
                const i64 row = a->cu_seqlens ? 0 : b; /* state rows: sequence s is row + s */
                const REAL *Bm = (const REAL *)a->B + b * a->sB[0] + gB * a->sB[1];
                const REAL *Cm = (const REAL *)a->C + b * a->sC[0] + gC * a->sC[1];
                REAL *out = (REAL *)a->out + (b * Dn + d) * L;
                /* zero-length sequences: their last state is their initial state */
                for (i64 s = 0; s < S; s++)
                    if (cu[s] == cu[s + 1])
                        for (i64 n = 0; n < N; n++)
                            last[((row + s) * Dn + d) * N + n] = h0 ? h0[((row + s) * Dn + d) * N + n] : 0;
                i64 s = next_nonempty(cu, 0, S);
                for (i64 n = 0; n < N; n++) h[n] = 0;
                for (i64 c = 0; c < n_chunks; c++) {
                    const i64 t0 = c * T, nt = L - t0 < T ? L - t0 : T;
                    if (a->ckpt) {
                        REAL *ck = (REAL *)a->ckpt + ((b * n_chunks + c) * Dn + d) * N;
                        for (i64 n = 0; n < N; n++) ck[n] = h[n];
                    }
                    SUF(chunk_inputs)(a, b, d, t0, nt, dt, raw, u, zv);
                    /* the chunk in segments that do not cross a sequence boundary */
                    for (i64 k = 0; k < nt;) {
                        if (t0 + k == cu[s]) { /* a sequence starts: its initial state, or 0 */
                            const REAL *init = h0 ? h0 + ((row + s) * Dn + d) * N : NULL;
                            for (i64 n = 0; n < N; n++) h[n] = init ? init[n] : 0;
                        }
                        const i64 k1 = cu[s + 1] - t0 < nt ? cu[s + 1] - t0 : nt;
                        const REAL *Bc = Bm + t0 * a->sB[2], *Cc = Cm + t0 * a->sC[2];
                        SPECIALISED(SUF(fwd_steps), k, k1, h, Ad, Bc, a->sB[2], Cc, a->sC[2], dt, u, raw, y_lanes);
                        for (i64 j = k; j < k1; j++) raw[j] += Dd * u[j]; /* raw is free now: y before the gate */
                        k = k1;
                        if (t0 + k == cu[s + 1]) { /* a sequence ends: keep its state */
                            REAL *ls = last + ((row + s) * Dn + d) * N;
                            for (i64 n = 0; n < N; n++) ls[n] = h[n];
                            s = next_nonempty(cu, s + 1, S);
                        }
                    }
                    if (a->z) {
#pragma omp simd
                        for (i64 k = 0; k < nt; k++) out[t0 + k] = raw[k] * zv[k] * SUF(sigmoid)(zv[k]);
                    } else {
                        for (i64 k = 0; k < nt; k++) out[t0 + k] = raw[k];
                    }
                }
            }
        }
        free(scratch);
    }
}

/* The backward's recomputation of steps k0 .. k1-1 (one sequence): like fwd_steps, and it keeps
   hs[k] (the state entering step k) and exp(Δ_t A) for the adjoint: decay[k·N + n], or with
   same_A the one value decay[k] (a third less memory traffic in the adjoint). */
static inline __attribute__((always_inline)) void SUF(recompute_steps)(
    const i64 N, const int same_A, i64 k0, i64 k1, REAL *restrict h, const REAL *restrict Ad, const REAL *restrict Bm, i64 sB,
    const REAL *restrict Cm, i64 sC, const REAL *restrict dt, const REAL *restrict u, REAL *restrict y,
    REAL *restrict y_lanes, REAL *restrict hs, REAL *restrict decay) {
    for (i64 k = k0; k < k1; k++) {
        const REAL *restrict Bt = Bm + k * sB, *restrict Ct = Cm + k * sC;
        REAL *restrict hk = hs + k * N, *restrict dk = decay + k * N;
        const REAL dtk = dt[k], dtu = dt[k] * u[k];
        const REAL e0 = same_A ? EXP(dtk * Ad[0]) : 0;
        if (same_A) decay[k] = e0; /* one decay per step, which the adjoint reads */
        if (N % LANES == 0) {
            REAL *restrict acc = y_lanes + k * LANES;
            for (i64 j = 0; j < LANES; j++) acc[j] = 0;
            for (i64 n0 = 0; n0 < N; n0 += LANES)
                for (i64 j = 0; j < LANES; j++) {
                    const i64 n = n0 + j;
                    REAL e = same_A ? e0 : EXP(dtk * Ad[n]);
                    hk[n] = h[n];
                    if (!same_A) dk[n] = e;
                    h[n] = e * h[n] + dtu * Bt[n];
                    acc[j] += Ct[n] * h[n];
                }
        } else {
            REAL yk = 0;
#pragma omp simd reduction(+ : yk)
            for (i64 n = 0; n < N; n++) {
                REAL e = same_A ? e0 : EXP(dtk * Ad[n]);
                hk[n] = h[n];
                if (!same_A) dk[n] = e;
                h[n] = e * h[n] + dtu * Bt[n];
                yk += Ct[n] * h[n];
            }
            y[k] = yk;
        }
    }
    if (N % LANES == 0)
        for (i64 k = k0; k < k1; k++) y[k] = SUF(sum_lanes)(y_lanes + k * LANES);
}

/* The adjoint through steps k1-1 down to k0 (one sequence), λ (N) in place:
     λ_t = λ + gy_t·C_t     (λ coming in is exp(Δ_{t+1}A)·λ_{t+1})
     dC_t += gy_t·h_t       dB_t += λ_t·Δ_t·u_t     dA += s_t·Δ_t,   s_t = λ_t·h_{t-1}·exp(Δ_t A)
     sA[k] = Σ_n s_t·A      sB[k] = Σ_n λ_t·B_t     λ ← exp(Δ_t A)·λ_t
   dB_t and dC_t go to pB / pC (row k, N apart), or with ``fixed`` to accB / accC. */
static inline __attribute__((always_inline)) void SUF(adjoint_steps)(
    const i64 N, const int same_A, i64 k0, i64 k1, REAL *restrict lam, const REAL *restrict Ad, const REAL *restrict Bm, i64 sB,
    const REAL *restrict Cm, i64 sC, const REAL *restrict dt, const REAL *restrict u, const REAL *restrict gy,
    const REAL *restrict hs, const REAL *restrict decay, REAL *restrict pB, i64 spB, REAL *restrict pC,
    i64 spC, REAL *restrict accA, REAL *restrict sA_lanes, REAL *restrict sB_lanes, REAL *restrict sA,
    REAL *restrict sBk) {
    for (i64 k = k1 - 1; k >= k0; k--) {
        const REAL *restrict Bt = Bm + k * sB, *restrict Ct = Cm + k * sC;
        const REAL *restrict hp = hs + k * N, *restrict dk = decay + (same_A ? 0 : k * N);
        const REAL e0 = same_A ? decay[k] : 0;
        REAL *restrict pBt = pB + k * spB, *restrict pCt = pC + k * spC;
        const REAL dtk = dt[k], dtu = dt[k] * u[k], g = gy[k];
        if (N % LANES == 0) {
            REAL *restrict la = sA_lanes + k * LANES, *restrict lb = sB_lanes + k * LANES;
            for (i64 j = 0; j < LANES; j++) { la[j] = 0; lb[j] = 0; }
            for (i64 n0 = 0; n0 < N; n0 += LANES)
                for (i64 j = 0; j < LANES; j++) {
                    const i64 n = n0 + j;
                    const REAL ht = (same_A ? e0 : dk[n]) * hp[n] + dtu * Bt[n];
                    const REAL l = lam[n] + g * Ct[n];
                    const REAL st = l * hp[n] * (same_A ? e0 : dk[n]);
                    pCt[n] += g * ht;
                    pBt[n] += l * dtu;
                    la[j] += st * Ad[n];
                    lb[j] += l * Bt[n];
                    accA[n] += st * dtk;
                    lam[n] = (same_A ? e0 : dk[n]) * l;
                }
        } else {
            REAL a_sum = 0, b_sum = 0;
#pragma omp simd reduction(+ : a_sum, b_sum)
            for (i64 n = 0; n < N; n++) {
                const REAL ht = (same_A ? e0 : dk[n]) * hp[n] + dtu * Bt[n];
                const REAL l = lam[n] + g * Ct[n];
                const REAL st = l * hp[n] * (same_A ? e0 : dk[n]);
                pCt[n] += g * ht;
                pBt[n] += l * dtu;
                a_sum += st * Ad[n];
                b_sum += l * Bt[n];
                accA[n] += st * dtk;
                lam[n] = (same_A ? e0 : dk[n]) * l;
            }
            sA[k] = a_sum;
            sBk[k] = b_sum;
        }
    }
    if (N % LANES == 0)
        for (i64 k = k0; k < k1; k++) {
            sA[k] = SUF(sum_lanes)(sA_lanes + k * LANES);
            sBk[k] = SUF(sum_lanes)(sB_lanes + k * LANES);
        }
}

/* Backward: a reverse sweep per channel. Chunk by chunk from the end, the chunk's states are
   recomputed from the saved state entering it (recompute_steps), then the adjoint λ_t =
   dLoss/dh_t runs back through the chunk (adjoint_steps), and per step
     du_t = gy_t·D + Δ_t·Σ_n λ_t·B_t     dΔ_t = Σ_n s_t·A + u_t·Σ_n λ_t·B_t (then through the
     softplus, and summed into the bias)     d initial_state = exp(Δ_first A)·λ_first
   with gy = grad_out·silu(z), dz = grad_out·y·silu'(z), dD = Σ gy·u. λ after a sequence's last
   step is its grad_last. Sums over channels of time-varying B and C go to per-block scratch
   (part_B, part_C), added up at the end. */
void SUF(selective_bwd)(const SelectiveArgs *a) {
    const i64 T = a->chunk;
    const i64 Bn = a->batch, Dn = a->dim, L = a->length, N = a->N;
    const i64 n_chunks = (L + T - 1) / T;
    const i64 S = a->cu_seqlens ? a->nseq : 1;
    const REAL *A = (const REAL *)a->A;
    const REAL *h0 = (const REAL *)a->h0, *glast = (const REAL *)a->grad_last;
    REAL *dh0 = (REAL *)a->d_h0;
    const i64 GB = a->groups_B, GC = a->groups_C;
    const i64 part_size_B = a->B_fixed ? 0 : Bn * GB * L * N, part_size_C = a->C_fixed ? 0 : Bn * GC * L * N;

#pragma omp parallel num_threads((int)a->nthreads)
    {
        REAL *scratch = (REAL *)malloc(sizeof(REAL) * ((8 + 3 * LANES) * T + 2 * T * N + 6 * N));
        REAL *dt = scratch, *raw = dt + T, *u = raw + T, *zv = u + T, *y = zv + T, *gy = y + T;
        REAL *sA = gy + T, *sBk = sA + T, *y_lanes = sBk + T, *sA_lanes = y_lanes + LANES * T;
        REAL *sB_lanes = sA_lanes + LANES * T;
        REAL *hs = sB_lanes + LANES * T;  /* hs[k*N..]: the state entering step t0+k (after any restart) */
        REAL *decay = hs + T * N;         /* decay[k*N..]: exp(Δ_t A) of step t0+k */
        REAL *lam = decay + T * N, *Ad = lam + N, *accA = Ad + N, *accB = accA + N, *accC = accB + N, *h = accC + N;
        i64 own_cu[2] = {0, L};
        const i64 *cu = a->cu_seqlens ? a->cu_seqlens : own_cu;

        /* Work units: nparts blocks of channels, handed out dynamically (a thread that shares its
           core with another process takes fewer). Each block adds its channels' dB_t, dC_t into
           rows of its own, in channel order, and the blocks are added up in block order at the
           end: the gradients are the same bits on every run whichever thread ran which block. */
#pragma omp for schedule(dynamic, 1)
        for (i64 part = 0; part < a->nparts; part++) {
            REAL *pB = a->B_fixed ? NULL : (REAL *)a->part_B + part * part_size_B;
            REAL *pC = a->C_fixed ? NULL : (REAL *)a->part_C + part * part_size_C;
            if (pB) memset(pB, 0, sizeof(REAL) * part_size_B);
            if (pC) memset(pC, 0, sizeof(REAL) * part_size_C);
            for (i64 d = part * Dn / a->nparts; d < (part + 1) * Dn / a->nparts; d++) {
                const REAL Dd = a->D ? ((const REAL *)a->D)[d] : 0;
                const i64 gB = d / (Dn / GB), gC = d / (Dn / GC);
                REAL accD = 0, accBias = 0;
                for (i64 n = 0; n < N; n++) { Ad[n] = A[d * N + n]; accA[n] = 0; accB[n] = 0; accC[n] = 0; }
                const int same_A = SUF(all_equal)(Ad, N);
                for (i64 b = 0; b < Bn; b++) {
                    const i64 row = a->cu_seqlens ? 0 : b;
                    const REAL *Bm = (const REAL *)a->B + b * a->sB[0] + gB * a->sB[1];
                    const REAL *Cm = (const REAL *)a->C + b * a->sC[0] + gC * a->sC[1];
                    const REAL *go = (const REAL *)a->grad_out + b * a->sgo[0] + d * a->sgo[1];
                    REAL *du = (REAL *)a->d_u + (b * Dn + d) * L, *ddl = (REAL *)a->d_delta + (b * Dn + d) * L;
                    REAL *dz = a->d_z ? (REAL *)a->d_z + (b * Dn + d) * L : NULL;
                    /* where dB_t, dC_t go: this block's rows of this (batch, group), or the channel's sums */
                    REAL *pBb = pB ? pB + (b * GB + gB) * L * N : accB, *pCb = pC ? pC + (b * GC + gC) * L * N : accC;
                    const i64 spB = pB ? N : 0, spC = pC ? N : 0;
                    for (i64 s = 0; s < S; s++) /* zero-length sequences pass their gradient through */
                        if (cu[s] == cu[s + 1] && dh0)
                            for (i64 n = 0; n < N; n++)
                                dh0[((row + s) * Dn + d) * N + n] = glast ? glast[((row + s) * Dn + d) * N + n] : 0;
                    i64 s_end = prev_nonempty(cu, S - 1); /* the sequence the reverse walk is in */
                    for (i64 n = 0; n < N; n++) lam[n] = 0;
                    for (i64 c = n_chunks - 1; c >= 0; c--) {
                        const i64 t0 = c * T, nt = L - t0 < T ? L - t0 : T;
                        const REAL *Bc = Bm + t0 * a->sB[2], *Cc = Cm + t0 * a->sC[2];
                        SUF(chunk_inputs)(a, b, d, t0, nt, dt, raw, u, zv);
                        /* recompute the chunk's states from the saved one, in segments that do not
                           cross a sequence boundary (restarting where a sequence starts) */
                        i64 s = s_end;
                        while (cu[s] > t0) s = prev_nonempty(cu, s - 1);
                        const REAL *ck = (const REAL *)a->ckpt + ((b * n_chunks + c) * Dn + d) * N;
                        for (i64 n = 0; n < N; n++) h[n] = ck[n];
                        for (i64 k = 0; k < nt;) {
                            if (t0 + k == cu[s]) {
                                const REAL *init = h0 ? h0 + ((row + s) * Dn + d) * N : NULL;
                                for (i64 n = 0; n < N; n++) h[n] = init ? init[n] : 0;
                            }
                            const i64 k1 = cu[s + 1] - t0 < nt ? cu[s + 1] - t0 : nt;
                            SPECIALISED(SUF(recompute_steps), k, k1, h, Ad, Bc, a->sB[2], Cc, a->sC[2], dt, u, y, y_lanes, hs, decay);
                            k = k1;
                            if (t0 + k == cu[s + 1]) s = next_nonempty(cu, s + 1, S);
                        }
                        /* the gate: gy = grad_out·silu(z), dz = grad_out·y·silu'(z) with y = C·h + D·u */
                        for (i64 k = 0; k < nt; k++) gy[k] = go[(t0 + k) * a->sgo[2]];
                        if (a->z) {
#pragma omp simd
                            for (i64 k = 0; k < nt; k++) {
                                const REAL zt = zv[k], sg = SUF(sigmoid)(zt), g = gy[k];
                                dz[t0 + k] = g * (y[k] + Dd * u[k]) * sg * (1 + zt * (1 - sg));
                                gy[k] = g * zt * sg;
                            }
                        }
                        /* the adjoint, back through the chunk's segments */
                        for (i64 k1 = nt; k1 > 0;) {
                            if (t0 + k1 == cu[s_end + 1]) { /* entering a sequence from its end: its grad_last */
                                const REAL *gl = glast ? glast + ((row + s_end) * Dn + d) * N : NULL;
                                for (i64 n = 0; n < N; n++) lam[n] = gl ? gl[n] : 0;
                            }
                            const i64 k0 = cu[s_end] - t0 > 0 ? cu[s_end] - t0 : 0;
                            REAL *pBs = pBb + t0 * spB, *pCs = pCb + t0 * spC;
                            SPECIALISED(SUF(adjoint_steps), k0, k1, lam, Ad, Bc, a->sB[2], Cc, a->sC[2], dt, u, gy, hs,
                                        decay, pBs, spB, pCs, spC, accA, sA_lanes, sB_lanes, sA, sBk);
                            k1 = k0;
                            if (t0 + k0 == cu[s_end]) { /* left the sequence at its start */
                                if (dh0) {
                                    REAL *di = dh0 + ((row + s_end) * Dn + d) * N;
                                    for (i64 n = 0; n < N; n++) di[n] = lam[n];
                                }
                                s_end = prev_nonempty(cu, s_end - 1);
                            }
                        }
                        /* per-step gradients of u and Δ (through softplus and into the bias), and D */
                        REAL sum_bias = 0, sum_D = 0;
                        if (a->softplus) { /* softplus' derivative in a loop of its own: inside the next one
                                              it made that loop cost more than all the rest of the backward
                                              (measured: ssd's backward 6.9 -> 2.9 ms at (1, 1024, 8·32), N 16) */
#pragma omp simd
                            for (i64 k = 0; k < nt; k++) raw[k] = raw[k] > 20 ? 1 : SUF(sigmoid)(raw[k]);
                        }
#pragma omp simd reduction(+ : sum_bias, sum_D)
                        for (i64 k = 0; k < nt; k++) {
                            REAL gdt = sA[k] + u[k] * sBk[k];
                            if (a->softplus) gdt *= raw[k];
                            du[t0 + k] = gy[k] * Dd + dt[k] * sBk[k];
                            ddl[t0 + k] = gdt;
                            sum_bias += gdt;
                            sum_D += gy[k] * u[k];
                        }
                        accBias += sum_bias;
                        accD += sum_D;
                    }
                }
                for (i64 n = 0; n < N; n++) ((REAL *)a->d_A)[d * N + n] = accA[n];
                if (a->B_fixed) for (i64 n = 0; n < N; n++) ((REAL *)a->d_B)[d * N + n] = accB[n];
                if (a->C_fixed) for (i64 n = 0; n < N; n++) ((REAL *)a->d_C)[d * N + n] = accC[n];
                if (a->d_D) ((REAL *)a->d_D)[d] = accD;
                if (a->d_delta_bias) ((REAL *)a->d_delta_bias)[d] = accBias;
            }
        }
        /* add up the blocks' sums over channels of time-varying B and C */
        if (part_size_B) {
#pragma omp for schedule(static)
            for (i64 i = 0; i < part_size_B; i++) {
                REAL sum = 0;
                for (i64 k = 0; k < a->nparts; k++) sum += ((const REAL *)a->part_B)[k * part_size_B + i];
                ((REAL *)a->d_B)[i] = sum;
            }
        }
        if (part_size_C) {
#pragma omp for schedule(static)
            for (i64 i = 0; i < part_size_C; i++) {
                REAL sum = 0;
                for (i64 k = 0; k < a->nparts; k++) sum += ((const REAL *)a->part_C)[k * part_size_C + i];
                ((REAL *)a->d_C)[i] = sum;
            }
        }
        free(scratch);
    }
}

/* Linear scan h_t = a_t·h_prev + x_t over (E, L, F), each sequence from its initial state
   (h_prev of the first step in scan order; the last position when reverse). Work unit: one row
   e and a block of LINEAR_BLOCK columns. */
void SUF(linear_fwd)(const LinearArgs *p) {
    const i64 E = p->E, L = p->length, F = p->F, nb = (F + LINEAR_BLOCK - 1) / LINEAR_BLOCK;
    const i64 S = p->cu_seqlens ? p->nseq : 1;
    const REAL *ga = (const REAL *)p->gates, *x = (const REAL *)p->inputs, *h0 = (const REAL *)p->h0;
    REAL *out = (REAL *)p->states;
    const i64 grab = grab_size(E * nb, L * LINEAR_BLOCK, p->nthreads);
#pragma omp parallel num_threads((int)p->nthreads)
    {
        REAL h[LINEAR_BLOCK];
        i64 own_cu[2] = {0, L};
        const i64 *cu = p->cu_seqlens ? p->cu_seqlens : own_cu;
#pragma omp for schedule(dynamic, grab)
        for (i64 unit = 0; unit < E * nb; unit++) {
            const i64 e = unit / nb, f0 = (unit % nb) * LINEAR_BLOCK;
            const i64 w = F - f0 < LINEAR_BLOCK ? F - f0 : LINEAR_BLOCK;
            const i64 row = p->cu_seqlens ? 0 : e;
            const i64 base = e * L * F + f0;
            for (i64 s = 0; s < S; s++) {
                const i64 lo = cu[s], hi = cu[s + 1];
                if (lo == hi) continue;
                const REAL *init = h0 ? h0 + (row + s) * F + f0 : NULL;
                for (i64 f = 0; f < w; f++) h[f] = init ? init[f] : 0;
                for (i64 k = 0; k < hi - lo; k++) {
                    const i64 t = p->reverse ? hi - 1 - k : lo + k;
                    const REAL *at = ga + base + t * F, *xt = x + base + t * F;
                    REAL *ot = out + base + t * F;
#pragma omp simd
                    for (i64 f = 0; f < w; f++) {
                        h[f] = at[f] * h[f] + xt[f];
                        ot[f] = h[f];
                    }
                }
            }
        }
    }
}

/* Its backward: λ_t = g_t + a_next·λ_next against the scan direction; dx = λ,
   da_t = λ_t·h_prev(t), d initial_state = a_first·λ_first. */
void SUF(linear_bwd)(const LinearArgs *p) {
    const i64 E = p->E, L = p->length, F = p->F, nb = (F + LINEAR_BLOCK - 1) / LINEAR_BLOCK;
    const i64 S = p->cu_seqlens ? p->nseq : 1;
    const REAL *ga = (const REAL *)p->gates, *hs = (const REAL *)p->states, *g = (const REAL *)p->grad;
    const REAL *h0 = (const REAL *)p->h0;
    REAL *da = (REAL *)p->d_gates, *dx = (REAL *)p->d_inputs, *dh0 = (REAL *)p->d_h0;
    const i64 grab = grab_size(E * nb, L * LINEAR_BLOCK, p->nthreads);
#pragma omp parallel num_threads((int)p->nthreads)
    {
        REAL carry[LINEAR_BLOCK];
        i64 own_cu[2] = {0, L};
        const i64 *cu = p->cu_seqlens ? p->cu_seqlens : own_cu;
#pragma omp for schedule(dynamic, grab)
        for (i64 unit = 0; unit < E * nb; unit++) {
            const i64 e = unit / nb, f0 = (unit % nb) * LINEAR_BLOCK;
            const i64 w = F - f0 < LINEAR_BLOCK ? F - f0 : LINEAR_BLOCK;
            const i64 row = p->cu_seqlens ? 0 : e;
            const i64 base = e * L * F + f0;
            for (i64 s = 0; s < S; s++) {
                const i64 lo = cu[s], hi = cu[s + 1], len = hi - lo;
                if (len == 0) {
                    if (dh0) for (i64 f = 0; f < w; f++) dh0[(row + s) * F + f0 + f] = 0;
                    continue;
                }
                for (i64 f = 0; f < w; f++) carry[f] = 0;
                for (i64 k = len - 1; k >= 0; k--) { /* k: position in scan order */
                    const i64 t = p->reverse ? hi - 1 - k : lo + k;
                    const i64 tp = p->reverse ? t + 1 : t - 1; /* the previous step in scan order */
                    const REAL *at = ga + base + t * F, *gt = g + base + t * F;
                    const REAL *hp = k > 0 ? hs + base + tp * F : (h0 ? h0 + (row + s) * F + f0 : NULL);
                    REAL *dat = da + base + t * F, *dxt = dx + base + t * F;
                    if (hp) {
#pragma omp simd
                        for (i64 f = 0; f < w; f++) {
                            REAL l = gt[f] + carry[f];
                            dxt[f] = l;
                            dat[f] = l * hp[f];
                            carry[f] = at[f] * l;
                        }
                    } else {
#pragma omp simd
                        for (i64 f = 0; f < w; f++) {
                            REAL l = gt[f] + carry[f];
                            dxt[f] = l;
                            dat[f] = 0;
                            carry[f] = at[f] * l;
                        }
                    }
                }
                if (dh0) for (i64 f = 0; f < w; f++) dh0[(row + s) * F + f0 + f] = carry[f];
            }
        }
    }
}

/* One channel's step: h ← exp(Δ·A)·h + Δ·u·B into hn (which may be h), returning C·h. */
static inline REAL SUF(step_channel)(const REAL *h, REAL *hn, const REAL *Ad, const REAL *Bt, const REAL *Ct,
                                     REAL dt, REAL u, i64 N) {
    const REAL dtu = dt * u;
    REAL y = 0;
#pragma omp simd reduction(+ : y)
    for (i64 n = 0; n < N; n++) {
        const REAL v = EXP(dt * Ad[n]) * h[n] + dtu * Bt[n];
        hn[n] = v;
        y += Ct[n] * v;
    }
    return y;
}

/* One step of every channel: h = exp(Δ·A)·h + Δ·u·B, y = (C·h + D·u)·silu(z), with Δ =
   softplus(delta + bias) as asked; what selective_fwd does for one time index, without its
   per-call set-up (decoding calls it once per layer and token). */
void SUF(selective_step)(const StepArgs *a) {
    const i64 Bn = a->batch, Dn = a->dim, N = a->N;
    const REAL *A = (const REAL *)a->A, *H = (const REAL *)a->state;
    REAL *Hn = (REAL *)a->new_state, *out = (REAL *)a->out;
#pragma omp parallel for num_threads((int)a->nthreads) schedule(static) if (Bn * Dn * N >= 65536)
    for (i64 i = 0; i < Bn * Dn; i++) {
        const i64 b = i / Dn, d = i % Dn;
        const REAL u = ((const REAL *)a->u)[b * a->su + d];
        REAL dt = ((const REAL *)a->delta)[b * a->sdelta + d] + (a->delta_bias ? ((const REAL *)a->delta_bias)[d] : 0);
        if (a->softplus) dt = SUF(softplus)(dt);
        const REAL *Bt = (const REAL *)a->B + b * a->sB, *Ct = (const REAL *)a->C + b * a->sC;
        REAL y = SUF(step_channel)(H + i * N, Hn + i * N, A + d * N, Bt, Ct, dt, u, N);
        if (a->D) y += ((const REAL *)a->D)[d] * u;
        if (a->z) {
            const REAL zt = ((const REAL *)a->z)[b * a->sz + d];
            y *= zt * SUF(sigmoid)(zt);
        }
        out[i] = y;
    }
}

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

/* One row of a block's input: r = hidden + residual (residual NULL: r = hidden), then
   normed = r / sqrt(mean(r²) + eps) · w. */
static inline void SUF(add_rms_norm)(const REAL *hid, const REAL *res, const REAL *w, double eps, i64 M, REAL *r,
                                     REAL *normed) {
    REAL ss = 0;
#pragma omp simd reduction(+ : ss)
    for (i64 i = 0; i < M; i++) {
        r[i] = hid[i] + (res ? res[i] : 0);
        ss += r[i] * r[i];
    }
    const REAL scale = 1 / sqrt(ss / M + (REAL)eps);
    for (i64 i = 0; i < M; i++) normed[i] = r[i] * scale * w[i];
}

/* Rows o .. o+3 (up to n_out) of y_b = W·x_b + bias (bias may be NULL) for each batch row b,
   with x_b = x + b·sx and y_b = y + b·sy: four of W's rows read once for the whole batch. */
static inline void SUF(project_rows)(const REAL *W, const REAL *bias, i64 n_in, i64 n_out, i64 o, i64 Bn,
                                     const REAL *x, i64 sx, REAL *y, i64 sy) {
    const i64 nr = n_out - o < 4 ? n_out - o : 4;
    for (i64 b = 0; b < Bn; b++) {
        REAL *yb = y + b * sy + o;
        SUF(dot_rows)(W + o * n_in, n_in, nr, x + b * sx, yb);
        if (bias)
            for (i64 r = 0; r < nr; r++) yb[r] += bias[o + r];
    }
}

/* A Mamba-1 block's decoding step (BlockStepArgs), run by every thread of the calling parallel
   region; a barrier after each projection and after each run of per-channel stages. At batch 1
   decoding is bound by reading the weights, so each projection is split by output rows across
   the threads (each reads its share of the matrix once, for every sequence of the batch while
   the rows are in L1), and nothing else leaves the cache. The per-channel stages split the
   channels instead, all of them the same way, so that they need no barrier between them. The
   conv is not fused into in_proj's x rows: there it left the thread that owns them behind the
   one with the z rows. */
static void SUF(block_step)(const BlockStepArgs *a) {
    const i64 Bn = a->batch, M = a->d_model, Dn = a->dim, N = a->N, R = a->R, K = a->K, X = R + 2 * N;
    const REAL *hid = (const REAL *)a->hidden, *res = (const REAL *)a->residual;
    const REAL *in_w = (const REAL *)a->in_w, *in_b = (const REAL *)a->in_b;
    const REAL *conv_w = (const REAL *)a->conv_w, *conv_b = (const REAL *)a->conv_b;
    const REAL *x_w = (const REAL *)a->x_w, *dt_w = (const REAL *)a->dt_w, *dt_b = (const REAL *)a->dt_b;
    const REAL *A = (const REAL *)a->A, *Dskip = (const REAL *)a->Dskip;
    const REAL *out_w = (const REAL *)a->out_w, *out_b = (const REAL *)a->out_b;
    REAL *conv_state = (REAL *)a->conv_state, *H = (REAL *)a->ssm_state;
    REAL *new_hid = (REAL *)a->new_hidden, *new_res = (REAL *)a->new_residual;
    /* scratch: normed (Bn, M); xz (Bn, 2·Dn), in_proj's x and z side by side; xc (Bn, Dn), the
       conv's output after SiLU; zg (Bn, Dn), SiLU(z); xdbl (Bn, X); y (Bn, Dn), Δ then the output */
    REAL *normed = (REAL *)a->work, *xz = normed + Bn * M, *xc = xz + Bn * 2 * Dn, *zg = xc + Bn * Dn;
    REAL *xdbl = zg + Bn * Dn, *y = xdbl + Bn * X;
#pragma omp for schedule(static)
    for (i64 b = 0; b < Bn; b++)
        SUF(add_rms_norm)(hid + b * M, res ? res + b * M : NULL, (const REAL *)a->norm_w, a->eps, M,
                          new_res + b * M, normed + b * M);
#pragma omp for schedule(static)
    for (i64 o = 0; o < 2 * Dn; o += 4) /* in_proj: x and z */
        SUF(project_rows)(in_w, in_b, M, 2 * Dn, o, Bn, normed, M, xz, 2 * Dn);
    /* Per-channel work, each thread on its own channels c0 .. c1-1 (blocks of 4, as dt_proj
       reads its rows) so that the stages between two projections need no barrier; the exps
       of the SiLUs and the softplus vectorised across channels (measured at mamba-130m's
       width: 80 µs a layer for these stages with one exp at a time, 57 µs so). */
    const i64 team = omp_get_num_threads(), tid = omp_get_thread_num(), nblk = (Dn + 3) / 4;
    const i64 c0 = 4 * (tid * nblk / team), c1 = 4 * ((tid + 1) * nblk / team) < Dn ? 4 * ((tid + 1) * nblk / team) : Dn;
    for (i64 b = 0; b < Bn; b++) { /* the conv's step and SiLU; SiLU(z) */
        REAL *xcb = xc + b * Dn, *zgb = zg + b * Dn;
        const REAL *xb = xz + b * 2 * Dn;
        for (i64 c = c0; c < c1; c++) {
            REAL *st = conv_state + (b * Dn + c) * K, acc = conv_b ? conv_b[c] : 0;
            for (i64 k = 0; k + 1 < K; k++) st[k] = st[k + 1];
            st[K - 1] = xb[c];
            for (i64 k = 0; k < K; k++) acc += st[k] * conv_w[c * K + k];
            xcb[c] = acc;
        }
#pragma omp simd
        for (i64 c = c0; c < c1; c++) {
            xcb[c] *= SUF(sigmoid)(xcb[c]);
            zgb[c] = xb[Dn + c] * SUF(sigmoid)(xb[Dn + c]);
        }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (i64 o = 0; o < X; o += 4) /* x_proj: Δ's low rank, B, C */
        SUF(project_rows)(x_w, NULL, Dn, X, o, Bn, xc, Dn, xdbl, X);
    for (i64 o = c0; o < c1; o += 4) /* dt_proj, on this thread's channels */
        SUF(project_rows)(dt_w, dt_b, R, Dn, o, Bn, xdbl, X, y, Dn);
    for (i64 b = 0; b < Bn; b++) {
        REAL *yb = y + b * Dn;
        const REAL *xb = xdbl + b * X, *xcb = xc + b * Dn, *zgb = zg + b * Dn;
#pragma omp simd
        for (i64 c = c0; c < c1; c++) yb[c] = SUF(softplus)(yb[c]); /* Δ */
        for (i64 c = c0; c < c1; c++) { /* the selective step, D, the gate */
            REAL *h = H + (b * Dn + c) * N;
            const REAL v = SUF(step_channel)(h, h, A + c * N, xb + R, xb + R + N, yb[c], xcb[c], N);
            yb[c] = (v + (Dskip ? Dskip[c] * xcb[c] : 0)) * zgb[c];
        }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (i64 o = 0; o < M; o += 4) /* out_proj */
        SUF(project_rows)(out_w, out_b, Dn, M, o, Bn, y, Dn, new_hid, M);
}

/* The decoding step of n Mamba-1 blocks in order (layers[l] reads layers[l-1]'s outputs), then
   the LM head when head is not NULL, in one parallel region: one call per token for the whole stack, so the threads stay awake between
   blocks and Python does not run between them (measured: each block's return to Python cost
   about 100 µs, most of it the interpreter missing the caches the block's weights had filled). */
void SUF(mamba_blocks_step)(const BlockStepArgs *layers, i64 n, const HeadArgs *head) {
#pragma omp parallel num_threads((int)layers[0].nthreads)
    {
        for (i64 l = 0; l < n; l++) SUF(block_step)(layers + l);
        if (head) { /* the final norm and the LM head, on the last block's outputs and scratch */
            const BlockStepArgs *a = layers + n - 1;
            const i64 Bn = a->batch, M = a->d_model;
            REAL *res = (REAL *)a->new_residual, *normed = (REAL *)a->work;
#pragma omp for schedule(static)
            for (i64 b = 0; b < Bn; b++)
                SUF(add_rms_norm)((const REAL *)a->new_hidden + b * M, res + b * M, (const REAL *)head->norm_w,
                                  head->eps, M, res + b * M, normed + b * M);
#pragma omp for schedule(static)
            for (i64 o = 0; o < head->vocab; o += 4)
                SUF(project_rows)((const REAL *)head->weight, NULL, M, head->vocab, o, Bn, normed, M,
                                  (REAL *)head->logits, head->vocab);
        }
    }
}

/* out[i] = Σ over the region's threads th of part[th·stride + i], i < n: per-thread sums added in
   thread order, so the same bits on every run with as many threads. Run by every thread of the
   parallel region, after a barrier. */
static inline void SUF(sum_parts)(const REAL *part, i64 stride, i64 n, REAL *out) {
    const i64 team = omp_get_num_threads();
#pragma omp for schedule(static)
    for (i64 i = 0; i < n; i++) {
        REAL sum = 0;
        for (i64 th = 0; th < team; th++) sum += part[th * stride + i];
        out[i] = sum;
    }
}

/* One step's pre-activation of every channel: v[d] = bias[d] + Σ_k wt[k][d]·x[t - K + 1 + k][d],
   taps before the sequence's first step lo left out. */
static inline void SUF(conv_row)(const ConvArgs *a, const REAL *xb, i64 t, i64 lo, REAL *v) {
    const i64 Dn = a->dim, K = a->K;
    const REAL *wt = (const REAL *)a->wt, *bias = (const REAL *)a->bias;
    for (i64 d = 0; d < Dn; d++) v[d] = bias ? bias[d] : 0;
    for (i64 k = 0; k < K; k++) {
        const i64 p = t - (K - 1) + k;
        if (p < lo) continue;
        const REAL *xp = xb + p * a->sx, *wk = wt + k * Dn;
#pragma omp simd
        for (i64 d = 0; d < Dn; d++) v[d] += wk[d] * xp[d];
    }
}

/* Forward of the convolution (ConvArgs): rows (batch, step) split among the threads, channels
   vectorised. */
void SUF(conv_fwd)(const ConvArgs *a) {
    const i64 L = a->length, Dn = a->dim, rows = a->batch * L;
#pragma omp parallel for num_threads((int)a->nthreads) schedule(static) if (rows * Dn * a->K >= 65536)
    for (i64 r = 0; r < rows; r++) {
        const i64 b = r / L, t = r % L;
        i64 lo, hi;
        seq_bounds(a->cu_seqlens, a->nseq, L, t, &lo, &hi);
        REAL *v = (REAL *)a->y + r * Dn;
        SUF(conv_row)(a, (const REAL *)a->x + b * a->sxb, t, lo, v);
        if (a->silu) {
#pragma omp simd
            for (i64 d = 0; d < Dn; d++) v[d] *= SUF(sigmoid)(v[d]);
        }
        if (a->yT) { /* consecutive rows of a thread fill consecutive elements of each yT row */
            REAL *yT = (REAL *)a->yT + b * Dn * L + t;
            for (i64 d = 0; d < Dn; d++) yT[d * L] = v[d];
        }
    }
}

/* Backward of the convolution. Each thread takes a contiguous block of rows and walks it from
   its end, keeping the gradient of the pre-activation (g·silu'(v), v recomputed) of its last K
   rows in a ring: d_x of row r needs rows r .. r+K-1 (those in r's sequence), so the K - 1 rows
   past the block are recomputed rather than shared. d_wt and d_bias are summed per thread and
   the threads' sums added in thread order (the same bits on every run with as many threads). */
void SUF(conv_bwd)(const ConvArgs *a) {
    const i64 L = a->length, Dn = a->dim, K = a->K, rows = a->batch * L;
    const REAL *wt = (const REAL *)a->wt, *grad = (const REAL *)a->grad;
    REAL *part = (REAL *)a->part;
#pragma omp parallel num_threads((int)a->nthreads)
    {
        const i64 nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const i64 r0 = tid * rows / nt, r1 = (tid + 1) * rows / nt;
        REAL *acc = part + tid * (K + 1) * Dn; /* d_wt (K, D), then d_bias (D) */
        REAL *ring = part + a->nthreads * (K + 1) * Dn + tid * K * Dn;
        REAL *gsum = part + a->nthreads * (2 * K + 1) * Dn + tid * Dn; /* a row's grad + gradT */
        for (i64 i = 0; i < (K + 1) * Dn; i++) acc[i] = 0;
        const i64 top = r1 + K - 1 < rows ? r1 + K - 1 : rows;
        for (i64 r = top - 1; r >= r0; r--) {
            const i64 b = r / L, t = r % L;
            i64 lo, hi;
            seq_bounds(a->cu_seqlens, a->nseq, L, t, &lo, &hi);
            const REAL *xb = (const REAL *)a->x + b * a->sxb, *gr = grad ? grad + r * Dn : NULL;
            if (a->gradT || !gr) { /* the row's gradient from both outputs */
                const REAL *gT = a->gradT ? (const REAL *)a->gradT + b * Dn * L + t : NULL;
                for (i64 d = 0; d < Dn; d++) gsum[d] = (gr ? gr[d] : 0) + (gT ? gT[d * L] : 0);
                gr = gsum;
            }
            REAL *gv = ring + (r % K) * Dn;
            if (a->silu) {
                SUF(conv_row)(a, xb, t, lo, gv);
#pragma omp simd
                for (i64 d = 0; d < Dn; d++) {
                    const REAL sg = SUF(sigmoid)(gv[d]);
                    gv[d] = gr[d] * sg * (1 + gv[d] * (1 - sg));
                }
            } else {
                for (i64 d = 0; d < Dn; d++) gv[d] = gr[d];
            }
            if (r >= r1) continue; /* a row past the block: only its gradient, for the rows before */
            for (i64 k = 0; k < K; k++) {
                const i64 p = t - (K - 1) + k;
                if (p < lo) continue;
                const REAL *xp = xb + p * a->sx;
                REAL *ak = acc + k * Dn;
#pragma omp simd
                for (i64 d = 0; d < Dn; d++) ak[d] += gv[d] * xp[d];
            }
            REAL *ab = acc + K * Dn, *dx = (REAL *)a->d_x + r * Dn;
#pragma omp simd
            for (i64 d = 0; d < Dn; d++) {
                ab[d] += gv[d];
                dx[d] = wt[(K - 1) * Dn + d] * gv[d];
            }
            for (i64 j = 1; j < K && t + j < hi; j++) { /* row r + j's tap K-1-j read row r */
                const REAL *gj = ring + ((r + j) % K) * Dn, *wj = wt + (K - 1 - j) * Dn;
#pragma omp simd
                for (i64 d = 0; d < Dn; d++) dx[d] += wj[d] * gj[d];
            }
        }
#pragma omp barrier
        SUF(sum_parts)(part, (K + 1) * Dn, K * Dn, (REAL *)a->d_wt);
        if (a->d_bias) SUF(sum_parts)(part + K * Dn, (K + 1) * Dn, Dn, (REAL *)a->d_bias);
    }
}

/* The normalised input of a group: v = x, or x·silu(z) with gate 1. */
static inline REAL SUF(norm_in)(const NormArgs *a, REAL x, REAL z) {
    return a->gate == 1 ? x * z * SUF(sigmoid)(z) : x;
}

/* RMSNorm forward (NormArgs): a row per iteration. */
void SUF(rms_norm_fwd)(const NormArgs *a) {
    const i64 M = a->M, G = a->group, ng = M / G;
    const REAL *w = (const REAL *)a->w;
#pragma omp parallel for num_threads((int)a->nthreads) schedule(static) if (a->rows * M >= 65536)
    for (i64 r = 0; r < a->rows; r++)
        for (i64 g = 0; g < ng; g++) {
            const i64 o = r * M + g * G;
            const REAL *x = (const REAL *)a->x + o, *z = a->z ? (const REAL *)a->z + r * a->sz + g * G : x;
            REAL *y = (REAL *)a->y + o, ss = 0;
            const REAL *wg = w + g * G;
#pragma omp simd reduction(+ : ss)
            for (i64 m = 0; m < G; m++) {
                const REAL v = SUF(norm_in)(a, x[m], z[m]);
                ss += v * v;
            }
            const REAL rs = 1 / sqrt(ss / G + (REAL)a->eps);
            ((REAL *)a->rstd)[r * ng + g] = rs;
#pragma omp simd
            for (i64 m = 0; m < G; m++) {
                const REAL n = SUF(norm_in)(a, x[m], z[m]) * rs * wg[m];
                y[m] = a->gate == 2 ? n * z[m] * SUF(sigmoid)(z[m]) : n;
            }
        }
}

/* Its backward. With v the normalised input (x, or x·silu(z)), v̂ = v·rstd and gn the gradient
   reaching v̂·w (grad, or grad·silu(z) with gate 2): d_v = rstd·(gn·w - v̂·mean(gn·w·v̂)),
   d_w = Σ_rows gn·v̂; then d_x and d_z through the gate. Each thread sums d_w over its own
   block of rows; the blocks' sums are added in thread order (the same bits on every run with as
   many threads). */
void SUF(rms_norm_bwd)(const NormArgs *a) {
    const i64 M = a->M, G = a->group, ng = M / G, rows = a->rows;
    const REAL *w = (const REAL *)a->w;
    REAL *part = (REAL *)a->part;
#pragma omp parallel num_threads((int)a->nthreads)
    {
        const i64 nt = omp_get_num_threads(), tid = omp_get_thread_num();
        REAL *acc = part + tid * M;
        for (i64 m = 0; m < M; m++) acc[m] = 0;
        for (i64 r = tid * rows / nt; r < (tid + 1) * rows / nt; r++)
            for (i64 g = 0; g < ng; g++) {
                const i64 o = r * M + g * G;
                const REAL *x = (const REAL *)a->x + o, *z = a->z ? (const REAL *)a->z + r * a->sz + g * G : x;
                const REAL *gr = (const REAL *)a->grad + o, *wg = w + g * G;
                REAL *dx = (REAL *)a->d_x + o, *dz = a->d_z ? (REAL *)a->d_z + o : NULL, *ag = acc + g * G, c = 0;
                const REAL rs = ((const REAL *)a->rstd)[r * ng + g];
#pragma omp simd reduction(+ : c)
                for (i64 m = 0; m < G; m++) {
                    const REAL gn = a->gate == 2 ? gr[m] * z[m] * SUF(sigmoid)(z[m]) : gr[m];
                    c += gn * wg[m] * SUF(norm_in)(a, x[m], z[m]);
                }
                c *= rs / G;
#pragma omp simd
                for (i64 m = 0; m < G; m++) {
                    const REAL sg = a->gate ? SUF(sigmoid)(z[m]) : 1, dsilu = sg * (1 + z[m] * (1 - sg));
                    const REAL gn = a->gate == 2 ? gr[m] * z[m] * sg : gr[m];
                    const REAL vh = SUF(norm_in)(a, x[m], z[m]) * rs, dv = rs * (gn * wg[m] - vh * c);
                    ag[m] += gn * vh;
                    if (a->gate == 1) { /* v = x·silu(z) */
                        dx[m] = dv * z[m] * sg;
                        dz[m] = dv * x[m] * dsilu;
                    } else {
                        dx[m] = dv;
                        if (a->gate == 2) dz[m] = gr[m] * vh * wg[m] * dsilu;
                    }
                }
            }
#pragma omp barrier
        SUF(sum_parts)(part, M, M, (REAL *)a->d_w);
    }
}

#endif
