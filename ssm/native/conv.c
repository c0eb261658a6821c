/* The causal depthwise convolution of the Mamba layers (with its SiLU fused), forward and
   backward, on in_proj's output as it lies (ssm/ops/conv.py calls them). library.c includes
   this file once per REAL: the argument struct the first time only. */

#ifndef SSM_CONV_TYPES
#define SSM_CONV_TYPES

/* Arguments of the causal depthwise convolution of a Mamba layer, in the layout in_proj leaves it:
   x (B, L, D), channels contiguous, batch rows sxb and steps sx elements apart (in_proj's x half);
   wt (K, D) the taps (tap K-1 on the current step); bias (D) or NULL; with cu_seqlens (S + 1,),
   B = 1 and no tap reaches before its sequence's start (zeros there, as at step 0).
   Forward: y (B, L, D) contiguous = silu(conv) with silu, else conv; and when yT is not NULL the
   same values in yT (B, D, L) contiguous, the layout the scans read (no transposed copy of y).
   state (B, D, K) or NULL, strides sst (row, channel, tap), forward only and without cu_seqlens:
   the K inputs before step 0 of each row, most recent last (its first entry is never read):
   taps before step 0 read it instead of zeros, as a prefill continuing from a cache.
   Backward: from grad (B, L, D) contiguous (of y; NULL: zeros) plus gradT (B, D, L) contiguous
   (of yT; NULL: zeros), d_x (B, L, D) contiguous, d_wt (K, D), d_bias (D) or NULL; part:
   scratch of nthreads·(2K + 2)·D elements. */
typedef struct {
    i64 batch, length, dim, K, sxb, sx, nseq, silu, nthreads;
    const void *x, *wt, *bias;
    const i64 *cu_seqlens;
    const void *state;
    i64 sst[3];
    void *y, *yT;
    const void *grad, *gradT;
    void *d_x, *d_wt, *d_bias, *part;
} ConvArgs;

#endif /* SSM_CONV_TYPES */

/* ------------------------------------------------------------------ for one REAL */

/* One step's pre-activation of every channel: v[d] = bias[d] + Σ_k wt[k][d]·x[t - K + 1 + k][d],
   taps before the sequence's first step lo left out, or read from row b of a->state. */
static inline void SUF(conv_row)(const ConvArgs *a, const REAL *xb, i64 b, i64 t, i64 lo, REAL *v) {
    const i64 Dn = a->dim, K = a->K;
    const REAL *wt = (const REAL *)a->wt, *bias = (const REAL *)a->bias;
    for (i64 d = 0; d < Dn; d++) v[d] = bias ? bias[d] : 0;
    for (i64 k = 0; k < K; k++) {
        const i64 p = t - (K - 1) + k;
        if (p < lo) {
            if (a->state) { /* p - lo = -1 is the state's last tap */
                const REAL *sp = (const REAL *)a->state + b * a->sst[0] + (K + p - lo) * a->sst[2];
                const REAL *wk = wt + k * Dn;
                for (i64 d = 0; d < Dn; d++) v[d] += wk[d] * sp[d * a->sst[1]];
            }
            continue;
        }
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
        SUF(conv_row)(a, (const REAL *)a->x + b * a->sxb, b, t, lo, v);
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
                SUF(conv_row)(a, xb, b, t, lo, gv);
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
