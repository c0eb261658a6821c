/* The selective scan (Mamba-1 / S6, and Mamba-2's SSD run as one) on the CPU: the chunked forward
   sweep, the reverse-sweep backward, and the one-token step that decoding calls; ssm/scan/cpu.py
   calls them through ctypes.

   Design: every thread owns whole channels and walks all L steps of them on its own, with the
   state in a small array the compiler keeps in registers/L1 and vectorises over N. Threads never
   wait on one another inside a sweep; units are handed out dynamically, so a thread that shares
   its core with another process simply takes fewer of them. Nothing is allocated per step; a
   thread's scratch (a chunk of T steps) is allocated once per call.

   library.c includes this file once per REAL: the argument structs the first time only. */

#ifndef SSM_SELECTIVE_TYPES
#define SSM_SELECTIVE_TYPES

/* Arguments of the selective-scan kernels (the struct cpu.py mirrors with ctypes). Strides are
   in elements. u, delta, z are read as X[b*s0 + d*s1 + t*s2]; B and C as
   M[b*s0 + g*s1 + t*s2 + n] (N contiguous). A fixed (D, N) B or C is passed with s0 = s2 = 0,
   s1 = N and one "group" per channel. */
typedef struct {
    i64 batch, dim, length, N, groups_B, groups_C, nseq, nthreads;
    i64 chunk;                             /* T: steps between saved states (ckpt) */
    i64 B_fixed, C_fixed, softplus;
    i64 nparts;                            /* backward: channel blocks, each with its own B, C partial sums */
    i64 delta_decay_only;                  /* backward: d_delta through exp(Δ·A) alone, not through Δ·B·u */
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
    void *part_B, *part_C;                 /* time-varying: per-block (nparts, B, G, L, N) scratch, or NULL
                                              when every block's channels are whole groups: then each
                                              block writes its groups' rows of d_B (d_C) itself */
    void *d_D, *d_delta_bias;              /* (D,) each, or NULL */
    void *d_h0;                            /* NULL or (S, D, N) */
    i64 sdB[3], sdC[3];                    /* time-varying d_B, d_C: strides of (batch, group, step), N contiguous */
} SelectiveArgs;

/* Arguments of the one-step selective kernel (recurrent decoding): u, delta, z (batch, dim) and
   B, C (batch, N) with row strides su, sdelta, sz, sB, sC (elements; the last dim contiguous);
   A (dim, N), state and new_state (batch, dim, N) contiguous; D, delta_bias (dim,) or NULL. */
typedef struct {
    i64 batch, dim, N, softplus, nthreads;
    const void *state, *u, *delta, *A, *B, *C, *D, *z, *delta_bias;
    i64 su, sdelta, sz, sB, sC;
    void *out, *new_state;                 /* out (batch, dim) contiguous */
} StepArgs;

/* The groups [first, last] that channels [part·D/nparts, (part+1)·D/nparts) belong to, when D
   channels are split into G groups of D/G; first > last for a block without channels. */
static inline void groups_of_part(i64 part, i64 nparts, i64 Dn, i64 G, i64 *first, i64 *last) {
    const i64 d0 = part * Dn / nparts, d1 = (part + 1) * Dn / nparts;
    *first = d0 / (Dn / G);
    *last = d1 > d0 ? (d1 - 1) / (Dn / G) : *first - 1;
}

#endif /* SSM_SELECTIVE_TYPES */

/* ------------------------------------------------------------------ for one REAL */

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
   that each is compiled with its loop over n unrolled and its exp hoisted where it can be: N 16
   (Mamba-1), and N 64 with one decay per channel (Mamba-2 and Mamba-3 at d_state 64: the
   state-tracking models' training step 5-10% faster, the scan about 15%). */
#ifndef SPECIALISED
#define SPECIALISED(fn, ...)                                       \
    do {                                                           \
        if (N == 16 && same_A) fn(16, 1, __VA_ARGS__);             \
        else if (N == 16) fn(16, 0, __VA_ARGS__);                  \
        else if (N == 64 && same_A) fn(64, 1, __VA_ARGS__);        \
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
        const fp_mode fp = flush_subnormals();
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
        restore_fp_mode(fp);
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
   (part_B, part_C), added up at the end; a block's scratch holds rows for every group, but it
   zeroes, and the sum reads, only those of the groups its channels are in (groups_of_part): with
   a group per head (Mamba-3's rotated keys) the rest would be G times the memory traffic. */

/* d_B (or d_C), (batch, G, L, N) at strides ``so`` (N contiguous): each row the sum, in block order,
   of the blocks whose channels are in its group (the others never wrote there). The caller lays
   it out as B (or C) is, so that autograd adds it to the gradient of the keys' other uses
   without a transposing pass. Called by every thread of the team. */
static void SUF(sum_group_parts)(const SelectiveArgs *a, const REAL *parts, REAL *out, const i64 *so, i64 part_size,
                                 i64 G) {
    if (!part_size) return;
    const i64 rows = a->batch * G, L = a->length, N = a->N, row_size = L * N;
#pragma omp for schedule(static)
    for (i64 r = 0; r < rows; r++) {
        const i64 b = r / G, g = r % G;
        REAL *o = out + b * so[0] + g * so[1];
        for (i64 t = 0; t < L; t++)
            for (i64 n = 0; n < N; n++) o[t * so[2] + n] = 0;
        for (i64 k = 0; k < a->nparts; k++) {
            i64 g0, g1;
            groups_of_part(k, a->nparts, a->dim, G, &g0, &g1);
            if (g < g0 || g > g1) continue;
            const REAL *p = parts + k * part_size + r * row_size;
            for (i64 t = 0; t < L; t++)
                for (i64 n = 0; n < N; n++) o[t * so[2] + n] += p[t * N + n];
        }
    }
}

/* Zero rows [g0, g1] of every batch row of a (batch, G, L, N) array at strides ``so`` (N contiguous):
   a block's scratch (one memset per group) or its groups' rows of d_B / d_C (one per step). */
static void SUF(zero_rows)(REAL *out, const i64 *so, i64 batch, i64 g0, i64 g1, i64 L, i64 N) {
    for (i64 b = 0; b < batch; b++)
        for (i64 g = g0; g <= g1; g++) {
            REAL *row = out + b * so[0] + g * so[1];
            if (so[2] == N) memset(row, 0, sizeof(REAL) * L * N);
            else for (i64 t = 0; t < L; t++) memset(row + t * so[2], 0, sizeof(REAL) * N);
        }
}

void SUF(selective_bwd)(const SelectiveArgs *a) {
    const i64 T = a->chunk;
    const i64 Bn = a->batch, Dn = a->dim, L = a->length, N = a->N;
    const i64 n_chunks = (L + T - 1) / T;
    const i64 S = a->cu_seqlens ? a->nseq : 1;
    const REAL *A = (const REAL *)a->A;
    const REAL *h0 = (const REAL *)a->h0, *glast = (const REAL *)a->grad_last;
    REAL *dh0 = (REAL *)a->d_h0;
    const i64 GB = a->groups_B, GC = a->groups_C;
    /* own_B: the blocks split no group of B, and each adds its channels straight into its groups'
       rows of d_B (no scratch, no summing pass, and the same order of terms on every run) */
    const int own_B = !a->B_fixed && !a->part_B, own_C = !a->C_fixed && !a->part_C;
    const i64 part_size_B = a->B_fixed || own_B ? 0 : Bn * GB * L * N;
    const i64 part_size_C = a->C_fixed || own_C ? 0 : Bn * GC * L * N;

    const i64 block_max = (Dn + a->nparts - 1) / a->nparts; /* the most channels in a block */
#pragma omp parallel num_threads((int)a->nthreads)
    {
        const fp_mode fp = flush_subnormals();
        REAL *scratch = (REAL *)malloc(sizeof(REAL) * ((8 + 3 * LANES) * T + 2 * T * N + N + (5 * N + 2) * block_max));
        REAL *dt = scratch, *raw = dt + T, *u = raw + T, *zv = u + T, *y = zv + T, *gy = y + T;
        REAL *sA = gy + T, *sBk = sA + T, *y_lanes = sBk + T, *sA_lanes = y_lanes + LANES * T;
        REAL *sB_lanes = sA_lanes + LANES * T;
        REAL *hs = sB_lanes + LANES * T;  /* hs[k*N..]: the state entering step t0+k (after any restart) */
        REAL *decay = hs + T * N;         /* decay[k*N..]: exp(Δ_t A) of step t0+k */
        /* per channel of the block (j = d − d0), N apart: A's row, λ, and the sums of dA, and of dB
           and dC when those are fixed; then accD and accBias, one each */
        REAL *Ads = decay + T * N, *lams = Ads + N * block_max, *accAs = lams + N * block_max;
        REAL *accBs = accAs + N * block_max, *accCs = accBs + N * block_max;
        REAL *accDs = accCs + N * block_max, *accBiases = accDs + block_max;
        REAL *h = accBiases + block_max; /* the recomputation's running state (N) */
        i64 own_cu[2] = {0, L};
        const i64 *cu = a->cu_seqlens ? a->cu_seqlens : own_cu;

        /* Work units: nparts blocks of channels, handed out dynamically (a thread that shares its
           core with another process takes fewer). Each block adds its channels' dB_t, dC_t into
           rows of its own, in channel order, and the blocks are added up in block order at the
           end: the gradients are the same bits on every run whichever thread ran which block.
           Within a block the walk is chunk by chunk from the end, and in each chunk channel by
           channel (each with its own λ carried from the chunk after): the chunk's rows of those
           sums (T·N each for dB and dC) then stay in L1 while every channel of the block adds to
           them, where a walk of one channel over all L steps at a time went out to L2 for them at
           every step (measured: that traffic was half of the backward at the parity model's
           (64, 64, 160), N 64). Each sum still adds its terms in the same order. */
#pragma omp for schedule(dynamic, 1)
        for (i64 part = 0; part < a->nparts; part++) {
            /* where the block's dB_t rows go, at strides sRB: its scratch, or d_B itself when it
               owns its groups; NULL when B is fixed (each channel's sums, accBs). dC likewise. */
            REAL *rB = part_size_B ? (REAL *)a->part_B + part * part_size_B : own_B ? (REAL *)a->d_B : NULL;
            REAL *rC = part_size_C ? (REAL *)a->part_C + part * part_size_C : own_C ? (REAL *)a->d_C : NULL;
            const i64 scratch_B[3] = {GB * L * N, L * N, N}, scratch_C[3] = {GC * L * N, L * N, N};
            const i64 *sRB = own_B ? a->sdB : scratch_B, *sRC = own_C ? a->sdC : scratch_C;
            const i64 d0 = part * Dn / a->nparts, d1 = (part + 1) * Dn / a->nparts;
            i64 g0, g1;
            if (rB) {
                groups_of_part(part, a->nparts, Dn, GB, &g0, &g1);
                SUF(zero_rows)(rB, sRB, Bn, g0, g1, L, N);
            }
            if (rC) {
                groups_of_part(part, a->nparts, Dn, GC, &g0, &g1);
                SUF(zero_rows)(rC, sRC, Bn, g0, g1, L, N);
            }
            for (i64 d = d0; d < d1; d++) {
                REAL *Ad = Ads + (d - d0) * N;
                for (i64 n = 0; n < N; n++) {
                    Ad[n] = A[d * N + n];
                    accAs[(d - d0) * N + n] = 0, accBs[(d - d0) * N + n] = 0, accCs[(d - d0) * N + n] = 0;
                }
                accDs[d - d0] = 0, accBiases[d - d0] = 0;
            }
            for (i64 b = 0; b < Bn; b++) {
                const i64 row = a->cu_seqlens ? 0 : b;
                for (i64 d = d0; d < d1; d++) {
                    for (i64 s = 0; s < S; s++) /* zero-length sequences pass their gradient through */
                        if (cu[s] == cu[s + 1] && dh0)
                            for (i64 n = 0; n < N; n++)
                                dh0[((row + s) * Dn + d) * N + n] = glast ? glast[((row + s) * Dn + d) * N + n] : 0;
                    for (i64 n = 0; n < N; n++) lams[(d - d0) * N + n] = 0;
                }
                i64 s_last = prev_nonempty(cu, S - 1); /* the sequence the reverse walk is in */
                for (i64 c = n_chunks - 1; c >= 0; c--) {
                    const i64 t0 = c * T, nt = L - t0 < T ? L - t0 : T;
                    i64 s_end = s_last;
                    for (i64 d = d0; d < d1; d++) {
                        const REAL *Ad = Ads + (d - d0) * N;
                        REAL *lam = lams + (d - d0) * N, *accA = accAs + (d - d0) * N;
                        const int same_A = SUF(all_equal)(Ad, N);
                        const REAL Dd = a->D ? ((const REAL *)a->D)[d] : 0;
                        const i64 gB = d / (Dn / GB), gC = d / (Dn / GC);
                        const REAL *Bm = (const REAL *)a->B + b * a->sB[0] + gB * a->sB[1];
                        const REAL *Cm = (const REAL *)a->C + b * a->sC[0] + gC * a->sC[1];
                        const REAL *go = (const REAL *)a->grad_out + b * a->sgo[0] + d * a->sgo[1];
                        REAL *du = (REAL *)a->d_u + (b * Dn + d) * L, *ddl = (REAL *)a->d_delta + (b * Dn + d) * L;
                        REAL *dz = a->d_z ? (REAL *)a->d_z + (b * Dn + d) * L : NULL;
                        /* where dB_t, dC_t go: the block's rows of this (batch, group), or the channel's sums */
                        REAL *pBb = rB ? rB + b * sRB[0] + gB * sRB[1] : accBs + (d - d0) * N;
                        REAL *pCb = rC ? rC + b * sRC[0] + gC * sRC[1] : accCs + (d - d0) * N;
                        const i64 spB = rB ? sRB[2] : 0, spC = rC ? sRC[2] : 0;
                        s_end = s_last;
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
                            REAL gdt = a->delta_decay_only ? sA[k] : sA[k] + u[k] * sBk[k];
                            if (a->softplus) gdt *= raw[k];
                            du[t0 + k] = gy[k] * Dd + dt[k] * sBk[k];
                            ddl[t0 + k] = gdt;
                            sum_bias += gdt;
                            sum_D += gy[k] * u[k];
                        }
                        accBiases[d - d0] += sum_bias;
                        accDs[d - d0] += sum_D;
                    }
                    s_last = s_end; /* every channel leaves the chunk in the same sequence */
                }
            }
            for (i64 d = d0; d < d1; d++) {
                for (i64 n = 0; n < N; n++) ((REAL *)a->d_A)[d * N + n] = accAs[(d - d0) * N + n];
                if (a->B_fixed) for (i64 n = 0; n < N; n++) ((REAL *)a->d_B)[d * N + n] = accBs[(d - d0) * N + n];
                if (a->C_fixed) for (i64 n = 0; n < N; n++) ((REAL *)a->d_C)[d * N + n] = accCs[(d - d0) * N + n];
                if (a->d_D) ((REAL *)a->d_D)[d] = accDs[d - d0];
                if (a->d_delta_bias) ((REAL *)a->d_delta_bias)[d] = accBiases[d - d0];
            }
        }
        /* add up the blocks' sums over channels of time-varying B and C */
        SUF(sum_group_parts)(a, (const REAL *)a->part_B, (REAL *)a->d_B, a->sdB, part_size_B, GB);
        SUF(sum_group_parts)(a, (const REAL *)a->part_C, (REAL *)a->d_C, a->sdC, part_size_C, GC);
        free(scratch);
        restore_fp_mode(fp);
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
