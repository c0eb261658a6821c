/* What every kernel of the library shares, whatever its REAL: the C headers, OpenMP's thread
   numbers (or one thread without OpenMP), the int64 type, float exp / log1p that vectorise, the
   bounds of packed sequences, and the grab size of a dynamic schedule.

   Shape symbols: B batch, D channels, L length, N state size, G groups, S packed sequences,
   T chunk length (steps between saved states), E / F the linear scan's flattened dims before /
   after the scanned one, K the convolution's width, M a row's width (d_model or a norm's width). */

#ifndef SSM_COMMON_H
#define SSM_COMMON_H

#include <float.h>
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

/* Subnormal numbers flushed to zero, per thread, for the length of a sweep. A backward sweep
   carries the adjoint of a loss scored at the last positions back through products of decays
   exp(Δ·A) < 1, so over thousands of steps it shrinks through the subnormal range (1e-38 down to
   1e-45 in float), where every x86 multiply takes a microcode assist about a hundred times as
   slow: measured, a 2-layer d_model-64 Mamba-1 at L 4096, batch 16, loss on the last position,
   one thread: the selective backward 3,975 ms with subnormals, 482 ms flushed. A value under
   1.2e-38 (float) or 2.2e-308 (double) becomes 0, as on a GPU. Each parallel region sets the mode
   on entry and puts the thread's own mode back on exit, so no OpenMP thread of torch's keeps it. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int fp_mode;
static inline fp_mode flush_subnormals(void) {
    const fp_mode old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u); /* FTZ (bit 15): results; DAZ (bit 6): inputs */
    return old;
}
static inline void restore_fp_mode(fp_mode old) { _mm_setcsr(old); }
#elif defined(__aarch64__)
typedef uint64_t fp_mode;
static inline fp_mode flush_subnormals(void) {
    fp_mode old;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(old));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(old | (1ull << 24))); /* FZ */
    return old;
}
static inline void restore_fp_mode(fp_mode old) { __asm__ __volatile__("msr fpcr, %0" : : "r"(old)); }
#else /* elsewhere: subnormals kept (correct, slower) */
typedef int fp_mode;
static inline fp_mode flush_subnormals(void) { return 0; }
static inline void restore_fp_mode(fp_mode old) { (void)old; }
#endif

/* exp, log1p for float: branch-free (Cephes polynomials) so that loops over N or over a
   chunk's steps vectorise; a few ulp from libm's. Always inlined (as softplus and sigmoid in
   common_real.h): "static inline" leaves it to GCC's budget for the whole translation unit, and
   when decode_attention.c joined the library that budget ran out and the selective sweeps came
   out 1.5-1.75x slower (a Mamba-1 training step 0.45 -> 0.54 s, d_model 256, batch 8, L 512). */
static inline __attribute__((always_inline)) float exp_f32(float x) {
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

static inline __attribute__((always_inline)) float log_f32(float x) { /* x > 0, finite */
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

static inline __attribute__((always_inline)) float log1p_f32(float y) { /* y >= 0: log(1 + y), exact to a few ulp for tiny y */
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

#endif /* SSM_COMMON_H */
