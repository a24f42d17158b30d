/* The small float32 ops of a Llama decoder layer on the CPU, each one pass over its rows: RMS norm, SiLU(gate) x
 * up, and RoPE on q and k with the K/V cache write.
 *
 * Why: at one decode row these ops do almost no arithmetic, and torch pays its per-op cost for each of the ops
 * it splits them into (rms_norm alone is six: pow, mean, add, rsqrt, mul, mul, about 20 us for 576 floats on a
 * 2-core AMD EPYC; RoPE and the cache write twelve, with the views); a decode step of SmolLM2-135M ran 30
 * layers of them. One call each costs about 2 us. Eight floats at a time (vec8.h); the rows are split among the
 * threads where there are enough of them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

/* fewer floats than this run on the calling thread: a parallel region costs more than it saves (about 2 us) */
#define PARALLEL_FLOATS 16384

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for rows of n floats (x rows `x_stride` apart, y contiguous). */
void rms_norm(const float *x, int64_t x_stride, int64_t rows, int64_t n, const float *w, float eps, float *y,
              int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1 && rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *yr = y + r * n;
        v8f acc = splat(0.0f);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            v8f v = load8(xr + i);
            acc += v * v;
        }
        float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for (; i < n; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (i = 0; i + 8 <= n; i += 8) store8(yr + i, load8(xr + i) * splat(inv) * load8(w + i));
        for (; i < n; i++) yr[i] = xr[i] * inv * w[i];
    }
}

/* gate_up [rows][2 * n] (gate, then up) -> y [rows][n] = silu(gate) * up. */
void silu_mul(const float *gate_up, int64_t rows, int64_t n, float *y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1 && rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *yr = y + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) store8(yr + i, silu8(load8(g + i)) * load8(u + i));
        for (; i < n; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* One head of d floats rotated as transformers' Llama: x * cos + rotate_half(x) * sin, with rotate_half(x) =
 * (-x[d/2:], x[:d/2]); `sin` comes with its first half negated (the lean forward's table), so the rotated half is
 * x rolled by d/2 times it. */
static inline void rotate(const float *x, const float *cos, const float *sin, int d, float *out) {
    int half = d / 2;
    for (int i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int i = half; i < d; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* qkv [rows][(heads + 2 * kv_heads) * d]: q heads, k heads, v heads. cos, sin [rows][d] (sin signed, above). Writes q rotated to
 * q_out [rows][heads][d], and k rotated and v as they are to the cache slots slots[row] of k_cache and v_cache
 * ([slots][kv_heads][d]). */
void rope_store(const float *qkv, int64_t rows, int heads, int kv_heads, int d, const float *cos, const float *sin,
                const int64_t *slots, float *q_out, float *k_cache, float *v_cache, int threads) {
    int64_t width = (int64_t)(heads + 2 * kv_heads) * d;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1 && rows * width >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * width, *c = cos + r * d, *s = sin + r * d;
        for (int h = 0; h < heads; h++) rotate(row + (int64_t)h * d, c, s, d, q_out + (r * heads + h) * d);
        float *k = k_cache + slots[r] * kv_heads * d, *v = v_cache + slots[r] * kv_heads * d;
        for (int h = 0; h < kv_heads; h++) rotate(row + (int64_t)(heads + h) * d, c, s, d, k + (int64_t)h * d);
        memcpy(v, row + (int64_t)(heads + kv_heads) * d, sizeof(float) * (size_t)kv_heads * (size_t)d);
    }
}
