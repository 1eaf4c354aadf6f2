/* exp(x) for the C kernels, within ~2 ulp of expf over [-87, 88] (x is clamped to it), written
 * so the compiler vectorizes it (libm's expf is a scalar call): Cody-Waite reduction with
 * explicit fmaf (so -fassociative-math cannot fold the two constants together), a degree-6
 * polynomial, 2^n built in the exponent bits. Vectorizing it needs -fno-trapping-math. */
#ifndef PDSERVE_FAST_EXP_H
#define PDSERVE_FAST_EXP_H
#include <math.h>
#include <stdint.h>

#pragma omp declare simd notinbranch
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}
#endif
