/* The decoding step of a whole stack of Mamba-3 blocks (SISO or MIMO), and the LM head, in one
   call per token (ssm/ops/decode.py calls it), as decode.c's mamba_blocks_step is for Mamba-1 and
   decode_mamba2.c's for Mamba-2: a block's residual add and RMSNorm, in_proj, the RMSNorm and
   per-head bias of B and C, the rotary phase, the trapezoidal step of every head, the gate (or
   the per-head gated norm), out_proj, and the block's gated MLP when it has one. library.c
   includes this file once per REAL, after decode_mamba2.c (whose thread_share it uses, with
   decode.c's project_rows / add_rms_norm / head_step): the argument struct the first time only.

   Shape symbols: B batch, M d_model, H heads, P head dim, S = H·P (d_inner), N state size,
   G groups of B and C, R the MIMO rank (1: SISO), T rotary pairs, F the block MLP's hidden
   size, E = 2·S + 2·R·G·N + 3·H + T in_proj's rows. */

#ifndef SSM_DECODE_MAMBA3_TYPES
#define SSM_DECODE_MAMBA3_TYPES

/* Arguments of a whole Mamba-3 block's decoding step (one token per sequence), SISO (R = 1, no
   mimo_*) or MIMO of rank R:
     residual ← hidden + residual;  u = RMSNorm(residual; norm_w, eps)
     (z, x, B, C, dt, a, λ, θ) = in_w·u                      rows S, S, R·G·N, R·G·N, H, H, H, T
     B_{r,g} = RMSNorm(B_{r,g}; B_norm_w, bc_eps) per rank and group, likewise C; head h reads
       group h / (H / G)
     Δ_h = softplus(dt_h + dt_bias_h);  A_h = min(−softplus(a_h), −A_floor);  λ_h = sigmoid(λ_h)
     φ_{h,m} ← φ_{h,m} + Δ_h·π·tanh(θ_m);  k_r = Rot(φ_h)(B_{r,g} + B_bias_{h,r}),
       q_r = Rot(φ_h)(C_{r,g} + C_bias_{h,r})  (pairs (2m, 2m+1), or with halved (m, m + N/2), m < T)
     v_r = x_h ⊙ mimo_x_{h,r}, v'_r = value_h ⊙ mimo_x_{h,r}  (SISO: v = x, v' = value)
     α = exp(Δ·A), β = (1 − λ)·Δ·α, γ = λ·Δ
     h_{h,p,n} ← α·h + Σ_r (β·v'_{r,p}·key_{r,h,n} + γ·v_{r,p}·k_{r,n});  y_{r,p} = Σ_n q_{r,n}·h + D_h·v_{r,p}
     key_{r,h} ← k_r, value_h ← x_h, φ reduced modulo 2π
     g_r = z_h ⊙ mimo_z_{h,r} (SISO: z_h);  y_r ← y_r·SiLU(g_r), or with gate_w
       RMSNorm(y_r) (over P; gate_eps)·gate_w_h·SiLU(g_r)
     out_h = Σ_r mimo_o_{h,r} ⊙ y_r (SISO: y);  hidden = out_w·out
   then with fc1_w (the block's MLP) as in decode_mamba2.c. Every tensor contiguous, in one dtype, but the matrices (WMat). Shapes:
   hidden, residual, new_hidden, new_residual (B, M) (residual NULL in the first block);
   norm_w (M); B_norm_w, C_norm_w (N); B_bias, C_bias (H, R, N); dt_bias (H); Dskip (H) or NULL;
   mimo_x, mimo_z, mimo_o (H, R, P) or NULL (SISO); phase (B, H, T), ssm_state (B, H, P, N),
   key (B, R, H, N), value (B, H, P), all updated in place; gate_w (S) or NULL; in_w (E, M);
   out_w (M, S); norm2_w (M), fc1_w (2·F, M), fc2_w (M, F), or fc1_w NULL (F 0);
   work: scratch of B·(M + E + 2·R·G·N + 2·H·R·N + H·R·P + S + 3·F) elements. */
typedef struct {
    i64 batch, d_model, H, P, N, G, R, T, F, halved, nthreads;
    double eps, bc_eps, gate_eps, eps2, A_floor;
    const void *hidden, *residual, *norm_w, *B_norm_w, *C_norm_w, *B_bias, *C_bias, *dt_bias, *Dskip;
    const void *mimo_x, *mimo_z, *mimo_o;
    void *phase, *ssm_state, *key, *value;
    const void *gate_w, *norm2_w;
    void *work, *new_hidden, *new_residual;
    WMat in_w, out_w, fc1_w, fc2_w; /* the matrices, in any format of decode_weights.c; fc1_w.w NULL: no MLP */
} Mamba3StepArgs;

#endif /* SSM_DECODE_MAMBA3_TYPES */

/* ------------------------------------------------------------------ for one REAL */

/* Pairs m0 .. m0 + n - 1 of w (N) rotated in place by the angles whose cos and sin are cs[0..n),
   sn[0..n): (w0, w1) → (w0·cos − w1·sin, w0·sin + w1·cos); pair m is (2m, 2m + 1), or with
   halved (m, m + N/2). */
static inline void SUF(rotate_pairs)(REAL *w, const REAL *cs, const REAL *sn, i64 m0, i64 n, i64 N, i64 halved) {
    for (i64 j = 0; j < n; j++) {
        const i64 m = m0 + j, i0 = halved ? m : 2 * m, i1 = halved ? m + N / 2 : 2 * m + 1;
        const REAL w0 = w[i0], w1 = w[i1];
        w[i0] = w0 * cs[j] - w1 * sn[j];
        w[i1] = w0 * sn[j] + w1 * cs[j];
    }
}

/* A Mamba-3 block's decoding step (Mamba3StepArgs), run by every thread of the calling parallel
   region: the projections split by output rows, the B / C norms by (row, group), the heads by
   (row, head), each head's state (P·N), key, value and phase read and written by one thread. */
static void SUF(mamba3_block_step)(const Mamba3StepArgs *a) {
    const i64 Bn = a->batch, M = a->d_model, H = a->H, P = a->P, N = a->N, G = a->G, R = a->R, T = a->T, F = a->F;
    const i64 S = H * P, RGN = R * G * N, E = 2 * S + 2 * RGN + 3 * H + T, heads_per_group = H / G;
    const i64 x_at = S, B_at = 2 * S, C_at = B_at + RGN, dt_at = C_at + RGN, A_at = dt_at + H, lam_at = A_at + H;
    const i64 th_at = lam_at + H;
    const REAL *hid = (const REAL *)a->hidden, *res = (const REAL *)a->residual;
    const REAL *B_bias = (const REAL *)a->B_bias, *C_bias = (const REAL *)a->C_bias;
    const REAL *dt_bias = (const REAL *)a->dt_bias, *Dskip = (const REAL *)a->Dskip, *gate_w = (const REAL *)a->gate_w;
    const REAL *mimo_x = (const REAL *)a->mimo_x, *mimo_z = (const REAL *)a->mimo_z, *mimo_o = (const REAL *)a->mimo_o;
    REAL *phase = (REAL *)a->phase, *state = (REAL *)a->ssm_state, *key = (REAL *)a->key, *value = (REAL *)a->value;
    REAL *new_hid = (REAL *)a->new_hidden, *new_res = (REAL *)a->new_residual;
    const REAL two_pi = (REAL)(2 * 3.14159265358979323846), pi = (REAL)3.14159265358979323846;
    /* scratch: normed (Bn, M); proj (Bn, E), in_proj's output; bc (Bn, 2·R·G·N), the normed B
       then C; kq (Bn, H, R, 2N), each head's rotated k_r then q_r; yr (Bn, H, R, P), each head's
       output per rank; y (Bn, S), out_proj's input; fc (Bn, 2F) then gated (Bn, F), the MLP's */
    REAL *normed = (REAL *)a->work, *proj = normed + Bn * M, *bc = proj + Bn * E, *kq = bc + Bn * 2 * RGN;
    REAL *yr = kq + Bn * H * R * 2 * N, *y = yr + Bn * H * R * P, *fc = y + Bn * S, *gated = fc + Bn * 2 * F;
#pragma omp for schedule(static)
    for (i64 b = 0; b < Bn; b++)
        SUF(add_rms_norm)(hid + b * M, res ? res + b * M : NULL, (const REAL *)a->norm_w, a->eps, M,
                          new_res + b * M, normed + b * M);
    /* in_proj: z, x, B, C, dt, a, λ, θ */
    SUF(project)(&a->in_w, NULL, M, E, Bn, normed, M, proj, E);
#pragma omp for schedule(static)
    for (i64 i = 0; i < Bn * 2 * R * G; i++) { /* the RMSNorm of (rank, group) j of B (which 0) or C (1) of row b */
        const i64 b = i / (2 * R * G), which = i % (2 * R * G) / (R * G), j = i % (R * G);
        const REAL *v = proj + b * E + (which ? C_at : B_at) + j * N;
        const REAL *w = (const REAL *)(which ? a->C_norm_w : a->B_norm_w);
        REAL ss = 0;
        for (i64 n = 0; n < N; n++) ss += v[n] * v[n];
        const REAL scale = 1 / sqrt(ss / N + (REAL)a->bc_eps);
        REAL *out = bc + b * 2 * RGN + which * RGN + j * N;
        for (i64 n = 0; n < N; n++) out[n] = v[n] * scale * w[n];
    }
#pragma omp for schedule(static)
    for (i64 i = 0; i < Bn * H; i++) { /* head h of row b: phase, k and q, the step, y, the gate */
        const i64 b = i / H, h = i % H, g = h / heads_per_group;
        const REAL *pb = proj + b * E;
        const REAL dt = SUF(softplus)(pb[dt_at + h] + dt_bias[h]);
        const REAL rate = SUF(softplus)(pb[A_at + h]);
        const REAL A = -rate < -(REAL)a->A_floor ? -rate : -(REAL)a->A_floor;
        const REAL lam = SUF(sigmoid)(pb[lam_at + h]);
        REAL *ph = phase + i * T, *kqh = kq + i * R * 2 * N;
        for (i64 r = 0; r < R; r++) { /* k_r and q_r before the rotation */
            const REAL *Bv = bc + b * 2 * RGN + (r * G + g) * N, *Cv = Bv + RGN;
            const REAL *Bb = B_bias + (h * R + r) * N, *Cb = C_bias + (h * R + r) * N;
            REAL *k = kqh + r * 2 * N, *q = k + N;
            for (i64 n = 0; n < N; n++) {
                k[n] = Bv[n] + Bb[n];
                q[n] = Cv[n] + Cb[n];
            }
        }
        for (i64 m0 = 0; m0 < T; m0 += 32) { /* the phase turns on; k and q rotated, 32 pairs at a time */
            const i64 nm = T - m0 < 32 ? T - m0 : 32;
            REAL cs[32], sn[32];
            for (i64 j = 0; j < nm; j++) {
                const REAL p = ph[m0 + j] + dt * pi * tanh(pb[th_at + m0 + j]);
                cs[j] = cos(p);
                sn[j] = sin(p);
                const REAL r = fmod(p, two_pi); /* kept in [0, 2π), as the layer's step keeps it */
                ph[m0 + j] = r < 0 ? r + two_pi : r;
            }
            for (i64 r = 0; r < 2 * R; r++) SUF(rotate_pairs)(kqh + r * N, cs, sn, m0, nm, N, a->halved);
        }
        const REAL alpha = EXP(dt * A), beta = (1 - lam) * dt * alpha, gamma = lam * dt;
        const REAL *x = pb + x_at + h * P, *z = pb + h * P;
        REAL *hs = state + i * P * N, *vp = value + i * P, *yh = yr + i * R * P;
        const REAL Dh = Dskip ? Dskip[h] : 0;
        for (i64 p = 0; p < P; p++) {
            REAL *hp = hs + p * N;
#pragma omp simd
            for (i64 n = 0; n < N; n++) hp[n] *= alpha;
            for (i64 r = 0; r < R; r++) { /* rank r's inputs, this step's and the last one's */
                const REAL mx = mimo_x ? mimo_x[(h * R + r) * P + p] : 1;
                const REAL bv = beta * vp[p] * mx, gx = gamma * x[p] * mx;
                const REAL *kp = key + ((b * R + r) * H + h) * N, *k = kqh + r * 2 * N;
#pragma omp simd
                for (i64 n = 0; n < N; n++) hp[n] += bv * kp[n] + gx * k[n];
            }
            for (i64 r = 0; r < R; r++) {
                const REAL *q = kqh + r * 2 * N + N, mx = mimo_x ? mimo_x[(h * R + r) * P + p] : 1;
                REAL acc = 0;
#pragma omp simd reduction(+ : acc)
                for (i64 n = 0; n < N; n++) acc += q[n] * hp[n];
                yh[r * P + p] = acc + Dh * x[p] * mx;
            }
        }
        for (i64 r = 0; r < R; r++) {
            REAL *kp = key + ((b * R + r) * H + h) * N;
            for (i64 n = 0; n < N; n++) kp[n] = kqh[r * 2 * N + n];
        }
        for (i64 p = 0; p < P; p++) vp[p] = x[p];
        REAL *out = y + b * S + h * P;
        for (i64 p = 0; p < P; p++) out[p] = 0;
        for (i64 r = 0; r < R; r++) { /* the gate (or gated norm) of rank r, and the sum over ranks */
            const REAL *yv = yh + r * P;
            REAL scale = 1;
            if (gate_w) {
                REAL ss = 0;
                for (i64 p = 0; p < P; p++) ss += yv[p] * yv[p];
                scale = 1 / sqrt(ss / P + (REAL)a->gate_eps);
            }
            for (i64 p = 0; p < P; p++) {
                const i64 at = (h * R + r) * P + p;
                const REAL gz = z[p] * (mimo_z ? mimo_z[at] : 1);
                out[p] += (mimo_o ? mimo_o[at] : 1) * yv[p] * scale * (gate_w ? gate_w[h * P + p] : 1) *
                          (gz * SUF(sigmoid)(gz));
            }
        }
    }
    /* out_proj */
    SUF(project)(&a->out_w, NULL, S, M, Bn, y, S, new_hid, M);
    if (!a->fc1_w.w) return;
    /* the block's MLP: residual ← hidden + residual; fc1; f·SiLU(g); fc2 */
    SUF(gated_mlp_step)(Bn, M, F, &a->fc1_w, &a->fc2_w, (const REAL *)a->norm2_w, a->eps2, new_hid, new_res, normed,
                        fc, gated);
}

/* The decoding step of n Mamba-3 blocks in order, then the LM head when head is not NULL, in
   one parallel region, as mamba2_blocks_step (decode_mamba2.c). */
void SUF(mamba3_blocks_step)(const Mamba3StepArgs *layers, i64 n, const HeadArgs *head) {
#pragma omp parallel num_threads((int)layers[0].nthreads)
    {
        for (i64 l = 0; l < n; l++) SUF(mamba3_block_step)(layers + l);
        if (head) {
            const Mamba3StepArgs *a = layers + n - 1;
            SUF(head_step)(head, a->batch, a->d_model, (const REAL *)a->new_hidden, (REAL *)a->new_residual,
                           (REAL *)a->work);
        }
    }
}
