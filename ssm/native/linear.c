/* The first-order linear scan h_t = a_t·h_{t-1} + x_t on the CPU, forward and backward, in
   blocks of columns (ssm/scan/cpu.py calls them). library.c includes this file once per REAL:
   the argument struct the first time only. */

#ifndef SSM_LINEAR_TYPES
#define SSM_LINEAR_TYPES

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

#endif /* SSM_LINEAR_TYPES */

/* ------------------------------------------------------------------ for one REAL */

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
        const fp_mode fp = flush_subnormals();
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
        restore_fp_mode(fp);
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
        const fp_mode fp = flush_subnormals();
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
        restore_fp_mode(fp);
    }
}
