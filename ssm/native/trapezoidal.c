/* The output side of Mamba-3's trapezoidal scan on the CPU (ssm/scan/trapezoidal_cpu.py binds
   it): what the sweep's y becomes, forward and backward, in one pass each instead of a dozen
   tensor operations and their gradients. library.c includes this file once per REAL: the
   argument struct the first time only.

   Per row r (a (batch, step) pair) and head h, with qk = Σ_n q[r,h,n]·k[r,h,n] (the rotated
   query and key of the step) and coef = D[h] − c[r,h]·qk (the skip term and the diagonal's
   shifted part, ssm/scan/_common_trapezoidal.py):
       pre[r,h,p] = y[r,h,p] + coef·v[r,h,p],     out = pre·silu(z[r,h,p])   (out = pre without z)
   The backward, from g = d out: d pre = g·silu(z), d z = g·pre·silu'(z), d y = d pre,
   d v = d pre·coef, d coef = Σ_p d pre·v; then d c = −d coef·qk, d q = −d coef·c·k,
   d k = −d coef·c·q and d D[h] = Σ_r d coef. */

#ifndef SSM_TRAP_TYPES
#define SSM_TRAP_TYPES

/* rows = batch·L; out, grad, d_v, d_z (rows, H, P) contiguous; y and d_y (batch, L, H, P) with
   the strides sy (batch, step, head, value: the sweep's output as it lies, steps adjacent); v and z
   (rows, H, P) with heads P and values 1 apart and rows sv / sz apart (z NULL: no gate); q, k,
   d_q, d_k (rows, H, N) contiguous; c, d_c (rows, H) (q, k, c NULL: no diagonal term, qk = 0);
   D (H) or NULL (no skip term), d_D (H);
   part: scratch of nthreads·H elements. */
typedef struct {
    i64 rows, L, H, P, N, sv, sz, nthreads;
    i64 sy[4];
    const void *y, *v, *z, *q, *k, *c, *D;
    void *out;
    const void *grad;
    void *d_y, *d_v, *d_z, *d_q, *d_k, *d_c, *d_D, *part;
} TrapOutArgs;

/* The rotated keys or queries of a rank-1 scan: rows = batch·L; w (rows, G, N) B or C, its rows
   sw apart (groups N apart, entries adjacent), head h reading group h / (H / G); bias (H, N) or
   NULL; cos, sin, d_cos, d_sin (rows, H, M) contiguous; scale, d_scale (rows, H) or NULL (no
   scale); out, grad (rows, H, N) contiguous, or (batch, H, L, N) with heads_first; d_w (rows, G,
   N) contiguous; d_bias (H, N); part: scratch of nthreads·H·N elements (with a bias). Pair m is
   (2m, 2m + 1) (halved 0) or (m, N/2 + m) (halved 1). */
typedef struct {
    i64 rows, L, H, G, N, M, halved, heads_first, sw, nthreads;
    const void *w, *bias, *cos, *sin, *scale;
    void *out;
    const void *grad;
    void *d_w, *d_bias, *d_cos, *d_sin, *d_scale, *part;
} TrapRotArgs;

/* The rotary phase of the prologue (ssm/scan/_common_trapezoidal.py): per sequence (a batch row,
   or with cu_seqlens (S + 1,) and batch 1 each packed sequence), head h and pair m,
       φ_t = φ0 + Σ_{u ≤ t} Δ_u·θ_{u,m},   phase = φ_t,   cos, sin of φ_t reduced modulo 2π,
   the sum in double whatever REAL. delta (B, L, H), angles and the outputs phase, cos, sin
   (B, L, H, M), phase0 (B or S, H, M) or NULL (φ0 = 0), all contiguous.
   The backward, from d_phase, d_cos, d_sin (B, L, H, M) contiguous (NULL: zeros): the gradient
   of φ_t, d_phase − sin·d_cos + cos·d_sin, summed from the sequence's end back to t: G_t; then
   d_angles = Δ_t·G_t, d_delta[t, h] = Σ_m θ_{t,m}·G_t, and d_phase0 (B or S, H, M) = G at the
   sequence's first step (0 for an empty sequence: its last state's phase is φ0 itself, whose
   gradient the caller's tensors carry). */
typedef struct {
    i64 batch, length, H, M, nseq, nthreads;
    const i64 *cu_seqlens;
    const void *delta, *angles, *phase0;
    void *phase, *cos, *sin;
    const void *d_phase, *d_cos, *d_sin;
    void *d_delta, *d_angles, *d_phase0;
} TrapPhaseArgs;

/* Where row r's head h lies in out and grad: (r·H + h)·N, or heads first ((b·H + h)·L + t)·N. */
static inline i64 trap_rot_at(const TrapRotArgs *a, i64 r, i64 h) {
    return a->heads_first ? (((r / a->L) * a->H + h) * a->L + r % a->L) * a->N : (r * a->H + h) * a->N;
}

#endif /* SSM_TRAP_TYPES */

static inline REAL SUF(trap_coef)(const TrapOutArgs *a, i64 r, i64 h, REAL *qk_out) {
    const REAL D = a->D ? ((const REAL *)a->D)[h] : 0;
    if (!a->q) { /* no diagonal term: the caller's y holds it */
        *qk_out = 0;
        return D;
    }
    const REAL *q = (const REAL *)a->q + (r * a->H + h) * a->N, *k = (const REAL *)a->k + (r * a->H + h) * a->N;
    REAL qk = 0;
#pragma omp simd reduction(+ : qk)
    for (i64 n = 0; n < a->N; n++) qk += q[n] * k[n];
    *qk_out = qk;
    return D - ((const REAL *)a->c)[r * a->H + h] * qk;
}

/* Row r's head h in y (or d_y, laid out alike): its P values sy[3] apart. */
static inline const REAL *SUF(trap_y)(const TrapOutArgs *a, const void *base, i64 r, i64 h) {
    return (const REAL *)base + (r / a->L) * a->sy[0] + (r % a->L) * a->sy[1] + h * a->sy[2];
}

void SUF(trap_out_fwd)(const TrapOutArgs *a) {
    const i64 H = a->H, P = a->P;
#pragma omp parallel for num_threads((int)a->nthreads) schedule(static) if (a->rows * H * P >= 65536)
    for (i64 r = 0; r < a->rows; r++) {
        for (i64 h = 0; h < H; h++) {
            REAL qk;
            const REAL coef = SUF(trap_coef)(a, r, h, &qk);
            const REAL *y = SUF(trap_y)(a, a->y, r, h), *v = (const REAL *)a->v + r * a->sv + h * P;
            const i64 yp = a->sy[3];
            REAL *out = (REAL *)a->out + (r * H + h) * P;
            if (a->z) {
                const REAL *z = (const REAL *)a->z + r * a->sz + h * P;
#pragma omp simd
                for (i64 p = 0; p < P; p++) out[p] = (y[p * yp] + coef * v[p]) * z[p] * SUF(sigmoid)(z[p]);
            } else {
#pragma omp simd
                for (i64 p = 0; p < P; p++) out[p] = y[p * yp] + coef * v[p];
            }
        }
    }
}

void SUF(trap_out_bwd)(const TrapOutArgs *a) {
    const i64 H = a->H, P = a->P, N = a->N;
    REAL *part = (REAL *)a->part;
#pragma omp parallel num_threads((int)a->nthreads)
    {
        REAL *acc = part + omp_get_thread_num() * H; /* this thread's Σ d coef per head */
        for (i64 h = 0; h < H; h++) acc[h] = 0;
#pragma omp for schedule(static)
        for (i64 r = 0; r < a->rows; r++) {
            for (i64 h = 0; h < H; h++) {
                REAL qk;
                const REAL coef = SUF(trap_coef)(a, r, h, &qk);
                const i64 o = (r * H + h) * P, yp = a->sy[3];
                const REAL *y = SUF(trap_y)(a, a->y, r, h), *g = (const REAL *)a->grad + o;
                const REAL *v = (const REAL *)a->v + r * a->sv + h * P;
                REAL *dy = (REAL *)SUF(trap_y)(a, a->d_y, r, h), *dv = (REAL *)a->d_v + o;
                REAL dcoef = 0;
                if (a->z) {
                    const REAL *z = (const REAL *)a->z + r * a->sz + h * P;
                    REAL *dz = (REAL *)a->d_z + o;
#pragma omp simd reduction(+ : dcoef)
                    for (i64 p = 0; p < P; p++) {
                        const REAL s = SUF(sigmoid)(z[p]), pre = y[p * yp] + coef * v[p];
                        const REAL dpre = g[p] * z[p] * s;
                        dz[p] = g[p] * pre * s * (1 + z[p] * (1 - s));
                        dy[p * yp] = dpre;
                        dv[p] = dpre * coef;
                        dcoef += dpre * v[p];
                    }
                } else {
#pragma omp simd reduction(+ : dcoef)
                    for (i64 p = 0; p < P; p++) {
                        dy[p * yp] = g[p];
                        dv[p] = g[p] * coef;
                        dcoef += g[p] * v[p];
                    }
                }
                acc[h] += dcoef;
                if (!a->q) continue;
                const i64 rh = r * H + h;
                const REAL cc = ((const REAL *)a->c)[rh], dqk = -dcoef * cc;
                ((REAL *)a->d_c)[rh] = -dcoef * qk;
                const REAL *q = (const REAL *)a->q + rh * N, *k = (const REAL *)a->k + rh * N;
                REAL *dq = (REAL *)a->d_q + rh * N, *dk = (REAL *)a->d_k + rh * N;
#pragma omp simd
                for (i64 n = 0; n < N; n++) {
                    dq[n] = dqk * k[n];
                    dk[n] = dqk * q[n];
                }
            }
        }
#pragma omp barrier
        if (a->D) SUF(sum_parts)(part, H, H, (REAL *)a->d_D);
    }
}

/* out[r, h] = scale[r, h]·Rot(φ[r, h])·(w[r, h / (H / G)] + bias[h]): each pair (n0, n1) turned
   to (w0·cos − w1·sin, w0·sin + w1·cos), the other entries copied (the scale 1 without one). */
void SUF(trap_rot_fwd)(const TrapRotArgs *a) {
    const i64 H = a->H, N = a->N, M = a->M, per_group = a->H / a->G;
    const i64 i1 = a->halved ? N / 2 : 1, step = a->halved ? 1 : 2; /* pair m: (m·step, m·step + i1) */
#pragma omp parallel for num_threads((int)a->nthreads) schedule(static) if (a->rows * H * N >= 65536)
    for (i64 r = 0; r < a->rows; r++) {
        for (i64 h = 0; h < H; h++) {
            const REAL *w = (const REAL *)a->w + r * a->sw + (h / per_group) * N;
            const REAL *b = a->bias ? (const REAL *)a->bias + h * N : NULL;
            const REAL *cs = (const REAL *)a->cos + (r * H + h) * M, *sn = (const REAL *)a->sin + (r * H + h) * M;
            REAL *o = (REAL *)a->out + trap_rot_at(a, r, h);
            if (b) {
#pragma omp simd
                for (i64 n = 0; n < N; n++) o[n] = w[n] + b[n];
            } else {
#pragma omp simd
                for (i64 n = 0; n < N; n++) o[n] = w[n];
            }
#pragma omp simd
            for (i64 m = 0; m < M; m++) {
                const REAL w0 = o[m * step], w1 = o[m * step + i1];
                o[m * step] = w0 * cs[m] - w1 * sn[m];
                o[m * step + i1] = w0 * sn[m] + w1 * cs[m];
            }
            if (a->scale) {
                const REAL sc = ((const REAL *)a->scale)[r * H + h];
#pragma omp simd
                for (i64 n = 0; n < N; n++) o[n] *= sc;
            }
        }
    }
}

/* From g = d out, and g·scale the gradient of the unscaled rotation: d w[r, g] = Σ over the
   group's heads of scale·Rot(−φ)·g (each entry's gradient turned back), d bias[h] =
   Σ_r scale·Rot(−φ[r, h])·g[r, h], and per pair with (w0, w1) the unturned entries (w + bias,
   recomputed): d cos = scale·(g0·w0 + g1·w1), d sin = scale·(g1·w0 − g0·w1); d scale = g·Rot(φ)·
   (w + bias) = (Rot(−φ)·g)·(w + bias). */
void SUF(trap_rot_bwd)(const TrapRotArgs *a) {
    const i64 H = a->H, G = a->G, N = a->N, M = a->M, per_group = a->H / a->G;
    const i64 i1 = a->halved ? N / 2 : 1, step = a->halved ? 1 : 2;
    REAL *part = (REAL *)a->part;
#pragma omp parallel num_threads((int)a->nthreads)
    {
        REAL *acc = a->bias ? part + omp_get_thread_num() * H * N : NULL; /* this thread's d bias */
        if (acc)
            for (i64 i = 0; i < H * N; i++) acc[i] = 0;
#pragma omp for schedule(static)
        for (i64 r = 0; r < a->rows; r++) {
            REAL *dw_row = (REAL *)a->d_w + r * G * N;
            for (i64 i = 0; i < G * N; i++) dw_row[i] = 0;
            for (i64 h = 0; h < H; h++) {
                const i64 rh = r * H + h;
                const REAL *w = (const REAL *)a->w + r * a->sw + (h / per_group) * N;
                const REAL *b = a->bias ? (const REAL *)a->bias + h * N : NULL;
                const REAL *cs = (const REAL *)a->cos + rh * M, *sn = (const REAL *)a->sin + rh * M;
                const REAL *g = (const REAL *)a->grad + trap_rot_at(a, r, h);
                REAL *dw = dw_row + (h / per_group) * N, *dc = (REAL *)a->d_cos + rh * M, *ds = (REAL *)a->d_sin + rh * M;
                REAL *db = acc ? acc + h * N : NULL;
#pragma omp simd
                for (i64 m = 0; m < M; m++) {
                    const i64 n0 = m * step, n1 = m * step + i1;
                    const REAL w0 = w[n0] + (b ? b[n0] : 0), w1 = w[n1] + (b ? b[n1] : 0);
                    const REAL g0 = g[n0], g1 = g[n1];
                    dc[m] = g0 * w0 + g1 * w1;
                    ds[m] = g1 * w0 - g0 * w1;
                }
                REAL t[N]; /* Rot(−φ)·g: the unturned entries as they are, the pairs turned back */
#pragma omp simd
                for (i64 n = 0; n < N; n++) t[n] = g[n];
                for (i64 m = 0; m < M; m++) {
                    const i64 n0 = m * step, n1 = m * step + i1;
                    t[n0] = g[n0] * cs[m] + g[n1] * sn[m];
                    t[n1] = g[n1] * cs[m] - g[n0] * sn[m];
                }
                if (a->scale) {
                    const REAL sc = ((const REAL *)a->scale)[rh];
                    REAL d_sc = 0;
#pragma omp simd reduction(+ : d_sc)
                    for (i64 n = 0; n < N; n++) d_sc += t[n] * (w[n] + (b ? b[n] : 0));
                    ((REAL *)a->d_scale)[rh] = d_sc;
#pragma omp simd
                    for (i64 n = 0; n < N; n++) t[n] *= sc;
                    for (i64 m = 0; m < M; m++) {
                        dc[m] *= sc;
                        ds[m] *= sc;
                    }
                }
#pragma omp simd
                for (i64 n = 0; n < N; n++) dw[n] += t[n];
                if (db) {
#pragma omp simd
                    for (i64 n = 0; n < N; n++) db[n] += t[n];
                }
            }
        }
#pragma omp barrier
        if (a->bias) SUF(sum_parts)(part, H * N, H * N, (REAL *)a->d_bias);
    }
}


/* ------------------------------------------------------------------ the rotary phase (TrapPhaseArgs) */

/* The sequences' steps [lo, hi) of row b: with cu_seqlens, sequence q (b = 0); else the row. */
static inline void SUF(trap_phase_span)(const TrapPhaseArgs *a, i64 q, i64 *b, i64 *lo, i64 *hi) {
    if (a->cu_seqlens) {
        *b = 0, *lo = a->cu_seqlens[q], *hi = a->cu_seqlens[q + 1];
    } else {
        *b = q, *lo = 0, *hi = a->length;
    }
}

/* cos and sin of the phases r[0..n) (double, reduced to [0, 2π)) into c, sn. For float the
   libm calls (about 20 ns a pair here, most of the phase pass) give way to polynomials the
   compiler runs several lanes at a time: r = k·π/2 + y with |y| ≤ π/4 (π/2 in two parts, so y
   keeps double precision), then Taylor series of sin y to y^11 and cos y to y^12 (truncation
   below 1e-11), evaluated in double and rounded once to float, and the quadrant k mod 4 swaps
   and negates them. Double keeps libm's cos and sin. */
static inline void SUF(cos_sin)(const double *restrict r, i64 n, REAL *restrict c, REAL *restrict sn) {
#if REAL_IS_F32
#pragma omp simd
    for (i64 i = 0; i < n; i++) {
        const double k = __builtin_nearbyint(r[i] * 0.63661977236758134308);               /* 2/π */
        const double y = (r[i] - k * 1.5707963267948966) - k * 6.123233995736766e-17;    /* π/2, hi + lo */
        const double y2 = y * y;
        const double sy = y + y * y2 * (-1.0 / 6 + y2 * (1.0 / 120 + y2 * (-1.0 / 5040 + y2 * (1.0 / 362880 + y2 * (-1.0 / 39916800)))));
        const double cy = 1 + y2 * (-0.5 + y2 * (1.0 / 24 + y2 * (-1.0 / 720 + y2 * (1.0 / 40320 + y2 * (-1.0 / 3628800 + y2 * (1.0 / 479001600))))));
        const double q = k - 4 * __builtin_floor(k * 0.25); /* 0, 1, 2 or 3 */
        const int swap = q == 1 || q == 3, c_neg = q == 1 || q == 2, s_neg = q >= 2;
        const double cr = swap ? sy : cy, sr = swap ? cy : sy;
        c[i] = (REAL)(c_neg ? -cr : cr);
        sn[i] = (REAL)(s_neg ? -sr : sr);
    }
#else
    for (i64 i = 0; i < n; i++) {
        c[i] = (REAL)cos(r[i]);
        sn[i] = (REAL)sin(r[i]);
    }
#endif
}

void SUF(trap_phase_fwd)(const TrapPhaseArgs *a) {
    const i64 H = a->H, M = a->M, HM = H * M, L = a->length;
    const i64 seqs = a->cu_seqlens ? a->nseq : a->batch;
    const double two_pi = 6.283185307179586476925286766559;
#pragma omp parallel for collapse(2) num_threads((int)a->nthreads) schedule(static) if (seqs * L * HM >= 32768)
    for (i64 q = 0; q < seqs; q++) {
        for (i64 h = 0; h < H; h++) {
            i64 b, lo, hi;
            SUF(trap_phase_span)(a, q, &b, &lo, &hi);
            double acc[M > 0 ? M : 1], r[M > 0 ? M : 1];
            for (i64 m = 0; m < M; m++) acc[m] = a->phase0 ? (double)((const REAL *)a->phase0)[(q * H + h) * M + m] : 0.0;
            for (i64 t = lo; t < hi; t++) {
                const i64 row = b * L + t;
                const double dt = (double)((const REAL *)a->delta)[row * H + h];
                const REAL *th = (const REAL *)a->angles + (row * H + h) * M;
                REAL *ph = (REAL *)a->phase + (row * H + h) * M, *c = (REAL *)a->cos + (row * H + h) * M;
                REAL *sn = (REAL *)a->sin + (row * H + h) * M;
                for (i64 m = 0; m < M; m++) {
                    acc[m] += dt * (double)th[m];
                    r[m] = acc[m] - two_pi * floor(acc[m] / two_pi); /* torch.remainder's */
                    ph[m] = (REAL)acc[m];
                }
                SUF(cos_sin)(r, M, c, sn);
            }
        }
    }
}

void SUF(trap_phase_bwd)(const TrapPhaseArgs *a) {
    const i64 H = a->H, M = a->M, L = a->length;
    const i64 seqs = a->cu_seqlens ? a->nseq : a->batch;
    const REAL *dph = (const REAL *)a->d_phase, *dc = (const REAL *)a->d_cos, *ds = (const REAL *)a->d_sin;
#pragma omp parallel for collapse(2) num_threads((int)a->nthreads) schedule(static) if (seqs * L * H * M >= 32768)
    for (i64 q = 0; q < seqs; q++) {
        for (i64 h = 0; h < H; h++) {
            i64 b, lo, hi;
            SUF(trap_phase_span)(a, q, &b, &lo, &hi);
            double G[M > 0 ? M : 1];
            for (i64 m = 0; m < M; m++) G[m] = 0.0;
            double g[M > 0 ? M : 1];
            REAL *restrict d_angles = (REAL *)a->d_angles;
            for (i64 t = hi - 1; t >= lo; t--) {
                const i64 at = ((b * L + t) * H + h) * M;
                const REAL *restrict th = (const REAL *)a->angles + at;
                const REAL *restrict c = (const REAL *)a->cos + at, *restrict sn = (const REAL *)a->sin + at;
                const double dt = (double)((const REAL *)a->delta)[(b * L + t) * H + h];
                /* each input's term in a loop of its own, so that every loop runs several lanes at a
                   time (a missing gradient skips its loop rather than testing in the loop) */
                for (i64 m = 0; m < M; m++) g[m] = dph ? (double)dph[at + m] : 0.0;
                if (dc)
#pragma omp simd
                    for (i64 m = 0; m < M; m++) g[m] -= (double)sn[m] * (double)dc[at + m];
                if (ds)
#pragma omp simd
                    for (i64 m = 0; m < M; m++) g[m] += (double)c[m] * (double)ds[at + m];
                double d_delta = 0.0;
#pragma omp simd reduction(+ : d_delta)
                for (i64 m = 0; m < M; m++) {
                    G[m] += g[m];
                    d_angles[at + m] = (REAL)(dt * G[m]);
                    d_delta += (double)th[m] * G[m];
                }
                ((REAL *)a->d_delta)[(b * L + t) * H + h] = (REAL)d_delta;
            }
            if (a->d_phase0)
                for (i64 m = 0; m < M; m++) ((REAL *)a->d_phase0)[(q * H + h) * M + m] = (REAL)G[m];
        }
    }
}
