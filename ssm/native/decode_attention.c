/* The decoding step of a hybrid model's attention blocks (ssm.layers.MHA in a Block), in one call
   per run of consecutive attention blocks, as decode.c's mamba_blocks_step is for Mamba-1: the
   block's residual add and RMSNorm, in_proj, the optional causal conv's step on q, k, v, rotary on
   q and k at each row's own position, the key and value written into the cache in place, softmax
   attention of every query head over its row's keys, the in-mixer MLP branch, out_proj, and the
   block's gated MLP when it has one. library.c includes this file once per REAL, after
   decode_mamba2.c (whose gated_mlp_step and thread_share it uses): the argument struct the first
   time only.

   Shape symbols: B batch, M d_model, H query heads, Hk key/value heads (H / Hk query heads share
   each: GQA), P head dim, Z = (H + 2·Hk)·P the q, k, v channels, U the in-mixer MLP's half width
   (mlp_dim / 2, often 0), E = Z + 2·U in_proj's rows, K the conv's width (0: none), T the cache's
   capacity (tokens per row), R the rotated channels of each head, F the block MLP's hidden size. */

#ifndef SSM_DECODE_ATTENTION_TYPES
#define SSM_DECODE_ATTENTION_TYPES

/* Arguments of a whole attention block's decoding step (one token per row):
     residual ← hidden + residual;  u = RMSNorm(residual; norm_w, eps)
     (qkv, up, gate) = in_w·u + in_b                              rows Z, U, U
     with K > 0: conv_state ← [conv_state[1:], qkv];  qkv = Σ_k conv_w·conv_state + conv_b
     q (H, P), k, v (Hk, P) = qkv;  t = lengths[b], the row's position
     the first R channels of each q and k head rotated by t: pairs (i, i + R/2), or (2i, 2i + 1)
       with interleaved, at angle t·inv_freq[i]
     key[b, t] = k;  value[b, t] = v;  lengths[b] = t + 1
     context_h = Σ_{j ≤ t} softmax_j(scale·q_h·key[b, j, h / (H / Hk)]) · value[b, j, h / (H / Hk)]
     hidden = out_w·[context, up·SiLU(gate)] + out_b
   then with fc1_w (the block's MLP): residual ← hidden + residual;
     (f, g) = fc1_w·RMSNorm(residual; norm2_w, eps2);  hidden = fc2_w·(f·SiLU(g)).
   Every tensor contiguous, in one dtype, but the matrices (WMat: any format of decode_weights.c)
   and lengths (int64). Shapes: hidden, residual, new_hidden, new_residual (B, M) (residual NULL
   in the first block); norm_w (M); in_w (E, M), in_b (E) or NULL; conv_w (Z, K), conv_b (Z) or
   NULL, conv_state (B, Z, K), updated in place (K 0: all three NULL); inv_freq (R / 2) (R 0:
   NULL); key, value (B, T, Hk, P) and lengths (B), updated in place: the caller makes sure
   that every lengths[b] < T; out_w (M, H·P + U), out_b (M) or NULL; norm2_w (M), fc1_w (2·F, M),
   fc2_w (M, F), or fc1_w NULL (F 0);
   work: scratch of B·(M + E + Z + H·P + U + H·T + 3·F) elements. */
typedef struct {
    i64 batch, d_model, H, Hk, P, U, K, T, R, interleaved, F, nthreads;
    double eps, eps2, scale;
    const void *hidden, *residual, *norm_w, *in_b, *conv_w, *conv_b;
    void *conv_state;
    const void *inv_freq;
    void *key, *value, *lengths;
    const void *out_b, *norm2_w;
    void *work, *new_hidden, *new_residual;
    WMat in_w, out_w, fc1_w, fc2_w; /* the matrices, in any format of decode_weights.c; fc1_w.w NULL: no MLP */
} AttentionStepArgs;

#endif /* SSM_DECODE_ATTENTION_TYPES */

/* ------------------------------------------------------------------ for one REAL */

/* The first R channels of one head x (P) rotated to position t, in place: (a, b) at frequency
   inv_freq[i] becomes (a·cos θ − b·sin θ, b·cos θ + a·sin θ), θ = t·inv_freq[i], the pairs
   (i, i + R/2) or, interleaved, (2i, 2i + 1). θ is formed in REAL as the tensor path forms it;
   its cosine and sine are taken in double and rounded. */
static inline void SUF(rotate_head)(REAL *x, i64 R, int interleaved, const REAL *inv_freq, i64 t) {
    const i64 half = R / 2;
    for (i64 i = 0; i < half; i++) {
        const REAL angle = (REAL)t * inv_freq[i];
        const REAL c = (REAL)cos((double)angle), s = (REAL)sin((double)angle);
        REAL *pa = interleaved ? x + 2 * i : x + i, *pb = interleaved ? x + 2 * i + 1 : x + half + i;
        const REAL a = *pa, b = *pb;
        *pa = a * c - b * s;
        *pb = b * c + a * s;
    }
}

/* An attention block's decoding step (AttentionStepArgs), run by every thread of the calling
   parallel region. The projections are split by output rows across the threads, as in the Mamba
   steps (the weight reads bound a batch-1 step); the conv by channels; the rotary and the cache
   writes by heads; the attention by query heads (each reads its key/value head's cached tokens,
   which the rows' t + 1 keys and values bound: the one part of a step that grows with the
   tokens seen). */
static void SUF(attention_block_step)(const AttentionStepArgs *a) {
    const i64 Bn = a->batch, M = a->d_model, H = a->H, Hk = a->Hk, P = a->P, U = a->U, K = a->K, T = a->T;
    const i64 R = a->R, F = a->F, Z = (H + 2 * Hk) * P, E = Z + 2 * U, Y = H * P + U, per_kv = H / Hk;
    const REAL *hid = (const REAL *)a->hidden, *res = (const REAL *)a->residual;
    const REAL *in_b = (const REAL *)a->in_b, *conv_w = (const REAL *)a->conv_w, *conv_b = (const REAL *)a->conv_b;
    const REAL *inv_freq = (const REAL *)a->inv_freq, *out_b = (const REAL *)a->out_b;
    const REAL scale = (REAL)a->scale;
    REAL *conv_state = (REAL *)a->conv_state, *key = (REAL *)a->key, *value = (REAL *)a->value;
    i64 *lengths = (i64 *)a->lengths;
    REAL *new_hid = (REAL *)a->new_hidden, *new_res = (REAL *)a->new_residual;
    /* scratch: normed (Bn, M); proj (Bn, E), in_proj's output; qkv (Bn, Z), after the conv (K 0:
       a copy); yin (Bn, Y), out_proj's input; scores (Bn, H, T); fc (Bn, 2F) then gated (Bn, F) */
    REAL *normed = (REAL *)a->work, *proj = normed + Bn * M, *qkv = proj + Bn * E, *yin = qkv + Bn * Z;
    REAL *scores = yin + Bn * Y, *fc = scores + Bn * H * T, *gated = fc + Bn * 2 * F;
#pragma omp for schedule(static)
    for (i64 b = 0; b < Bn; b++)
        SUF(add_rms_norm)(hid + b * M, res ? res + b * M : NULL, (const REAL *)a->norm_w, a->eps, M,
                          new_res + b * M, normed + b * M);
    /* in_proj: q, k, v, then the MLP branch's up and gate */
    SUF(project)(&a->in_w, in_b, M, E, Bn, normed, M, proj, E);
#pragma omp for schedule(static)
    for (i64 i = 0; i < Bn * Z; i++) { /* the conv's step (no activation), or a copy */
        const i64 b = i / Z, c = i % Z;
        const REAL x = proj[b * E + c];
        if (K == 0) {
            qkv[i] = x;
            continue;
        }
        REAL *st = conv_state + i * K, acc = conv_b ? conv_b[c] : 0;
        for (i64 k = 0; k + 1 < K; k++) st[k] = st[k + 1];
        st[K - 1] = x;
        for (i64 k = 0; k < K; k++) acc += st[k] * conv_w[c * K + k];
        qkv[i] = acc;
    }
    /* rotary on every q and k head at the row's position; k and v into the cache there; the MLP
       branch into yin's last U channels */
#pragma omp for schedule(static)
    for (i64 i = 0; i < Bn * (H + Hk); i++) {
        const i64 b = i / (H + Hk), h = i % (H + Hk), t = lengths[b];
        REAL *x = qkv + b * Z + h * P; /* q heads first, then the k heads */
        if (R > 0) SUF(rotate_head)(x, R, (int)a->interleaved, inv_freq, t);
        if (h >= H && t < T) { /* t < T: the caller's promise; never a write past the cache */
            const i64 g = h - H, at = ((b * T + t) * Hk + g) * P;
            const REAL *v = qkv + b * Z + (H + Hk + g) * P;
            for (i64 p = 0; p < P; p++) {
                key[at + p] = x[p];
                value[at + p] = v[p];
            }
        }
    }
#pragma omp for schedule(static)
    for (i64 b = 0; b < Bn; b++) { /* up·SiLU(gate) */
        const REAL *up = proj + b * E + Z, *gate = up + U;
        REAL *y = yin + b * Y + H * P;
#pragma omp simd
        for (i64 u = 0; u < U; u++) y[u] = up[u] * gate[u] * SUF(sigmoid)(gate[u]);
    }
#pragma omp for schedule(static)
    for (i64 i = 0; i < Bn * H; i++) { /* query head h of row b over the row's t + 1 keys */
        const i64 b = i / H, h = i % H, g = h / per_kv, n = lengths[b] + 1 < T ? lengths[b] + 1 : T;
        const REAL *q = qkv + b * Z + h * P;
        REAL *s = scores + i * T, *ctx = yin + b * Y + h * P, top = -INFINITY, sum = 0;
        for (i64 j = 0; j < n; j++) {
            const REAL *kj = key + ((b * T + j) * Hk + g) * P;
            REAL dot = 0;
#pragma omp simd reduction(+ : dot)
            for (i64 p = 0; p < P; p++) dot += q[p] * kj[p];
            s[j] = dot * scale;
            top = s[j] > top ? s[j] : top;
        }
        for (i64 j = 0; j < n; j++) {
            s[j] = EXP(s[j] - top);
            sum += s[j];
        }
        for (i64 p = 0; p < P; p++) ctx[p] = 0;
        for (i64 j = 0; j < n; j++) {
            const REAL w = s[j] / sum, *vj = value + ((b * T + j) * Hk + g) * P;
#pragma omp simd
            for (i64 p = 0; p < P; p++) ctx[p] += w * vj[p];
        }
    }
#pragma omp single
    for (i64 b = 0; b < Bn; b++) lengths[b] += 1;
    /* out_proj */
    SUF(project)(&a->out_w, out_b, Y, M, Bn, yin, Y, new_hid, M);
    if (!a->fc1_w.w) return;
    SUF(gated_mlp_step)(Bn, M, F, &a->fc1_w, &a->fc2_w, (const REAL *)a->norm2_w, a->eps2, new_hid, new_res, normed,
                        fc, gated);
}

/* The decoding step of n attention blocks in order (layers[l] reads layers[l-1]'s outputs), then
   the LM head when head is not NULL, in one parallel region, as mamba_blocks_step (decode.c). */
void SUF(attention_blocks_step)(const AttentionStepArgs *layers, i64 n, const HeadArgs *head) {
#pragma omp parallel num_threads((int)layers[0].nthreads)
    {
        for (i64 l = 0; l < n; l++) SUF(attention_block_step)(layers + l);
        if (head) {
            const AttentionStepArgs *a = layers + n - 1;
            SUF(head_step)(head, a->batch, a->d_model, (const REAL *)a->new_hidden, (REAL *)a->new_residual,
                           (REAL *)a->work);
        }
    }
}
