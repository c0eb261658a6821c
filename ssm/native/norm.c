/* RMSNorm and Mamba-2's gated, grouped RMSNorm, forward and backward, one pass each
   (ssm/ops/norm.py calls them). library.c includes this file once per REAL: the argument struct
   the first time only. */

#ifndef SSM_NORM_TYPES
#define SSM_NORM_TYPES

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

#endif /* SSM_NORM_TYPES */

/* ------------------------------------------------------------------ for one REAL */

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
