/* Eight floats at a time with GCC/Clang vector extensions, which the compiler maps to the CPU it builds for
 * (-march=native: AVX2, AVX-512, NEON), and e^x on them by a polynomial (Cephes' expf: relative error ~1e-7). */
#ifndef SUPERVISE_VEC8_H
#define SUPERVISE_VEC8_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* where mask (all ones or all zeros per lane, as a comparison gives): a, else b */
static inline v8f select8(v8i mask, v8f a, v8f b) {
    v8i ia, ib, out;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    out = (mask & ia) | (~mask & ib);
    v8f f;
    memcpy(&f, &out, sizeof f);
    return f;
}

/* e^x for x <= 0 (scores minus their maximum); below -87 it is 0. */
static inline v8f exp8(v8f x) {
    v8i underflow = x <= splat(-87.0f);
    x = select8(underflow, splat(-87.0f), x);
    v8f n = x * splat(1.44269504088896341f);  /* x / ln 2 */
    /* rounded to the nearest integer: truncating n - 0.5 does that for n <= 0 */
    v8f fl = __builtin_convertvector(__builtin_convertvector(n - splat(0.5f), v8i), v8f);
    v8f r = x - fl * splat(0.693359375f) + fl * splat(2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    v8i bits = (__builtin_convertvector(fl, v8i) + 127) << 23;  /* 2^fl */
    v8f two;
    memcpy(&two, &bits, sizeof two);
    v8f out = p * two;
    return select8(underflow, splat(0.0f), out);
}

/* x / (1 + e^-x), from e^-|x| so that the exponent stays <= 0. */
static inline v8f silu8(v8f x) {
    v8i negative = x < splat(0.0f);
    v8f e = exp8(select8(negative, x, -x));
    return x * select8(negative, e, splat(1.0f)) / (splat(1.0f) + e);
}

#endif
