/* The one compiled library of ssm's CPU kernels (ssm/native/build.py compiles this file and
   loads it through ctypes): plain C11 + OpenMP, no Python or torch headers.

   Each family of kernels lives in its own file (selective.c, linear.c, conv.c, norm.c,
   decode_weights.c with decode_simd.c, decode.c, decode_mamba2.c, decode_mamba3.c,
   decode_attention.c, trapezoidal.c) over common.h; this file
   includes every family twice, REAL = float then double (REAL_IS_F32 1, then 0), so that every
   kernel exists as name_f32 and name_f64. One library keeps start-up to one compile and one
   load per process. */

#include "common.h"

#define REAL float
#define REAL_IS_F32 1
#define SUF(name) name##_f32
#define EXP exp_f32
#define LOG1P log1p_f32
#include "common_real.h"
#include "selective.c"
#include "linear.c"
#include "conv.c"
#include "norm.c"
#include "decode_weights.c"
#include "decode.c"
#include "decode_mamba2.c"
#include "decode_mamba3.c"
#include "decode_attention.c"
#include "trapezoidal.c"
#undef REAL
#undef REAL_IS_F32
#undef SUF
#undef EXP
#undef LOG1P

#define REAL double
#define REAL_IS_F32 0
#define SUF(name) name##_f64
#define EXP exp_f64
#define LOG1P log1p_f64
#include "common_real.h"
#include "selective.c"
#include "linear.c"
#include "conv.c"
#include "norm.c"
#include "decode_weights.c"
#include "decode.c"
#include "decode_mamba2.c"
#include "decode_mamba3.c"
#include "decode_attention.c"
#include "trapezoidal.c"
#undef REAL
#undef REAL_IS_F32
#undef SUF
#undef EXP
#undef LOG1P

/* Subnormals flushed to zero (on != 0) or the mode restored (on == 0) on every thread of an
   OpenMP team of nthreads: the threads torch's own parallel ops run on (the library shares
   torch's OpenMP runtime, whose team stays the same from one region to the next), so that a
   stretch of torch ops (ssm.native.flushed_subnormals) does not pay a microcode assist for each
   subnormal it reads or makes. Calls nest; each thread keeps the mode it had before the first. */
static __thread fp_mode ftz_saved;
static __thread int ftz_depth;
void ssm_flush_subnormals_on_threads(int on, i64 nthreads) {
    (void)nthreads; /* unused without OpenMP */
#pragma omp parallel num_threads((int)nthreads)
    {
        if (on) {
            if (ftz_depth++ == 0) ftz_saved = flush_subnormals();
        } else if (ftz_depth > 0 && --ftz_depth == 0) {
            restore_fp_mode(ftz_saved);
        }
    }
}

/* The version of the argument structs (ssm/native/build.py checks it at load). */
int ssm_kernels_abi(void) { return 15; }
