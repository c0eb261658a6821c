/* The decoding step of a whole stack of Mamba-1 blocks, and the LM head, in one call per token
   (ssm/ops/decode.py calls it): a block's residual add, RMSNorm, projections, conv step and
   selective step (step_channel, from selective.c), the threads staying in one parallel region
   across blocks. library.c includes this file once per REAL, after selective.c: the argument
   structs the first time only. */

#ifndef SSM_DECODE_TYPES
#define SSM_DECODE_TYPES

/* Arguments of a whole Mamba-1 block's decoding step (one token per sequence): residual ←
   hidden + residual; RMSNorm; in_proj; the causal conv's step and SiLU; x_proj; dt_proj; the
   selective step gated by SiLU(z); out_proj. Every tensor contiguous, in one dtype, but the matrices
   (WMat: any format of decode_weights.c). Shapes:
   hidden, residual, new_hidden, new_residual (batch, d_model) (residual NULL in the first
   block); norm_w (d_model); in_w (2·dim, d_model); conv_w (dim, K); conv_state (batch, dim, K)
   and ssm_state (batch, dim, N), both updated in place; x_w (R + 2N, dim); dt_w (dim, R);
   dt_b, Dskip (dim); A (dim, N); out_w (d_model, dim); in_b, conv_b, out_b: bias or NULL;
   work: scratch of batch·(d_model + 5·dim + R + 2N) elements. */
typedef struct {
    i64 batch, d_model, dim, N, R, K, nthreads;
    double eps;
    const void *hidden, *residual, *norm_w, *in_b, *conv_w, *conv_b;
    void *conv_state;
    const void *dt_b, *A, *Dskip;
    void *ssm_state;
    const void *out_b;
    void *work, *new_hidden, *new_residual;
    WMat in_w, x_w, dt_w, out_w; /* the matrices, in any format of decode_weights.c */
} BlockStepArgs;

/* The language model's head after the last block: residual ← hidden + residual, RMSNorm
   (norm_w (d_model), eps), logits (batch, vocab) = weight (vocab, d_model) · normed. */
typedef struct {
    i64 vocab;
    double eps;
    const void *norm_w;
    void *logits;
    WMat weight;
} HeadArgs;

#endif /* SSM_DECODE_TYPES */

/* ------------------------------------------------------------------ for one REAL */

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
   with x_b = x + b·sx and y_b = y + b·sy: four of W's rows read once for the whole batch. With
   qa->q set (float32 only: quantize_acts), the products take row b's int8 activations from qa
   instead of x_b. */
static inline void SUF(project_rows)(const WMat *W, const REAL *bias, i64 n_in, i64 n_out, i64 o, i64 Bn,
                                     const REAL *x, i64 sx, REAL *y, i64 sy, const QAct *qa) {
    const i64 nr = n_out - o < 4 ? n_out - o : 4;
    for (i64 b = 0; b < Bn; b++) {
        REAL *yb = y + b * sy + o;
#if REAL_IS_F32
        if (qa->q) {
            const int8_t *q = qa->q + b * qa->qs;
            const float *d = qa->d + b * qa->nb;
            if (!simd_qdot_rows(W, n_in, o, nr, q, d, yb)) qdot_rows_portable(W, n_in, o, nr, q, d, yb);
        } else
#else
        (void)qa;
#endif
            SUF(dot_rows_any)(W, n_in, o, nr, x + b * sx, yb);
        if (bias)
            for (i64 r = 0; r < nr; r++) yb[r] += bias[o + r];
    }
}

/* The int8 activations of x's Bn rows for a product with W, when W takes them (quantize_acts). */
static inline QAct SUF(acts)(const WMat *W, const REAL *x, i64 sx, i64 Bn, i64 n_in) {
#if REAL_IS_F32
    return quantize_acts(W, x, sx, Bn, n_in);
#else
    (void)W, (void)x, (void)sx, (void)Bn, (void)n_in;
    const QAct none = {NULL, NULL, 0, 0};
    return none;
#endif
}

/* y_b = W·x_b + bias for every batch row b (as project_rows), all n_out rows, run by every
   thread of the calling parallel region: each thread rounds x to int8 for itself where W takes
   int8 activations, then the threads split W's rows (an omp for, its barrier at the end). */
static void SUF(project)(const WMat *W, const REAL *bias, i64 n_in, i64 n_out, i64 Bn, const REAL *x, i64 sx,
                         REAL *y, i64 sy) {
    const QAct qa = SUF(acts)(W, x, sx, Bn, n_in);
#pragma omp for schedule(static)
    for (i64 o = 0; o < n_out; o += 4) SUF(project_rows)(W, bias, n_in, n_out, o, Bn, x, sx, y, sy, &qa);
}

/* y (n_out) = W·x (x: n inputs) on nthreads threads, split by rows as the steps split theirs: one
   projection alone, for the tests and the benchmark of the matrix reads (decode_weights.c,
   decode_simd.c) at each format and instruction-set level. */
void SUF(decode_matvec)(const WMat *W, i64 n, i64 n_out, const REAL *x, REAL *y, i64 nthreads) {
    (void)nthreads; /* unused without OpenMP */
#pragma omp parallel num_threads((int)nthreads)
    SUF(project)(W, NULL, n, n_out, 1, x, n, y, n_out);
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
    const REAL *in_b = (const REAL *)a->in_b;
    const REAL *conv_w = (const REAL *)a->conv_w, *conv_b = (const REAL *)a->conv_b;
    const REAL *dt_b = (const REAL *)a->dt_b;
    const REAL *A = (const REAL *)a->A, *Dskip = (const REAL *)a->Dskip;
    const REAL *out_b = (const REAL *)a->out_b;
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
    /* in_proj: x and z */
    SUF(project)(&a->in_w, in_b, M, 2 * Dn, Bn, normed, M, xz, 2 * Dn);
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
    /* x_proj: Δ's low rank, B, C */
    SUF(project)(&a->x_w, NULL, Dn, X, Bn, xc, Dn, xdbl, X);
    const QAct qdt = SUF(acts)(&a->dt_w, xdbl, X, Bn, R);
    for (i64 o = c0; o < c1; o += 4) /* dt_proj, on this thread's channels */
        SUF(project_rows)(&a->dt_w, dt_b, R, Dn, o, Bn, xdbl, X, y, Dn, &qdt);
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
    /* out_proj */
    SUF(project)(&a->out_w, out_b, Dn, M, Bn, y, Dn, new_hid, M);
}

/* The final norm and the LM head after the last block, run by every thread of the calling
   parallel region: res ← hid + res (in place), normed = RMSNorm(res) in the last block's scratch,
   logits = weight · normed. Shared by the Mamba-1 and Mamba-2 stacks (decode_mamba2.c). */
static void SUF(head_step)(const HeadArgs *head, i64 Bn, i64 M, const REAL *hid, REAL *res, REAL *normed) {
#pragma omp for schedule(static)
    for (i64 b = 0; b < Bn; b++)
        SUF(add_rms_norm)(hid + b * M, res + b * M, (const REAL *)head->norm_w, head->eps, M, res + b * M,
                          normed + b * M);
    SUF(project)(&head->weight, NULL, M, head->vocab, Bn, normed, M, (REAL *)head->logits, head->vocab);
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
            SUF(head_step)(head, a->batch, a->d_model, (const REAL *)a->new_hidden, (REAL *)a->new_residual,
                           (REAL *)a->work);
        }
    }
}
