/* The decoding step of a whole stack of Mamba-2 blocks, and the LM head, in one call per token
   (ssm/ops/decode.py calls it), as decode.c's mamba_blocks_step is for Mamba-1: a block's
   residual add and RMSNorm, in_proj, the causal conv's step and SiLU on xBC, the SSD step of
   every head (ngroups groups of B and C), the gated RMSNorm, out_proj, and the block's gated MLP
   (d_intermediate) when it has one. library.c includes this file once per REAL, after decode.c
   (whose dot_rows / project_rows / add_rms_norm / head_step it uses): the argument struct the
   first time only.

   Shape symbols: B batch, M d_model, H heads, P head dim, S = H·P the SSM's channels (d_ssm),
   N state size, G groups of B and C, K the conv's width, C = S + 2·G·N the conv's channels,
   Q the in-mixer MLP branch's channels (d_inner − d_ssm, usually 0), F the block MLP's hidden
   size, E = 2·Q + S + C + H in_proj's rows. */

#ifndef SSM_DECODE_MAMBA2_TYPES
#define SSM_DECODE_MAMBA2_TYPES

/* Arguments of a whole Mamba-2 block's decoding step (one token per sequence):
     residual ← hidden + residual;  u = RMSNorm(residual; norm_w, eps)
     (z0, x0, z, xBC, dt) = in_w·u + in_b                      rows Q, Q, S, C, H
     conv_state ← [conv_state[1:], xBC];  (x, B, C) = SiLU(Σ_k conv_w·conv_state + conv_b)
     Δ_h = clamp(softplus(dt_h + dt_bias_h), dt_min, dt_max);  head h reads group h / (H / G)
     h_{h,p,n} ← exp(Δ_h·A_h)·h + Δ_h·x_{h,p}·B_{g,n};  y_{h,p} = Σ_n C_{g,n}·h + D·x_{h,p}
     y = RMSNorm(y·SiLU(z)) per group of gate_group channels, times gate_w   (norm_before_gate 0)
       = RMSNorm(y)·SiLU(z)                                                   (norm_before_gate 1)
       = y·SiLU(z)                                                            (gate_w NULL)
     hidden = out_w·[SiLU(z0)·x0, y] + out_b
   then with fc1_w (the block's MLP): residual ← hidden + residual;
     (f, g) = fc1_w·RMSNorm(residual; norm2_w, eps2);  hidden = fc2_w·(f·SiLU(g)).
   Every tensor contiguous, in one dtype, but the matrices (WMat: any format of decode_weights.c).
   Shapes: hidden, residual, new_hidden, new_residual
   (B, M) (residual NULL in the first block); norm_w (M); in_w (E, M), in_b (E) or NULL; conv_w
   (C, K), conv_b (C) or NULL; conv_state (B, C, K) and ssm_state (B, H, P, N), updated in
   place; dt_bias, A (H); Dskip (H) or, with D_per_channel, (S), or NULL; gate_w (S) or NULL, its
   groups of gate_group channels (a multiple of P dividing S); out_w (M, Q + S), out_b (M) or
   NULL; norm2_w (M), fc1_w (2·F, M), fc2_w (M, F), or fc1_w NULL (F 0);
   work: scratch of B·(M + E + C + Q + S + H + 3·F) elements. */
typedef struct {
    i64 batch, d_model, H, P, N, G, K, Q, F, gate_group, D_per_channel, norm_before_gate, nthreads;
    double eps, gate_eps, eps2, dt_min, dt_max;
    const void *hidden, *residual, *norm_w, *in_b, *conv_w, *conv_b;
    void *conv_state;
    const void *dt_bias, *A, *Dskip;
    void *ssm_state;
    const void *gate_w, *out_b, *norm2_w;
    void *work, *new_hidden, *new_residual;
    WMat in_w, out_w, fc1_w, fc2_w; /* the matrices, in any format of decode_weights.c; fc1_w.w NULL: no MLP */
} Mamba2StepArgs;

/* This thread's share [*lo, *hi) of n items, in contiguous runs by thread number. */
static inline void thread_share(i64 n, i64 *lo, i64 *hi) {
    const i64 team = omp_get_num_threads(), tid = omp_get_thread_num();
    *lo = tid * n / team;
    *hi = (tid + 1) * n / team;
}

#endif /* SSM_DECODE_MAMBA2_TYPES */

/* ------------------------------------------------------------------ for one REAL */

/* A block's gated MLP after its mixer, run by every thread of the calling parallel region (each
   row of new_hid and new_res (Bn, M) updated in place): residual ← hidden + residual;
   (f, g) = fc1 · RMSNorm(residual; norm2_w, eps2); hidden = fc2 · (f·SiLU(g)). Scratch: normed
   (Bn, M), fc (Bn, 2F), gated (Bn, F). Shared by the Mamba-2 and Mamba-3 steps. */
static void SUF(gated_mlp_step)(i64 Bn, i64 M, i64 F, const WMat *fc1, const WMat *fc2, const REAL *norm2_w,
                                double eps2, REAL *new_hid, REAL *new_res, REAL *normed, REAL *fc, REAL *gated) {
#pragma omp for schedule(static)
    for (i64 b = 0; b < Bn; b++)
        SUF(add_rms_norm)(new_hid + b * M, new_res + b * M, norm2_w, eps2, M, new_res + b * M, normed + b * M);
    SUF(project)(fc1, NULL, M, 2 * F, Bn, normed, M, fc, 2 * F);
#pragma omp for schedule(static)
    for (i64 i = 0; i < Bn * F; i++) {
        const REAL f = fc[i / F * 2 * F + i % F], g = fc[i / F * 2 * F + F + i % F];
        gated[i] = f * g * SUF(sigmoid)(g);
    }
    SUF(project)(fc2, NULL, F, M, Bn, gated, F, new_hid, M);
}

/* A Mamba-2 block's decoding step (Mamba2StepArgs), run by every thread of the calling parallel
   region. As in decode.c's block_step, each projection is split by output rows across the
   threads (the weight reads bound a batch-1 step); the per-channel stages split the conv's
   channels, then the heads (each head's state, P·N elements, is read and written by one thread),
   with a barrier between stages that read what another thread wrote. The gated norm's sums of
   squares are taken per head in the head stage and added up per group after a barrier, so that
   the norm too is split by heads (with one group, one thread would otherwise norm every channel). */
static void SUF(mamba2_block_step)(const Mamba2StepArgs *a) {
    const i64 Bn = a->batch, M = a->d_model, H = a->H, P = a->P, N = a->N, G = a->G, K = a->K, Q = a->Q, F = a->F;
    const i64 S = H * P, C = S + 2 * G * N, E = 2 * Q + S + C + H, heads_per_group = H / G;
    const REAL *hid = (const REAL *)a->hidden, *res = (const REAL *)a->residual;
    const REAL *in_b = (const REAL *)a->in_b;
    const REAL *conv_w = (const REAL *)a->conv_w, *conv_b = (const REAL *)a->conv_b;
    const REAL *dt_bias = (const REAL *)a->dt_bias, *A = (const REAL *)a->A, *Dskip = (const REAL *)a->Dskip;
    const REAL *gate_w = (const REAL *)a->gate_w, *out_b = (const REAL *)a->out_b;
    REAL *conv_state = (REAL *)a->conv_state, *state = (REAL *)a->ssm_state;
    REAL *new_hid = (REAL *)a->new_hidden, *new_res = (REAL *)a->new_residual;
    const REAL dt_min = (REAL)a->dt_min, dt_max = (REAL)a->dt_max;
    /* scratch: normed (Bn, M); proj (Bn, E), in_proj's output; xbc (Bn, C), the conv's output
       after SiLU; yin (Bn, Q + S), out_proj's input; ssq (Bn, H), each head's sum of squares;
       fc (Bn, 2F) then gated (Bn, F), the block MLP's */
    REAL *normed = (REAL *)a->work, *proj = normed + Bn * M, *xbc = proj + Bn * E, *yin = xbc + Bn * C;
    REAL *ssq = yin + Bn * (Q + S), *fc = ssq + Bn * H, *gated = fc + Bn * 2 * F;
#pragma omp for schedule(static)
    for (i64 b = 0; b < Bn; b++)
        SUF(add_rms_norm)(hid + b * M, res ? res + b * M : NULL, (const REAL *)a->norm_w, a->eps, M,
                          new_res + b * M, normed + b * M);
    /* in_proj: z0, x0, z, xBC, dt */
    SUF(project)(&a->in_w, in_b, M, E, Bn, normed, M, proj, E);
    i64 c0, c1, q0, q1;
    thread_share(C, &c0, &c1);
    thread_share(Q, &q0, &q1);
    for (i64 b = 0; b < Bn; b++) { /* the conv's step and SiLU on this thread's channels; the MLP branch */
        const REAL *xin = proj + b * E + 2 * Q + S;
        REAL *xb = xbc + b * C;
        for (i64 c = c0; c < c1; c++) {
            REAL *st = conv_state + (b * C + c) * K, acc = conv_b ? conv_b[c] : 0;
            for (i64 k = 0; k + 1 < K; k++) st[k] = st[k + 1];
            st[K - 1] = xin[c];
            for (i64 k = 0; k < K; k++) acc += st[k] * conv_w[c * K + k];
            xb[c] = acc;
        }
#pragma omp simd
        for (i64 c = c0; c < c1; c++) xb[c] *= SUF(sigmoid)(xb[c]);
        const REAL *z0 = proj + b * E, *x0 = z0 + Q;
#pragma omp simd
        for (i64 q = q0; q < q1; q++) yin[b * (Q + S) + q] = z0[q] * SUF(sigmoid)(z0[q]) * x0[q];
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (i64 i = 0; i < Bn * H; i++) { /* the SSD step of head h of row b, D, the gate's first half */
        const i64 b = i / H, h = i % H, g = h / heads_per_group;
        const REAL *pb = proj + b * E, *z = pb + 2 * Q + h * P;
        const REAL *x = xbc + b * C + h * P, *Bg = xbc + b * C + S + g * N, *Cg = Bg + G * N;
        REAL dt = SUF(softplus)(pb[2 * Q + S + C + h] + dt_bias[h]);
        dt = dt < dt_min ? dt_min : dt > dt_max ? dt_max : dt;
        const REAL decay = EXP(dt * A[h]);
        REAL *hs = state + i * P * N, *y = yin + b * (Q + S) + Q + h * P;
        for (i64 p = 0; p < P; p++) {
            REAL *hp = hs + p * N, acc = 0;
            const REAL dx = dt * x[p];
#pragma omp simd reduction(+ : acc)
            for (i64 n = 0; n < N; n++) {
                hp[n] = decay * hp[n] + dx * Bg[n];
                acc += Cg[n] * hp[n];
            }
            y[p] = acc + (Dskip ? (a->D_per_channel ? Dskip[h * P + p] : Dskip[h]) * x[p] : 0);
        }
        REAL ss = 0;
        if (!gate_w || !a->norm_before_gate) { /* y·SiLU(z): the output, or what the norm takes */
#pragma omp simd reduction(+ : ss)
            for (i64 p = 0; p < P; p++) {
                y[p] *= z[p] * SUF(sigmoid)(z[p]);
                ss += y[p] * y[p];
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (i64 p = 0; p < P; p++) ss += y[p] * y[p];
        }
        ssq[i] = ss;
    }
    if (gate_w) {
        const i64 heads_per_norm = a->gate_group / P;
#pragma omp for schedule(static)
        for (i64 i = 0; i < Bn * H; i++) { /* the gated norm of head h, over its norm group */
            const i64 b = i / H, h = i % H, first = b * H + h / heads_per_norm * heads_per_norm;
            REAL ss = 0;
            for (i64 j = 0; j < heads_per_norm; j++) ss += ssq[first + j];
            const REAL scale = 1 / sqrt(ss / a->gate_group + (REAL)a->gate_eps);
            const REAL *w = gate_w + h * P, *z = proj + b * E + 2 * Q + h * P;
            REAL *y = yin + b * (Q + S) + Q + h * P;
            if (a->norm_before_gate) {
#pragma omp simd
                for (i64 p = 0; p < P; p++) y[p] = y[p] * scale * w[p] * (z[p] * SUF(sigmoid)(z[p]));
            } else {
#pragma omp simd
                for (i64 p = 0; p < P; p++) y[p] = y[p] * scale * w[p];
            }
        }
    }
    /* out_proj */
    SUF(project)(&a->out_w, out_b, Q + S, M, Bn, yin, Q + S, new_hid, M);
    if (!a->fc1_w.w) return;
    /* the block's MLP: residual ← hidden + residual; fc1; f·SiLU(g); fc2 */
    SUF(gated_mlp_step)(Bn, M, F, &a->fc1_w, &a->fc2_w, (const REAL *)a->norm2_w, a->eps2, new_hid, new_res, normed,
                        fc, gated);
}

/* The decoding step of n Mamba-2 blocks in order (layers[l] reads layers[l-1]'s outputs), then
   the LM head when head is not NULL, in one parallel region: one call per token for the whole
   stack, as mamba_blocks_step (decode.c) for Mamba-1. */
void SUF(mamba2_blocks_step)(const Mamba2StepArgs *layers, i64 n, const HeadArgs *head) {
#pragma omp parallel num_threads((int)layers[0].nthreads)
    {
        for (i64 l = 0; l < n; l++) SUF(mamba2_block_step)(layers + l);
        if (head) {
            const Mamba2StepArgs *a = layers + n - 1;
            SUF(head_step)(head, a->batch, a->d_model, (const REAL *)a->new_hidden, (REAL *)a->new_residual,
                           (REAL *)a->work);
        }
    }
}
