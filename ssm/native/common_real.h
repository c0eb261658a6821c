/* Helpers that every kernel family uses in the current REAL (float or double); library.c
   includes this once per REAL, before the families. */

/* softplus with torch's threshold: x above 20 is returned as is. */
static inline __attribute__((always_inline)) REAL SUF(softplus)(REAL x) { return x > 20 ? x : LOG1P(EXP(x)); }
static inline __attribute__((always_inline)) REAL SUF(sigmoid)(REAL x) { return 1 / (1 + EXP(-x)); }

/* out[i] = Σ over the region's threads th of part[th·stride + i], i < n: per-thread sums added in
   thread order, so the same bits on every run with as many threads. Run by every thread of the
   parallel region, after a barrier. */
static inline void SUF(sum_parts)(const REAL *part, i64 stride, i64 n, REAL *out) {
    const i64 team = omp_get_num_threads();
#pragma omp for schedule(static)
    for (i64 i = 0; i < n; i++) {
        REAL sum = 0;
        for (i64 th = 0; th < team; th++) sum += part[th * stride + i];
        out[i] = sum;
    }
}
